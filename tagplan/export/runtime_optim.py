"""The exported program's optimizer step: the costed optimizer, ZeRO shards on the pipeline runtime,
dynamic loss scaling under fp16.

Imported by the program (`runtime_train.py`). Each rank holds one `TrainOptimizer`: the runtime's
step (forwards, backwards, gradients summed over replicas and tied copies) ends with `prepare()`,
then `step()` updates the weights (or skips) and `zero_grad()` clears the gradients.

- Optimizer (`make_optimizer`): Adam, AdamW, SGD or SGD with momentum as costed (lr 1e-3), its state
  fp32 beside the fp32 weights; bf16/fp16 compute runs under autocast over those weights
  (`runtime_parallel.StageModule`). Each of them updates an element from that element's gradient and
  state only, so stepping contiguous slices of the flattened parameters is the same update.
- ZeRO 1/2 on the pipeline runtime (`ZeroShard`: a stage with dp > 1 and zero 1 or 2). The stage's
  parameters on this rank (its tensor-parallel pieces, the same shapes on every replica) are
  flattened in one order; dp rank k of the stage owns the k-th of dp equal contiguous slices (the
  last padded with zeros). Only that slice has an fp32 master copy and optimizer state here. After
  the backward, ZeRO 1 all-reduces the gradients over the stage's dp group
  (`runtime_pipeline.sum_replicas`) and keeps this rank's slice; ZeRO 2 reduce-scatters them instead
  (the tied table's gradient, which must be whole to be summed with its tied copy, is all-reduced
  first and enters the reduce-scatter from dp rank 0 only). Either way the whole-gradient buffers are
  freed once the slice is taken. After the optimizer step the updated slices are all-gathered within
  the dp group and written into the weights, which stay whole on every replica.
- ZeRO 3 on the pipeline runtime: the stage is FSDP2-sharded (`runtime_pipeline.shard_stage`), so
  its parameters are DTensor shards (1/dp of the weights per dp rank between steps) with sharded
  gradients, summed over the replicas by FSDP2's reduce-scatter; no `ZeroShard` here: the optimizer
  steps those shards directly, its state sharded with them (as on the mesh runtime,
  `runtime_parallel.apply_dp`). Either way gradients come in already weighted (each replica's loss
  is over the global batch), so uneven replicas keep their weighting.
- fp16 (`LossScaler`): dynamic loss scaling by torch.amp.GradScaler's rule (start at 2**16, halve
  on an overflow and skip the step, double after 2000 steps without one). The runtime multiplies
  the loss by the scale before the backward; `prepare` unscales every gradient the optimizer steps
  and all-reduces a found-inf flag over the world group, so every stage on every rank skips the
  same steps. bf16 and fp32 run without a scaler. plan.json may set "loss_scale": {"init": float,
  "growth_interval": int} and, as a test hook, "inject_inf": {"rank": int, "step": int}: one
  gradient element of that rank set to inf at that step, before the check.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tagplan.export.modules import local
from tagplan.export.runtime_parallel import StageModule

INIT_SCALE = 2.0**16
GROWTH_INTERVAL = 2000


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer the plan was costed with (its state in fp32, beside the fp32 master weights)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name in ("sgd", "sgd_momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if name == "sgd_momentum" else 0.0)
    return torch.optim.Adam(params, lr=1e-3)


def laid_out_grad(p: nn.Parameter) -> torch.Tensor | None:
    """p's gradient in p's own layout (an embedding's may come back replicated while its table is split)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        g = p.grad = g.redistribute(p.device_mesh, p.placements)
    return g


@dataclass
class LossScaler:
    """Dynamic loss scaling (torch.amp.GradScaler's rule) whose overflow check agrees over `group`
    (None: the world group)."""

    scale: float = INIT_SCALE
    growth_interval: int = GROWTH_INTERVAL
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    group: dist.ProcessGroup | None = None
    good_steps: int = 0

    def unscale_(self, grads: Iterable[torch.Tensor], device: torch.device) -> bool:
        """Divide `grads` (local tensors) by the scale in place; whether any element on any rank of
        the group is inf or nan (a collective: every rank of the group calls it)."""
        inv = 1.0 / self.scale
        bad = torch.zeros((), dtype=torch.float32, device=device)
        with torch.no_grad():
            for g in grads:
                g.mul_(inv)
                bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bool(bad.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` steps without one."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0


def make_scaler(cfg: dict[str, Any]) -> LossScaler | None:
    """A world-group scaler when the plan computes in fp16 (plan.json "loss_scale" may set "init" and
    "growth_interval"), else None."""
    if cfg.get("dtype") != "fp16":
        return None
    opts = cfg.get("loss_scale") or {}
    return LossScaler(scale=float(opts.get("init", INIT_SCALE)),
                      growth_interval=int(opts.get("growth_interval", GROWTH_INTERVAL)))


def shard_bounds(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of dp rank `rank`'s slice of `total` flattened elements padded to `world` equal
    slices; `end` may pass `total` on the last ranks (padding)."""
    chunk = math.ceil(total / world) if total else 0
    return rank * chunk, (rank + 1) * chunk


class ZeroShard:
    """One stage's ZeRO shard on this rank: the fp32 master slice of its flattened parameters that
    this dp rank steps, and the gradient reduction and weight all-gather around it.

    `whole` names the parameters whose gradients arrive already summed over replicas (the tied
    table); under ZeRO >= 2 they enter the reduce-scatter from dp rank 0 only.
    """

    def __init__(self, part: StageModule, zero: int, group: dist.ProcessGroup, *, whole: set[str]) -> None:
        self.zero, self.group = zero, group
        named = list(part.named_parameters())
        self.params = [p for _, p in named]
        self.whole = [name in whole for name, _ in named]
        with torch.no_grad():
            pieces = [local(p).detach() for p in self.params]
        self.shapes = [(t.shape, t.dtype) for t in pieces]
        self.numels = [t.numel() for t in pieces]
        self.total = sum(self.numels)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.start, self.end = shard_bounds(self.total, self.world, self.rank)
        flat = self._padded(torch.cat([t.reshape(-1).float() for t in pieces]))
        self.master = nn.Parameter(flat[self.start:self.end].clone())

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` extended with zeros to `dp` whole slices."""
        size = self.world * (self.end - self.start)
        return flat if flat.numel() >= size else torch.cat([flat, flat.new_zeros(size - flat.numel())])

    def _flat_grads(self) -> torch.Tensor:
        """The stage's local gradients in one fp32 vector (zeros where a gradient is None or, under
        ZeRO >= 2 off dp rank 0, already summed)."""
        out = []
        for p, n, whole in zip(self.params, self.numels, self.whole, strict=True):
            g = laid_out_grad(p)
            if g is None or (whole and self.zero >= 2 and self.rank != 0):
                out.append(torch.zeros(n, dtype=torch.float32, device=self.master.device))
            else:
                out.append(local(g).detach().reshape(-1).float())
        return self._padded(torch.cat(out))

    def reduce(self) -> None:
        """Give the master slice its summed gradient (ZeRO 1: slice of the all-reduced gradients;
        ZeRO >= 2: reduce-scatter) and free the whole gradients."""
        flat = self._flat_grads()
        if self.zero >= 2:
            grad = torch.empty_like(self.master)
            dist.reduce_scatter_tensor(grad, flat, group=self.group)
        else:
            grad = flat[self.start:self.end].clone()
        self.master.grad = grad
        for p in self.params:
            p.grad = None

    def _gather(self, piece: torch.Tensor) -> torch.Tensor:
        flat = torch.empty(self.world * piece.numel(), dtype=piece.dtype, device=piece.device)
        dist.all_gather_into_tensor(flat, piece.detach().contiguous(), group=self.group)
        return flat

    def gather_weights(self) -> None:
        """Write every replica's updated slice into this rank's weights (collective over the dp group)."""
        flat = self._gather(self.master)
        with torch.no_grad():
            for p, t in zip(self.params, self._split(flat), strict=True):
                local(p).copy_(t)

    def gather_grads(self) -> None:
        """Put the whole summed (unscaled) gradients back on the parameters, for the verify dump
        (collective over the dp group)."""
        assert self.master.grad is not None
        flat = self._gather(self.master.grad)
        for p, t in zip(self.params, self._split(flat), strict=True):
            piece = t.clone()
            p.grad = (DTensor.from_local(piece, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                      if isinstance(p, DTensor) else piece)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` cut back into this rank's parameter pieces (their local shapes and dtypes)."""
        out, offset = [], 0
        for (shape, dtype), n in zip(self.shapes, self.numels, strict=True):
            out.append(flat[offset:offset + n].view(shape).to(dtype))
            offset += n
        return out


@dataclass
class TrainOptimizer:
    """This rank's optimizer step: the costed optimizer over its parameters not in a ZeRO shard
    (whole, or a ZeRO-3 stage's FSDP2 DTensor shards, stepped as they are) and its ZeRO 1/2 master
    slices, with an optional fp16 loss scaler (which unscales DTensor gradients' local pieces).

    `params`: every parameter of the rank's stages (to clear their gradients); `plain`: those the
    optimizer steps directly. The runtime multiplies its loss by `loss_scale()` before the backward.
    """

    name: str
    params: list[nn.Parameter]
    plain: list[nn.Parameter]
    device: torch.device
    shards: list[ZeroShard] = field(default_factory=list)
    scaler: LossScaler | None = None
    inject_inf: dict[str, int] | None = None
    found_inf: bool = False
    steps: int = 0
    last: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.inner = make_optimizer(self.name, [*self.plain, *(s.master for s in self.shards)])

    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before this step's backward (1 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _grads(self) -> list[torch.Tensor]:
        """The local gradients the optimizer steps."""
        return [local(p.grad) for group in self.inner.param_groups for p in group["params"] if p.grad is not None]

    def prepare(self) -> None:
        """After the backward and the replica sums: reduce into the ZeRO slices; under fp16 unscale
        and decide, together with every rank, whether this step overflowed (collective)."""
        for shard in self.shards:
            shard.reduce()
        if self.scaler is None:
            self.found_inf = False
            return
        grads = self._grads()
        if self.inject_inf is not None and grads and self.inject_inf.get("step") == self.steps \
                and self.inject_inf.get("rank") == dist.get_rank():
            grads[0].view(-1)[0] = math.inf
        self.found_inf = self.scaler.unscale_(grads, self.device)

    def gather_grads(self) -> None:
        """Whole gradients back on the ZeRO 1/2 stages' parameters (verify dump; collective). A ZeRO-3
        stage's gradients stay sharded DTensors (`full_tensor()` gathers them)."""
        for shard in self.shards:
            shard.gather_grads()

    def step(self) -> None:
        """Step the optimizer and all-gather the ZeRO slices, or skip both after an overflow; then
        adjust the loss scale."""
        self.last = {}
        if self.scaler is not None:
            self.last = {"loss_scale": self.scaler.scale, "skipped": self.found_inf}
        if not self.found_inf:
            self.inner.step()
            for shard in self.shards:
                shard.gather_weights()
        if self.scaler is not None:
            self.scaler.update(self.found_inf)
        self.steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the optimizer and of every parameter of the rank's stages (the
        stages' always to None: a ZeRO stage holds none between steps)."""
        self.inner.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad = None

    def report(self) -> dict[str, Any]:
        """What the last step's JSON line adds: the loss scale it ran with and whether it was skipped
        (fp16 only)."""
        return dict(self.last)


def train_optimizer(cfg: dict[str, Any], parts: dict[int, StageModule], device: torch.device, *,
                    shards: list[ZeroShard] | None = None) -> TrainOptimizer:
    """The rank's TrainOptimizer: plan.json's optimizer over every parameter not in `shards`."""
    shards = shards or []
    params = [p for part in parts.values() for p in part.parameters()]
    sharded = {id(p) for s in shards for p in s.params}
    return TrainOptimizer(cfg.get("optimizer", "adam"), params, [p for p in params if id(p) not in sharded], device,
                          shards, make_scaler(cfg), cfg.get("inject_inf"))


def full_params(parts: dict[int, StageModule]) -> dict[str, torch.Tensor]:
    """Every parameter whole by name (collective over each stage's tp ranks)."""
    with torch.no_grad():
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
                for part in parts.values() for name, p in part.named_parameters()}
