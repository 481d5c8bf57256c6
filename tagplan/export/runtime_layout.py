"""Where every sample, rank and action of a plan goes in the exported pipeline runtime (no torch).

The pipeline runtime (`tagplan.export.runtime_pipeline`) runs any plan the planner emits on one
process group: each stage on its own (dp, tp) mesh, its own whole-sample share per replica. This
module is its arithmetic, kept pure so it is tested without processes:
- `StageLayout`: a stage's world ranks (tp-fastest, then dp, as the plan orders its devices) and
  the rows of a micro-batch each replica takes (`Stage.replica_samples`, contiguous, in replica order);
- `transfers`: which rows go from which producing replica to which consuming replica between two
  adjacent stages (their row ranges intersected);
- `programs`: each device group's ordered list of actions ("F"/"B", stage, micro-batch) for the
  plan's schedule, checked deadlock-free by `simulate` (sends never block; receives do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tagplan.ir.plan import Plan, Schedule

Action = tuple[str, int, int]
"""("F" or "B", stage index, micro-batch index)."""


@dataclass(frozen=True)
class StageLayout:
    """One stage's ranks and its replicas' rows of each micro-batch.

    `ranks[r * tp + t]` is the world rank of replica r's tensor-parallel rank t; replica r takes
    rows `[offsets[r], offsets[r] + samples[r])` of every micro-batch.
    """

    index: int
    ranks: tuple[int, ...]
    dp: int
    tp: int
    samples: tuple[int, ...]
    offsets: tuple[int, ...]

    def replica_ranks(self, r: int) -> tuple[int, ...]:
        """World ranks of replica `r`'s tensor-parallel group."""
        return self.ranks[r * self.tp:(r + 1) * self.tp]

    def dp_ranks(self, t: int) -> tuple[int, ...]:
        """World ranks holding tensor-parallel rank `t` of every replica (one data-parallel group)."""
        return self.ranks[t::self.tp]

    def place(self, rank: int) -> tuple[int, int] | None:
        """(replica, tp rank) of world rank `rank` in this stage; None when the stage does not use it."""
        if rank not in self.ranks:
            return None
        return divmod(self.ranks.index(rank), self.tp)

    def rows(self, r: int) -> tuple[int, int]:
        """[start, end) of replica `r`'s rows within a micro-batch."""
        return self.offsets[r], self.offsets[r] + self.samples[r]


def stage_layouts(plan: Plan, rank_of: dict[int, int], micro_batch_size: int) -> list[StageLayout]:
    """Every stage's layout; `rank_of` maps a cluster device to its world rank. ValueError when a
    replica would get a fraction of a sample (`Stage.replica_samples`)."""
    out = []
    for i, stage in enumerate(plan.stages):
        samples = stage.replica_samples(micro_batch_size)
        offsets = tuple(sum(samples[:r]) for r in range(stage.dp))
        # within a replica, tensor-parallel ranks ascend: a process group orders its members so
        ranks = tuple(x for r in range(stage.dp) for x in sorted(rank_of[d] for d in stage.replica(r)))
        out.append(StageLayout(i, ranks, stage.dp, stage.tp, samples, offsets))
    return out


@dataclass(frozen=True)
class Transfer:
    """Rows `[start, end)` of a micro-batch, held by producing replica `src` and consuming replica `dst`.

    `src_rows` and `dst_rows` are the same rows counted from each replica's first row.
    """

    src: int
    dst: int
    start: int
    end: int
    src_offset: int
    dst_offset: int

    @property
    def src_rows(self) -> tuple[int, int]:
        """The rows within the producing replica's part."""
        return self.start - self.src_offset, self.end - self.src_offset

    @property
    def dst_rows(self) -> tuple[int, int]:
        """The rows within the consuming replica's part."""
        return self.start - self.dst_offset, self.end - self.dst_offset


def transfers(producer: StageLayout, consumer: StageLayout) -> list[Transfer]:
    """Every (producing replica, consuming replica) pair whose rows overlap, in consumer-row order."""
    out = []
    for d in range(consumer.dp):
        d0, d1 = consumer.rows(d)
        for s in range(producer.dp):
            s0, s1 = producer.rows(s)
            lo, hi = max(d0, s0), min(d1, s1)
            if lo < hi:
                out.append(Transfer(s, d, lo, hi, s0, d0))
    return out


