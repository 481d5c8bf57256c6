"""Where memory forbids the compute-balanced layer split: the cuts each pipeline stage can take at all.

The decision process cuts the layers near the split that balances the stages' compute
(`PlanSpace._boundary_candidates`). Where the GPUs are short of memory for the model, that split can be
unrunnable under every memory option: GPT-3 13B over two RTX 4090 nodes and a T4 node (8 x 24 GB + 4 x 16 GB)
balances to 19 layers on each 4090 group, which do not fit even with ZeRO-3 and full recomputation, while a
split of 18, 17 and 7 does; searching near the balanced split, the planner then answered that no plan fits.

`Capacity` describes one pipeline shape (its device groups, TP degrees and context-parallel degree) under
the most frugal options the search can still choose for it: full recomputation, ZeRO-3 wherever a stage has
data parallelism, the most micro-batches (the fewest samples per replica), a 1F1B schedule, and any of the batch
splits the search may give the stage (even, or by speed where its replicas differ). Memory grows
with the layers a stage holds, so each limit is a binary search over one end, each probe the simulator's
closed-form memory check of one stage holding its devices alone (`Simulator.stage_fits_alone`, no timing):

- `cap(k, start)`: the last end stage k can take from `start` and still fit;
- `floor(k)`: the first end of stage k that leaves the later stages no more than they can hold, filled
  greedily from the last stage back (each taking as many of the last layers as it can hold).

A cut outside [floor, cap] cannot give a plan that fits under any memory option. `Capacity.binding` says
whether the limits matter at all: False where the compute-balanced split fits under the frugal options, in
which case the decision process keeps its candidates as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from tagplan.cost.pipeline import max_in_flight
from tagplan.cost.simulator import Simulator
from tagplan.ir.plan import Schedule, Stage
from tagplan.search.groups import Partition

SampleSplits = Callable[[tuple[int, ...], int, int], Collection[tuple[int, ...] | None]]
"""(device group, devices per replica, samples per micro-batch) -> the splits of the micro-batch over the group's
replicas that the search may give it (`Stage.batch_samples`; None: the exact even split)."""


class Capacity:
    """The layer cuts that can fit, per stage, for one pipeline shape (see the module)."""

    def __init__(self, sim: Simulator, groups: Partition, tps: Sequence[int], cp: int, *,
                 balanced_bounds: Sequence[int], micro_batches: int, splits: SampleSplits) -> None:
        """`balanced_bounds`: the compute-balanced cuts (end layer of every stage but the last);
        `micro_batches`: the most micro-batches the search may choose for the shape; `splits`: the batch splits it
        may give a stage (each checked: a cut fits where one of them does)."""
        self.sim = sim
        self.layers = len(sim.model.layers)
        self._meshes = [(group, tp, len(group) // (tp * cp)) for group, tp in zip(groups, tps, strict=True)]
        self._cp = cp
        self._micro_batches = micro_batches
        self._splits = splits
        stages = len(self._meshes)
        self._in_flight = [float(n) for n in max_in_flight(stages, micro_batches, Schedule.ONE_F_ONE_B, stages)]
        self._caps: dict[tuple[int, int], int] = {}
        self._floors: list[int] | None = None
        bounds = [0, *balanced_bounds, self.layers]
        self.binding = not all(self._fits(k, bounds[k], bounds[k + 1]) for k in range(stages))

    def cap(self, k: int, start: int) -> int:
        """The last end stage `k` can take from layer `start` and fit (start + 1 where not even one layer fits),
        leaving every later stage a layer."""
        hit = self._caps.get((k, start))
        if hit is None:
            low, high = start + 1, self.layers - (len(self._meshes) - 1 - k)
            while low < high:  # the last fitting end lies in [low, high]
                mid = (low + high + 1) // 2
                if self._fits(k, start, mid):
                    low = mid
                else:
                    high = mid - 1
            hit = self._caps[(k, start)] = low
        return hit

    def floor(self, k: int) -> int:
        """The first end of stage `k` whose remaining layers the later stages can hold (see the module); where a
        later stage cannot hold even one layer, it is counted as holding one (the shape cannot fit: some floor
        then lies above its cap)."""
        if self._floors is None:
            floors = [self.layers] * len(self._meshes)
            for j in range(len(self._meshes) - 1, 0, -1):
                end = floors[j]
                low, high = 1, end - j  # stage j holds [end - n, end), the j stages before it one layer each
                while low < high:  # the most layers that fit lie in [low, high]
                    mid = (low + high + 1) // 2
                    if self._fits(j, end - mid, end):
                        low = mid
                    else:
                        high = mid - 1
                floors[j - 1] = end - low
            self._floors = floors
        return self._floors[k]

    def _fits(self, k: int, start: int, end: int) -> bool:
        group, tp, dp = self._meshes[k]
        per_micro = self.sim.workload.global_batch // self._micro_batches
        return any(self.sim.stage_fits_alone(
            Stage(layers=(start, end), devices=group, dp=dp, tp=tp, cp=self._cp, batch_samples=samples,
                  recompute=True, zero=3 if dp * self._cp > 1 else 0), self._micro_batches, self._in_flight[k])
            for samples in self._splits(group, tp * self._cp, per_micro))
