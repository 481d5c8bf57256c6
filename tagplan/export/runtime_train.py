"""A training program exported by tagplan from a Plan: `launch_node*.sh` (torchrun) or `torchrun ... train.py`.

`tagplan.export.torch_program` copies this file into the run directory as `train.py`, beside
the `plan.json` it reads (model SPEC, workload, the rank table, per stage its layers, mesh,
recompute, ZeRO stage and resolved per-op tensor-parallel strategies). It needs only torch and
tagplan: the model's layers (`tagplan.export.modules`) and how a rank parallelizes them.
World rank r runs cluster device `ranks[r]["device"]` of plan.json (`tagplan.export.node_launch`);
at start every rank checks that it sits on the node and GPU type the plan says, and stops naming
the mismatch otherwise. Two runtimes, chosen at export (`runtime` in plan.json):
- `mesh`: every stage has the same (dp, tp) and even batch shares: one ("pp", "dp", "tp") mesh,
  `torch.distributed.pipelining` with the plan's schedule, FSDP2/replicate data parallelism
  (`tagplan.export.runtime_parallel`; ZeRO 1/2/3 are FSDP2's sharding of weights, gradients and
  optimizer state); one stage runs its micro-batches in a plain loop;
- `pipeline`: anything else (`tagplan.export.runtime_pipeline`): per-stage meshes, activations
  re-split between stages of different dp or tp, whole-sample shares per replica; ZeRO 1 and 2
  shard optimizer state (and, for 2, reduce-scatter gradients) over each stage's dp group
  (`tagplan.export.runtime_optim`), ZeRO 3 shards the weights too (FSDP2 over the stage's dp mesh,
  gradients summed over its replicas).
Compute runs in the plan's dtype (bf16/fp16 autocast over fp32 master weights) with the costed
optimizer (`runtime_optim.TrainOptimizer`); `--verify` runs fp32. fp16 adds dynamic loss scaling
(GradScaler's rule) whose overflow check is agreed by all ranks: an overflowing step is skipped
everywhere and the scale halved.

Every step prints one JSON line per rank: step, rank, stages, seconds, loss (last stage only),
the parameter elements the rank holds between steps (`param_elements`; a shard's under ZeRO 3), and
under fp16 the loss scale it ran with and whether it was skipped. `--verify DIR` also saves,
after the first backward, the loss and every parameter's full (unscaled) gradient
(`DTensor.full_tensor()`) keyed by its name in the single-process model, and after the last step
every parameter (`params_*.pt`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from tagplan.export.node_launch import RENDEZVOUS_ENV, startup_problems
from tagplan.export.runtime_layout import programs, stage_layouts
from tagplan.export.runtime_loss import kernel_of
from tagplan.export.runtime_optim import TrainOptimizer, full_params, train_optimizer
from tagplan.export.runtime_parallel import (
    CURRENT_OP,
    LossSplit,
    Rank,
    StageModule,
    build_parts,
    sum_token_split,
    sync_tied,
    tie_group,
)
from tagplan.export.runtime_pipeline import PipelineRunner, build_stage, make_groups, sharded_stages, zero_shards
from tagplan.export.shapes import ModelConfig, model_config
from tagplan.ir.plan import Plan
from tagplan.ir.workload import LossKernel

# /3: stages may carry `recompute_layers` (checkpoint only a stage's first N blocks); a /2 runtime
# would ignore it and recompute every block, so it must refuse the file.
# /4: matmuls may be `sequence` (token-split, weight gradients summed over tp), a tied table's copies
# may be split unalike (`tied_split_alike`) and the loss may read split logits (`loss_split`); a /3
# runtime would leave those gradients unsummed and read split logits as whole ones.
PROGRAM_FORMAT = "tagplan-torch-program/4"
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
# FSDP2 warns that a module returns a view; nothing here modifies module outputs in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
StepFn = Callable[[torch.Tensor, torch.Tensor], "float | None"]


class Save(Protocol):
    """A runtime's verify dump: step 0's gradients and loss, or (`params`) the weights after the last step."""

    def __call__(self, out: Path, loss: float | None, *, params: bool = False) -> None: ...


Built = tuple[dict[int, StageModule], StepFn, Save, TrainOptimizer]


def synthetic_batch(vocab: int, global_batch: int, seq_len: int, *, step: int, seed: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(tokens, labels), each (global_batch, seq_len) int64: random tokens, labels shifted by one."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    data = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


class Runner:
    """The mesh runtime: one step's forward and backward over all micro-batches; the mean loss or None."""

    def __init__(self, cfg: dict[str, Any], config: ModelConfig, parts: dict[int, StageModule], rank: Rank,
                 compute: torch.dtype | None = None) -> None:
        self.parts, self.micro, self.compute = parts, cfg["micro_batches"], compute
        self.split = LossSplit(cfg.get("loss_split"), rank.mesh["tp"] if cfg.get("loss_split") else None,
                               kernel_of(cfg), config.vocab)
        self.num_stages = len(cfg["stages"])
        self.schedule: Any = None
        self.loss_scale = 1.0  # the backward runs on loss * loss_scale (fp16); reported losses are unscaled
        if cfg["mesh"]["pp"] > 1:
            group = rank.mesh["pp"].get_group()
            stages: list[Any] = []
            for i, part in parts.items():
                example_in, example_out = self._example_io(cfg, config, i, rank.device)
                stages.append(PipelineStage(part, i, self.num_stages, rank.device, input_args=example_in,
                                            output_args=example_out, group=group))
            if cfg["schedule"] == "interleaved_1f1b":
                self.schedule = ScheduleInterleaved1F1B(stages, self.micro, loss_fn=self._scaled_loss)
            else:
                cls = ScheduleGPipe if cfg["schedule"] == "gpipe" else Schedule1F1B
                self.schedule = cls(stages[0], self.micro, loss_fn=self._scaled_loss)

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        split = self.split
        return split.loss(logits, labels) * (split.share(labels) * self.loss_scale)

    def _example_io(self, cfg: dict[str, Any], config: ModelConfig, index: int, device: torch.device) -> tuple[
            torch.Tensor, torch.Tensor]:
        """One micro-batch's input and output of stage `index` (static shapes: no metadata inference,
        whose forward on meta tensors does not mix with tensor-parallel collectives)."""
        batch = cfg["global_batch"] // cfg["mesh"]["dp"] // self.micro
        seq = cfg["seq_len"] // (cfg["mesh"]["tp"] if cfg["sequence_parallel"] else 1)
        hidden = torch.empty(batch, seq, config.hidden, device=device, requires_grad=True)
        first = torch.empty(batch, cfg["seq_len"], dtype=torch.long, device=device)
        tp, split = cfg["mesh"]["tp"], cfg.get("loss_split")
        seq = cfg["seq_len"] // (tp if split == "tokens" else 1)
        vocab = self.split.local_vocab()  # this rank's rows of the head
        logits = self.compute if self.compute is not None and self.split.kernel is LossKernel.FUSED else None
        last = torch.empty(batch, seq, vocab, device=device, requires_grad=True, dtype=logits or torch.float32)
        return first if index == 0 else hidden, last if index == self.num_stages - 1 else hidden

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Forward and backward of this rank's share of one batch; gradients end averaged (and
        multiplied by `loss_scale`); the unscaled mean loss on the last stage."""
        if self.schedule is None:
            return self._local(tokens, labels)
        first, last = 0 in self.parts, self.num_stages - 1 in self.parts
        losses: list[torch.Tensor] = []
        args = (tokens,) if first else ()
        with self.split.context():
            self.schedule.step(*args, target=labels if last else None, losses=losses if last else None,
                               return_outputs=False)  # the losses are all it needs: keep no micro-batch's logits
        if not last:
            return None
        return float(self.split.total(torch.stack([self.split.value(x) for x in losses]).mean())) / self.loss_scale

    def _local(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        losses = []
        for m, (x, y) in enumerate(zip(tokens.chunk(self.micro), labels.chunk(self.micro), strict=True)):
            for part in self.parts.values():
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(m == self.micro - 1)
                x = part(x)
            with self.split.context():
                loss = self.split.loss(x, y) * self.split.share(y)
                (loss * (self.loss_scale / self.micro)).backward()
            losses.append(self.split.value(loss))
        return float(self.split.total(torch.stack(losses).mean()))


def full_grads(parts: dict[int, StageModule]) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name (collective over the stage's dp x tp ranks)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts.values():
        for name, p in part.named_parameters():
            g = p.grad
            if g is None:
                continue
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().float().cpu().clone()
    return out


def local_elements(parts: dict[int, StageModule]) -> int:
    """How many parameter elements this rank holds between steps (a sharded DTensor's local piece)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for part in parts.values()
               for p in part.parameters())


