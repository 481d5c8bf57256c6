"""The pipeline runtime: any plan on one process group, each stage on its own (dp, tp) mesh.

Imported by the exported program (`runtime_train.py`) for plans one ("pp", "dp", "tp") mesh
cannot hold: stages of different dp or tp, uneven whole-sample batch shares, schedules
torch.distributed.pipelining refuses. Per rank:
- groups: every stage's tensor-parallel group per replica and data-parallel group per tp rank
  (`dist.new_group`, created by every rank in one order), a tp `DeviceMesh` on each, and on a
  ZeRO-3 stage's dp group a dp mesh (with tp > 1, the two axes of one (dp, tp) mesh);
- layers: built as one process would (`modules.build_layer`), split over the stage's tp mesh
  (`runtime_parallel.apply_tp`), blocks checkpointed on `recompute` stages;
- a step: the device group's program (`runtime_layout.programs`) of forwards and backwards. Between
  stages, tp rank 0 of each producing replica sends every consuming replica the rows it takes
  (`runtime_layout.transfers`); the receiver broadcasts them over its tp group, which takes its
  part of the sequence under sequence parallelism. Gradients go back the same way;
- the loss of a replica is its samples' summed token cross-entropy over `global_batch * seq_len`,
  so replica gradients are summed over the stage's dp group: one step is the mean over the global
  batch whatever the shares; token-split matmuls' gradients are first summed over the stage's tp
  group. The tied embedding and head sum their gradients. Under fp16 the last
  stage's backward starts from the loss times the runner's `loss_scale` (`runtime_optim.LossScaler`);
- ZeRO 1 and 2 (`zero_shards`, stages with dp > 1): each dp rank steps a contiguous slice of the
  stage's flattened parameters and keeps optimizer state for it only (`runtime_optim.ZeroShard`).
  ZeRO 1 all-reduces gradients here and slices them; ZeRO 2 leaves them to the shard's
  reduce-scatter (except the tied table's, summed here with its copy). Weights stay whole;
- ZeRO 3 (`shard_stage`, stages with dp > 1): FSDP2 `fully_shard(reshard_after_forward=True)` on
  each layer and on the stage, over the stage's dp mesh (1-D, or the "dp" axis of a (dp, tp) mesh
  whose "tp" axis the layers are split over), so each dp rank holds 1/dp of the stage's weights
  between steps (and its gradients and optimizer state as DTensor shards, stepped directly). Its
  reduce-scatter sums (divide factor 1), after every micro-batch's backward; the tied table's
  gradient is gathered whole, summed with its copy and sharded back (`sum_tied`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from tagplan.export.modules import build_layer, set_stage_recompute, tied_param_names
from tagplan.export.runtime_layout import Action, StageLayout, Transfer, transfers
from tagplan.export.runtime_loss import kernel_of
from tagplan.export.runtime_optim import ZeroShard
from tagplan.export.runtime_parallel import (
    LossSplit,
    StageModule,
    apply_tp,
    sum_token_split,
)
from tagplan.export.shapes import ModelConfig


@dataclass
class Groups:
    """This rank's process groups, by stage index (only the stages it runs)."""

    tp: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    tp_mesh: dict[int, DeviceMesh] = field(default_factory=dict)
    dp: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    dp_mesh: dict[int, DeviceMesh] = field(default_factory=dict)  # ZeRO-3 stages: FSDP2's mesh
    tie: dist.ProcessGroup | None = None


def make_groups(layouts: list[StageLayout], rank: int, *, tied: bool, device_type: str,
                sharded: frozenset[int] = frozenset()) -> Groups:
    """Every stage's tp and dp groups (every rank creates all of them, in one order), a tp mesh on
    each of this rank's tp groups, for the `sharded` (ZeRO-3) stages with dp > 1 a dp mesh (the
    "dp" axis of a (dp, tp) mesh when tp > 1), and the tie group (ranks of the first and the last
    stage) when the head is tied to a separate stage."""
    out = Groups()
    for lay in layouts:
        for r in range(lay.dp if lay.tp > 1 else 0):
            ranks = list(lay.replica_ranks(r))
            group = dist.new_group(ranks)
            if rank in ranks:
                out.tp[lay.index] = group
        for t in range(lay.tp if lay.dp > 1 else 0):
            ranks = list(lay.dp_ranks(t))
            group = dist.new_group(ranks)
            if rank in ranks:
                out.dp[lay.index] = group
        if lay.place(rank) is not None:
            _stage_meshes(out, lay, rank, device_type, sharded=lay.index in sharded)
    if tied and len(layouts) > 1:
        ranks = sorted(set(layouts[0].ranks) | set(layouts[-1].ranks))
        group = dist.new_group(ranks)
        out.tie = group if rank in ranks else None
    return out