def device_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The distinct device groups in stage order (one per pipeline rank)."""
    return list(dict.fromkeys(s.devices for s in plan.stages))


def programs(plan: Plan) -> dict[tuple[int, ...], list[Action]]:
    """Each device group's actions in the order it runs them, for the plan's schedule.

    gpipe: all forwards, then all backwards. 1f1b: `stages - i - 1` warm-up forwards, then one
    forward one backward, then the remaining backwards. interleaved_1f1b: Megatron's order (rounds
    of `groups` micro-batches, chunk by chunk; backwards chunk-reversed) with its warm-up depth.
    A program that `simulate` finds could deadlock falls back to all forwards then all backwards.
    """
    groups = device_groups(plan)
    out = {}
    for p, group in enumerate(groups):
        mine = [i for i, s in enumerate(plan.stages) if s.devices == group]
        fwd, bwd = _orders(mine, plan.micro_batches, len(groups))
        warmup = _warmup(plan, p, len(groups), len(mine))
        out[group] = _interleave(fwd, bwd, warmup)
    if simulate(plan, out) is not None:
        out = {}
        for group in groups:
            mine = [i for i, s in enumerate(plan.stages) if s.devices == group]
            fwd, bwd = _orders(mine, plan.micro_batches, len(groups))
            out[group] = fwd + bwd
    return out


def _orders(stages: list[int], micro: int, rounds_of: int) -> tuple[list[Action], list[Action]]:
    fwd: list[Action] = []
    bwd: list[Action] = []
    for start in range(0, micro, rounds_of):
        batch = range(start, min(start + rounds_of, micro))
        fwd += [("F", s, m) for s in stages for m in batch]
        bwd += [("B", s, m) for s in reversed(stages) for m in batch]
    return fwd, bwd


def _warmup(plan: Plan, p: int, groups: int, chunks: int) -> int:
    total = chunks * plan.micro_batches
    if plan.schedule is Schedule.GPIPE:
        return total
    if plan.schedule is Schedule.INTERLEAVED_1F1B and chunks > 1:
        return min((groups - p - 1) * 2 + (chunks - 1) * groups, total)
    return min(groups - p - 1, total)


def _interleave(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    out = list(fwd[:warmup])
    rest = fwd[warmup:]
    for i, b in enumerate(bwd):
        if i < len(rest):
            out.append(rest[i])
        out.append(b)
    return out


def simulate(plan: Plan, progs: dict[tuple[int, ...], list[Action]]) -> str | None:
    """None when every program runs to its end with blocking receives and non-blocking sends;
    else a message naming the actions each group is stuck at."""
    last = len(plan.stages) - 1
    done: set[Action] = set()
    pos = dict.fromkeys(progs, 0)
    while True:
        moved = False
        for group, prog in progs.items():
            while pos[group] < len(prog) and _ready(prog[pos[group]], done, last):
                done.add(prog[pos[group]])
                pos[group] += 1
                moved = True
        if all(pos[g] == len(p) for g, p in progs.items()):
            return None
        if not moved:
            stuck = [prog[pos[g]] for g, prog in progs.items() if pos[g] < len(prog)]
            return f"the pipeline programs deadlock at {stuck[:4]}"


def _ready(action: Action, done: set[Action], last: int) -> bool:
    kind, s, m = action
    if kind == "F":
        return s == 0 or ("F", s - 1, m) in done
    return ("F", s, m) in done and (s == last or ("B", s + 1, m) in done)


def node_order(devices: Sequence[int], node_of: dict[int, int]) -> list[int]:
    """Nodes in the order their first device appears in `devices` (the plan's stage order)."""
    return list(dict.fromkeys(node_of[d] for d in devices))


def rank_devices(devices: Sequence[int], node_of: dict[int, int] | None) -> list[int]:
    """Cluster devices in world-rank order. torchrun numbers ranks node by node (`--node-rank`), so
    ranks follow `node_order`, then the device index within a node; without nodes (one host, or
    `verify`), the plan's own order."""
    if node_of is None:
        return list(devices)
    order = node_order(devices, node_of)
    return sorted(devices, key=lambda d: (order.index(node_of[d]), d))