def dp_mean(value: float | None, rank: Rank) -> float | None:
    """The loss averaged over the stage's replicas (all ranks of a dp group must call it)."""
    if value is None or rank.mesh["dp"].size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rank.device)
    dist.all_reduce(t, group=rank.mesh["dp"].get_group())
    return float(t.item()) / rank.mesh["dp"].size()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None else None


def rendezvous() -> str | None:
    """Where this launch's ranks meet (`RENDEZVOUS_ENV`: a local launch's own store), or None: torchrun's env://.
    SystemExit naming the variable for a value that is no rendezvous URL."""
    init = os.environ.get(RENDEZVOUS_ENV) or None
    if init is not None and not init.startswith(("file://", "tcp://", "env://")):
        raise SystemExit(f"{RENDEZVOUS_ENV} = {init!r}: the ranks meet at a file://, tcp:// or env:// URL")
    return init


def setup(cfg: dict[str, Any], timeout_s: float) -> torch.device:
    """Check this rank's place against the rank table, pin its GPU, join the process group (NCCL on
    CUDA, else gloo); SystemExit naming every mismatch between the launch and the plan."""
    cuda = torch.cuda.is_available() and os.environ.get("TAGPLAN_DEVICE", "") != "cpu"
    rank, world = _env_int("RANK") or 0, _env_int("WORLD_SIZE") or 1
    table = cfg["ranks"]
    local_gpu = table[rank]["local_gpu"] if rank < len(table) else 0
    problems = startup_problems(
        table, rank=rank, world=world, local_world=_env_int("LOCAL_WORLD_SIZE"), node_rank=_env_int("GROUP_RANK"),
        gpu_count=torch.cuda.device_count() if cuda else None,
        gpu_name=torch.cuda.get_device_name(local_gpu) if cuda and local_gpu < torch.cuda.device_count() else None)
    if problems:
        raise SystemExit("this process cannot run the plan as launched:\n" + "\n".join(f"  - {p}" for p in problems))
    if cuda:
        torch.cuda.set_device(local_gpu)
    else:  # a CPU takes a slow assist on every subnormal float, a GPU none: flush them as a GPU would
        torch.set_flush_denormal(True)
    backend, timeout = "nccl" if cuda else "gloo", timedelta(seconds=timeout_s)
    init = rendezvous()
    if init:
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def mesh_runtime(cfg: dict[str, Any], config: ModelConfig, device: torch.device, *, track: bool,
                 compute: torch.dtype | None = None) -> Built:
    """The mesh runtime's parts, step, verify dump and optimizer (ZeRO is FSDP2's, `runtime_parallel.apply_dp`);
    `compute`: the parts' autocast dtype (`StageModule.compute_dtype`)."""
    shape = (cfg["mesh"]["pp"], cfg["mesh"]["dp"], cfg["mesh"]["tp"])
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
    rank = Rank(mesh, mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(), device)
    parts = build_parts(cfg, config, rank, track=track)
    set_compute(cfg, parts, compute)
    group = tie_group(cfg, config, rank)
    runner = Runner(cfg, config, parts, rank, compute)
    optimizer = train_optimizer(cfg, parts, device)
    per_replica = cfg["global_batch"] // cfg["mesh"]["dp"]

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> float | None:
        rows = slice(rank.dp * per_replica, (rank.dp + 1) * per_replica)
        runner.loss_scale = optimizer.loss_scale()
        loss = runner.step(tokens[rows].to(device), labels[rows].to(device))
        if cfg["mesh"]["tp"] > 1:
            for part in parts.values():
                sum_token_split(part, rank.mesh["tp"].get_group())
        sync_tied(parts, config, group, alike=cfg.get("tied_split_alike", True))
        optimizer.prepare()
        return dp_mean(loss, rank)

    def save(out: Path, loss: float | None, *, params: bool = False) -> None:
        tensors = full_params(parts) if params else full_grads(parts)
        if rank.dp == 0 and rank.tp == 0:
            torch.save(tensors, out / f"{'params' if params else 'grads'}_pp{rank.pp}.pt")
            if loss is not None:
                (out / "loss.json").write_text(json.dumps({"loss": loss}))

    return parts, step, save, optimizer