def _stage_meshes(out: Groups, lay: StageLayout, rank: int, device_type: str, *, sharded: bool) -> None:
    """This rank's tp mesh for stage `lay` and, when it is sharded (ZeRO 3, dp > 1), its dp mesh."""
    s = lay.index
    r, t = lay.place(rank) or (0, 0)
    fsdp = sharded and s in out.dp
    if fsdp and s in out.tp:
        grid = torch.tensor(lay.ranks).view(lay.dp, lay.tp)
        mesh = DeviceMesh.from_group([out.dp[s], out.tp[s]], device_type, mesh=grid, mesh_dim_names=("dp", "tp"))
        out.dp_mesh[s], out.tp_mesh[s] = mesh["dp"], mesh["tp"]
        return
    if s in out.tp:
        out.tp_mesh[s] = DeviceMesh.from_group(out.tp[s], device_type, mesh=list(lay.replica_ranks(r)),
                                               mesh_dim_names=("tp",))
    if fsdp:
        out.dp_mesh[s] = DeviceMesh.from_group(out.dp[s], device_type, mesh=list(lay.dp_ranks(t)),
                                               mesh_dim_names=("dp",))


def build_stage(cfg: dict[str, Any], config: ModelConfig, lay: StageLayout, groups: Groups, device: torch.device, *,
                track: bool) -> StageModule:
    """Stage `lay.index`'s layers, split over its tp mesh, blocks checkpointed when it recomputes,
    FSDP2-sharded over its dp mesh when it is a ZeRO-3 stage (`shard_stage`)."""
    stage = cfg["stages"][lay.index]
    start, end = stage["layers"]
    part = StageModule({j: build_layer(config, j, seed=cfg["seed"]) for j in range(start, end)}).to(device)
    if lay.tp > 1:
        apply_tp(part, config, stage, groups.tp_mesh[lay.index], sp=cfg["sequence_parallel"], track=track)
    set_stage_recompute(part.layers.values(), bool(stage["recompute"]), stage.get("recompute_layers"))
    if lay.index in groups.dp_mesh:
        shard_stage(part, groups.dp_mesh[lay.index])
    return part


def shard_stage(part: StageModule, mesh: DeviceMesh) -> None:
    """ZeRO 3: FSDP2 on each layer and on the stage over the dp mesh, weights resharded after the
    forward and the backward; gradients reduce-scattered as a sum (the losses are already over the
    global batch), in fp32 SUM collectives (gloo has no premultiplied sum)."""
    for layer in part.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(part, mesh=mesh, reshard_after_forward=True)
    for module in part.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(part: StageModule) -> bool:
    """Whether the stage's weights are FSDP2-sharded (ZeRO 3 on dp > 1)."""
    return isinstance(part, FSDPModule)