def set_compute(cfg: dict[str, Any], parts: dict[int, StageModule], compute: torch.dtype | None) -> None:
    """Each part's autocast dtype; under a fused loss the last stage hands back its logits in it."""
    for index, part in parts.items():
        part.compute_dtype = compute
        part.hands_back_logits = index == len(cfg["stages"]) - 1 and kernel_of(cfg) is LossKernel.FUSED


def pipeline_runtime(cfg: dict[str, Any], config: ModelConfig, device: torch.device, *, track: bool,
                     compute: torch.dtype | None = None) -> Built:
    """The pipeline runtime's parts, step, verify dump and optimizer (`tagplan.export.runtime_pipeline`;
    ZeRO 1/2 shards: `runtime_optim.ZeroShard`; ZeRO 3: FSDP2, `runtime_pipeline.shard_stage`); `compute` as
    `mesh_runtime`'s."""
    plan = Plan.model_validate(cfg["plan"])
    rank = dist.get_rank()
    rank_of = {row["device"]: r for r, row in enumerate(cfg["ranks"])}
    layouts = stage_layouts(plan, rank_of, cfg["global_batch"] // plan.micro_batches)
    groups = make_groups(layouts, rank, tied=config.tied, device_type=device.type, sharded=sharded_stages(cfg))
    mine = [lay for lay in layouts if lay.place(rank) is not None]
    parts = {lay.index: build_stage(cfg, config, lay, groups, device, track=track) for lay in mine}
    set_compute(cfg, parts, compute)
    program = programs(plan)[plan.stages[mine[0].index].devices] if mine else []
    runner = PipelineRunner(cfg, config, rank, device, layouts, program, groups, parts)
    optimizer = train_optimizer(cfg, parts, device, shards=zero_shards(cfg, parts, groups, config, runner))

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> float | None:
        runner.loss_scale = optimizer.loss_scale()
        loss = runner.step(tokens, labels)
        optimizer.prepare()
        return loss

    def save(out: Path, loss: float | None, *, params: bool = False) -> None:
        if not params:
            optimizer.gather_grads()  # ZeRO 1/2 stages hold only their slice (ZeRO 3's: full_tensor)
        for lay in mine:
            one = {lay.index: parts[lay.index]}
            tensors = full_params(one) if params else full_grads(one)
            if lay.place(rank) == (0, 0):
                torch.save(tensors, out / f"{'params' if params else 'grads'}_stage{lay.index}.pt")
                if loss is not None and lay.index == len(layouts) - 1:
                    (out / "loss.json").write_text(json.dumps({"loss": loss}))

    return parts, step, save, optimizer


def train(cfg: dict[str, Any], device: torch.device, *, steps: int, verify: Path | None) -> None:
    """`steps` training steps with the costed optimizer, one JSON line per step; with `verify`,
    dump step 0's gradients and, after the last step, the parameters."""
    config = model_config(cfg["model"], seq_len=cfg["seq_len"])
    torch.manual_seed(cfg["seed"])
    build = pipeline_runtime if cfg["runtime"] == "pipeline" else mesh_runtime
    compute = None if verify is not None else COMPUTE_DTYPES[cfg.get("dtype", "fp32")]
    parts, step_fn, save, optimizer = build(cfg, config, device, track=verify is not None, compute=compute)
    for step in range(steps):
        tokens, labels = synthetic_batch(config.vocab, cfg["global_batch"], cfg["seq_len"], step=step,
                                         seed=cfg["seed"])
        start = time.perf_counter()
        loss = step_fn(tokens, labels)
        if verify is not None and step == 0:
            save(verify, loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        line = {"step": step, "rank": dist.get_rank(), "stages": sorted(parts), "time_s": seconds, "loss": loss,
                "param_elements": local_elements(parts), **optimizer.report()}
        if device.type == "cuda":
            line["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        print(json.dumps(line), flush=True)
    if verify is not None:
        save(verify, None, params=True)


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, read plan.json, train; in verify mode record a failure before re-raising."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", type=Path, default=Path(__file__).with_name("plan.json"))
    parser.add_argument("--steps", type=int, default=None, help="default: the plan file's")
    parser.add_argument("--verify", type=Path, default=None, help="folder for step 0's gradients and loss")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="collective timeout")
    args = parser.parse_args(argv)
    cfg = json.loads(args.plan.read_text())
    if cfg.get("format") != PROGRAM_FORMAT:
        raise SystemExit(f"{args.plan}: not a {PROGRAM_FORMAT} file")
    device = setup(cfg, args.timeout_s)
    try:
        train(cfg, device, steps=args.steps or cfg["steps"], verify=args.verify)
    except Exception as err:
        if args.verify is not None:
            report = {"rank": dist.get_rank(), "time": time.time(), "op": CURRENT_OP[0],
                      "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-4000:]}
            (args.verify / f"error_rank{dist.get_rank()}.json").write_text(json.dumps(report))
        raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