class PipelineRunner:
    """One step's forwards and backwards of this rank's stages, in its device group's program order."""

    def __init__(self, cfg: dict[str, Any], config: ModelConfig, rank: int, device: torch.device,
                 layouts: list[StageLayout], program: list[Action], groups: Groups,
                 parts: dict[int, StageModule]) -> None:
        self.cfg, self.config, self.rank, self.device = cfg, config, rank, device
        self.layouts, self.program, self.groups, self.parts = layouts, program, groups, parts
        self.micro = cfg["micro_batches"]
        self.mb = cfg["global_batch"] // self.micro
        self.links = [transfers(a, b) for a, b in itertools.pairwise(layouts)]
        self.width = 1 + max((len(x) for x in self.links), default=0)
        self.dtype = torch.float32
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.mailbox: dict[int, torch.Tensor] = {}
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.loss_scale = 1.0  # the last stage's backward starts from loss * loss_scale (fp16)
        self.scattered: dict[int, set[str]] = {}  # per stage, gradients a ZeRO shard reduce-scatters later
        last = len(layouts) - 1  # a column or token-split head's logits stay split: the loss reads their parts
        mesh = groups.tp_mesh.get(last) if cfg.get("loss_split") and last in parts else None
        self.split = LossSplit(cfg.get("loss_split") if mesh is not None else None, mesh, kernel_of(cfg), config.vocab)

    def _sp(self, s: int, edge: int) -> bool:
        """Whether stage s's input (edge 0) or output (edge 1) is split along the sequence on its tp ranks."""
        lay, layers = self.layouts[s], self.cfg["stages"][s]["layers"]
        at_end = layers[0] == 0 if edge == 0 else layers[1] == self.config.num_layers
        return bool(self.cfg["sequence_parallel"]) and lay.tp > 1 and not at_end

    def _tag(self, boundary: int, m: int, kind: int, index: int) -> int:
        return ((boundary * self.micro + m) * 2 + kind) * self.width + index

    def _post(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if dst == self.rank:
            self.mailbox[tag] = tensor.clone()
            return
        tensor = tensor.contiguous()
        self.sends.append((dist.isend(tensor, dst, tag=tag), tensor))

    def _take(self, rows: int, src: int, tag: int) -> torch.Tensor:
        if src == self.rank:
            return self.mailbox.pop(tag)
        buf = torch.empty(rows, self.cfg["seq_len"], self.config.hidden, dtype=self.dtype, device=self.device)
        dist.recv(buf, src, tag=tag)
        return buf

    def _mine(self, s: int, kind: int, replica: int, receiving: bool) -> list[tuple[int, Transfer]]:
        """The transfers across boundary `s -> s+1` that `replica` sends or receives in direction `kind`
        (0: activations forward, 1: gradients backward), with their index for the tag."""
        produces = (kind == 0) != receiving  # this side is the producing stage s
        return [(i, x) for i, x in enumerate(self.links[s]) if (x.src if produces else x.dst) == replica]

    def _send(self, s: int, m: int, kind: int, full: torch.Tensor) -> None:
        """Tp rank 0 of this replica sends each peer replica its rows of `full` across boundary `s -> s+1`."""
        side, other = (s, s + 1) if kind == 0 else (s + 1, s)
        r, t = self.layouts[side].place(self.rank) or (0, 0)
        if t != 0:
            return
        for i, x in self._mine(s, kind, r, receiving=False):
            a, b = x.src_rows if kind == 0 else x.dst_rows
            peer = x.dst if kind == 0 else x.src
            self._post(full[a:b].to(self.dtype), self.layouts[other].replica_ranks(peer)[0], self._tag(s, m, kind, i))

    def _recv(self, s: int, m: int, kind: int) -> torch.Tensor:
        """This replica's rows across boundary `s -> s+1`: tp rank 0 receives them from each peer replica
        and broadcasts them over the replica's tp group."""
        side, other = (s + 1, s) if kind == 0 else (s, s + 1)
        lay = self.layouts[side]
        r, t = lay.place(self.rank) or (0, 0)
        if t == 0:
            pieces = [self._take(x.end - x.start, self.layouts[other].replica_ranks(x.src if kind == 0 else x.dst)[0],
                                 self._tag(s, m, kind, i)) for i, x in self._mine(s, kind, r, receiving=True)]
            got = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        else:
            got = torch.empty(lay.samples[r], self.cfg["seq_len"], self.config.hidden, dtype=self.dtype,
                              device=self.device)
        if lay.tp > 1:
            dist.broadcast(got, lay.replica_ranks(r)[0], group=self.groups.tp[side])
        return got

    def _gather_seq(self, s: int, local: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(local) for _ in range(self.layouts[s].tp)]
        dist.all_gather(pieces, local.contiguous(), group=self.groups.tp[s])
        return torch.cat(pieces, dim=1)

    def forward(self, s: int, m: int, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Stage s on micro-batch m; returns the loss term on the last stage."""
        lay = self.layouts[s]
        r, t = lay.place(self.rank) or (0, 0)
        a, b = lay.rows(r)
        rows = slice(m * self.mb + a, m * self.mb + b)
        if s == 0:
            x = tokens[rows].to(self.device)
        else:
            full = self._recv(s - 1, m, 0)
            piece = full.chunk(lay.tp, dim=1)[t] if self._sp(s, 0) else full
            x = piece.contiguous().requires_grad_()
            self.inputs[(s, m)] = x
        y = self.parts[s](x)
        if s == len(self.layouts) - 1:
            loss = self.split.loss(y, labels[rows].to(self.device), reduction="sum")
            loss = loss / (self.cfg["global_batch"] * self.cfg["seq_len"])
            self.outputs[(s, m)] = loss
            return self.split.value(loss)
        self.outputs[(s, m)] = y
        with torch.no_grad():
            full_out = self._gather_seq(s, y) if self._sp(s, 1) else y.detach()
        self._send(s, m, 0, full_out)
        return None

    def backward(self, s: int, m: int) -> None:
        """The backward of stage s on micro-batch m; sends the input gradient to the producers."""
        lay = self.layouts[s]
        _, t = lay.place(self.rank) or (0, 0)
        out = self.outputs.pop((s, m))
        if s == len(self.layouts) - 1:
            (out * self.loss_scale if self.loss_scale != 1.0 else out).backward()
        else:
            grad = self._recv(s, m, 1)
            out.backward(grad.chunk(lay.tp, dim=1)[t].contiguous() if self._sp(s, 1) else grad)
        if s > 0:
            x = self.inputs.pop((s, m))
            gx = x.grad if x.grad is not None else torch.zeros_like(x)
            full = self._gather_seq(s, gx) if self._sp(s, 0) else gx
            self._send(s - 1, m, 1, full)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Run the program, sum gradients over replicas (but those in `scattered`) and tied copies;
        the global-batch mean loss (unscaled) on last-stage ranks, else None."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.split.context():  # a vocabulary-parallel loss's backward needs it too
            for kind, s, m in self.program:
                if kind == "F":
                    loss = self.forward(s, m, tokens, labels)
                    if loss is not None:
                        total += loss.double()
                else:
                    self.backward(s, m)
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        for s, part in self.parts.items():
            if s in self.groups.tp:
                sum_token_split(part, self.groups.tp[s])
        sum_replicas(self.parts, self.groups, skip=self.scattered)
        sum_tied(self.parts, self.layouts, self.groups, self.config, self.rank)
        last = len(self.layouts) - 1
        if last not in self.parts:
            return None
        self.split.total(total)  # a token-split head's ranks each hold their tokens' share
        if last in self.groups.dp:
            dist.all_reduce(total, group=self.groups.dp[last])
        return float(total.item())


def sharded_stages(cfg: dict[str, Any]) -> frozenset[int]:
    """The ZeRO-3 stages (plan.json gives zero 0 where dp == 1): FSDP2 shards their weights."""
    return frozenset(i for i, st in enumerate(cfg["stages"]) if int(st["zero"]) >= 3)


def _laid_out(p: torch.nn.Parameter) -> torch.Tensor | None:
    """p's gradient in p's own layout (an embedding's may come back replicated while its table is split)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        g = p.grad = g.redistribute(p.device_mesh, p.placements)
    return g


def sum_replicas(parts: dict[int, StageModule], groups: Groups, *, skip: dict[int, set[str]] | None = None) -> None:
    """Sum every gradient over its stage's replicas (their losses are already over the global batch),
    but those `skip` names for the stage (a ZeRO shard reduce-scatters them) and those of ZeRO-3
    stages (FSDP2 summed them)."""
    for s, part in parts.items():
        group = groups.dp.get(s)
        if group is None or is_sharded(part):  # FSDP2 reduce-scattered them in the backward
            continue
        for name, p in part.named_parameters():
            if skip and name in skip.get(s, ()):
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = _laid_out(p)
            assert g is not None
            dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)


def sum_tied(parts: dict[int, StageModule], layouts: list[StageLayout], groups: Groups, config: ModelConfig,
             rank: int) -> None:
    """Give the embedding table and the tied head's copy the sum of their two gradients (a copy in
    a ZeRO-3 stage is gathered whole over its dp x tp ranks, a collective there, and sharded back)."""
    tied = tied_param_names(config)
    if tied is None:
        return
    names = [(0, tied[0]), (len(layouts) - 1, tied[1])]
    held = [(s, p) for s, name in names if s in parts for n, p in parts[s].named_parameters() if n == name]
    if not held:
        return
    with torch.no_grad():
        fulls = []
        for s, p in held:
            g = _laid_out(p)
            assert g is not None
            fulls.append((s, p, g.full_tensor() if isinstance(g, DTensor) else g.clone()))
        if groups.tie is None:  # both copies on this rank's one stage
            total = sum((f for _, _, f in fulls), torch.zeros_like(fulls[0][2]))
        else:
            total = torch.zeros_like(fulls[0][2])
            for s, _, f in fulls:
                if layouts[s].place(rank) == (0, 0):
                    total += f
            dist.all_reduce(total, group=groups.tie)
        for _, p, _ in fulls:
            if isinstance(p, DTensor):
                p.grad = distribute_tensor(total, p.device_mesh, p.placements, src_data_rank=None)
            else:
                p.grad = total.clone()


def zero_shards(cfg: dict[str, Any], parts: dict[int, StageModule], groups: Groups, config: ModelConfig,
                runner: PipelineRunner) -> list[ZeroShard]:
    """A ZeRO shard for each of this rank's stages with dp > 1 and zero 1 or 2 (ZeRO-3 stages are
    FSDP2-sharded, `shard_stage`); the runner leaves the gradients of ZeRO-2 stages (but the tied
    table's) to the shard's reduce-scatter."""
    tied = tied_param_names(config)
    ends = [(0, tied[0]), (len(cfg["stages"]) - 1, tied[1])] if tied is not None else []
    shards = []
    for s, part in sorted(parts.items()):
        zero = int(cfg["stages"][s]["zero"])
        if zero < 1 or s not in groups.dp or is_sharded(part):
            continue
        whole = {name for i, name in ends if i == s}
        shards.append(ZeroShard(part, zero, groups.dp[s], whole=whole))
        if zero >= 2:
            runner.scattered[s] = {name for name, _ in part.named_parameters()} - whole
    return shards
