"""A training program exported by tagplan from a Plan: `torchrun --nproc-per-node N train.py`.

It reads `plan.json` beside it (written by `tagplan.export.torch_program.write_torch_program`:
model SPEC, workload, mesh degrees, per stage its layers, recompute, ZeRO stage and resolved
per-op tensor-parallel strategies) and needs only torch and tagplan (for the model's layers,
`tagplan.export.modules`). Rank r runs device `plan.devices[r]` of the plan: ranks are ordered
pipeline rank, then data-parallel replica, then tensor-parallel rank, the plan's own order.

Per rank it builds its stage's layers (the same numbers a single process would build), then:
1. tensor parallelism (`parallelize_module` on the "tp" mesh axis): column -> ColwiseParallel,
   row -> RowwiseParallel, replicate -> left whole; the vocabulary projection gathers its logits;
2. recomputation: each block of a `recompute` stage checkpoints its forward;
3. data parallelism on the "dp" axis: ZeRO 0 -> `replicate` (DDP on FSDP2's machinery), ZeRO 1/2
   -> `fully_shard(reshard_after_forward=False)`, ZeRO 3 -> `fully_shard(reshard_after_forward=True)`;
4. pipeline parallelism on the "pp" axis with the plan's schedule (`torch.distributed.pipelining`);
   one stage runs its micro-batches in a plain gradient-accumulation loop.
A tied head keeps its own copy of the embedding table; the two copies' gradients are summed
after each backward (Megatron's embedding group), so they stay equal.

Every step prints one JSON line per rank: step, rank, stages, seconds, loss (last stage only).
`--verify DIR` also saves, after the first backward, the loss and every parameter's full
gradient (`DTensor.full_tensor()`) keyed by its name in the single-process model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional

from tagplan.export.modules import Block, ModelConfig, build_layer, model_config, tp_ops

PROGRAM_FORMAT = "tagplan-torch-program/1"
SEQUENCE = Shard(1)  # activations (batch, seq, hidden) split along the sequence
STREAM_WRITERS = ("attn.o", "mlp.fc2", "mlp.down")  # matmuls whose output joins the residual stream
_CURRENT_OP = ["(before the first layer)"]  # verify mode: the last tensor-parallel op entered
# FSDP2 warns that a module returns a view; nothing here modifies module outputs in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def synthetic_batch(vocab: int, global_batch: int, seq_len: int, *, step: int, seed: int) -> tuple[
        torch.Tensor, torch.Tensor]:
    """(tokens, labels), each (global_batch, seq_len) int64: random tokens, labels shifted by one."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    data = torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; logits (b, s, vocab), labels (b, s)."""
    return functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class StageModule(nn.Module):
    """Layers `[start, end)` of the layer list, named by their index in the whole model."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


@dataclass(frozen=True)
class Rank:
    """This process's place on the ("pp", "dp", "tp") mesh."""

    mesh: DeviceMesh
    pp: int
    dp: int
    tp: int
    device: torch.device


def linear_style(strategy: str, *, writes_stream: bool, sp: bool) -> ParallelStyle | None:
    """The style of a Linear under `strategy`. A Linear that writes the residual stream (attn.o,
    mlp.fc2, mlp.down) hands it back replicated, or split along the sequence with `sp`."""
    stream = SEQUENCE if sp else Replicate()
    if strategy == "column":
        return ColwiseParallel()
    if strategy == "row":
        return RowwiseParallel(output_layouts=stream) if writes_stream else RowwiseParallel()
    if writes_stream and sp:  # a whole (replicated) matmul: keep this rank's part of the sequence
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=SEQUENCE, use_local_output=True)
    return None


def head_style(strategy: str, *, sp: bool) -> ParallelStyle | None:
    """The vocabulary projection: it gathers its logits (the loss is computed whole)."""
    source = SEQUENCE if sp else Replicate()
    if strategy == "column":
        return ColwiseParallel(input_layouts=source, output_layouts=Replicate())
    if strategy == "row":
        return RowwiseParallel()
    return _gather() if sp else None


def embedding_style(strategy: str) -> ParallelStyle | None:
    """Row: vocabulary-parallel table; column: hidden-split table; both hand back whole vectors."""
    if strategy == "row":
        return RowwiseParallel(input_layouts=Replicate())
    if strategy == "column":
        return ColwiseParallel(output_layouts=Replicate())
    return None


def _gather() -> ParallelStyle:
    return PrepareModuleInput(input_layouts=(SEQUENCE,), desired_input_layouts=(Replicate(),), use_local_output=True)


def layer_styles(layer: nn.Module, index: int, config: ModelConfig, strategies: dict[str, str], *,
                 sp: bool) -> dict[str, ParallelStyle]:
    """Module path -> ParallelStyle for one layer. With sequence parallelism (`sp`) the residual
    stream between layers is split along the sequence: norms run on their part (SequenceParallel),
    attention and MLP gather it first, and the embedding hands back this rank's part."""
    styles: dict[str, ParallelStyle | None] = {}
    for op, path in tp_ops(config, index).items():
        strategy = strategies.get(op, "replicate")
        if isinstance(layer.get_submodule(path), nn.Embedding):
            styles[path] = embedding_style(strategy)
        elif path == "lm_head":
            styles[path] = head_style(strategy, sp=sp)
        else:
            styles[path] = linear_style(strategy, writes_stream=op in STREAM_WRITERS, sp=sp)
    if sp and isinstance(layer, Block):
        styles.update({name: SequenceParallel(use_local_output=True) for name in layer.norm_names})
        styles.update({"attn": _gather(), "mlp": _gather()})
    if sp and index == config.num_layers - 1:
        styles["final_norm"] = SequenceParallel(use_local_output=True)
    return {path: style for path, style in styles.items() if style is not None}


def apply_tp(part: StageModule, config: ModelConfig, stage: dict[str, Any], mesh: DeviceMesh, *, sp: bool,
             track: bool) -> None:
    """Split each layer's matmuls and embeddings over the "tp" axis as the stage's strategies say."""
    for key, layer in part.layers.items():
        index, strategies = int(key), stage["strategies"].get(key, {})
        styles = layer_styles(layer, index, config, strategies, sp=sp)
        if track:
            for op, path in tp_ops(config, index).items():
                label = f"layers.{index}.{path} ({strategies.get(op, 'replicate')})"
                layer.get_submodule(path).register_forward_pre_hook(
                    lambda *_, label=label: _CURRENT_OP.__setitem__(0, label))
        if styles:
            parallelize_module(layer, mesh, styles)
        if sp and index == 0:  # whole embeddings in, this rank's part of the sequence out
            parallelize_module(layer, mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=SEQUENCE, use_local_output=True))


def apply_dp(part: StageModule, zero: int, mesh: DeviceMesh) -> None:
    """ZeRO 0: replicate; 1 and 2: shard, keep gathered weights until backward; 3: reshard after forward."""
    if zero == 0:
        replicate(part, mesh=mesh)
        return
    for layer in part.layers.values():
        fully_shard(layer, mesh=mesh, reshard_after_forward=zero >= 3)
    fully_shard(part, mesh=mesh, reshard_after_forward=zero >= 3)


def build_parts(cfg: dict[str, Any], config: ModelConfig, rank: Rank, *, track: bool) -> dict[int, StageModule]:
    """This rank's stages (plan stage index -> module), parallelized in the order TP, recompute, DP.

    Layers are initialized on the CPU from their own generators (the numbers one process would
    build), moved to the device, then split.
    """
    parts: dict[int, StageModule] = {}
    for i, stage in enumerate(cfg["stages"]):
        if stage["pp_rank"] != rank.pp:
            continue
        start, end = stage["layers"]
        part = StageModule({j: build_layer(config, j, seed=cfg["seed"]) for j in range(start, end)}).to(rank.device)
        if cfg["mesh"]["tp"] > 1:
            apply_tp(part, config, stage, rank.mesh["tp"], sp=cfg["sequence_parallel"], track=track)
        for layer in part.layers.values():
            if isinstance(layer, Block):
                layer.recompute = bool(stage["recompute"])
        if cfg["mesh"]["dp"] > 1:
            apply_dp(part, stage["zero"], rank.mesh["dp"])
        parts[i] = part
    return parts


def tie_group(cfg: dict[str, Any], config: ModelConfig, rank: Rank) -> dist.ProcessGroup | None:
    """The pair group (first and last pipeline rank at this rank's dp, tp) for a tied head split
    across pipeline ranks; None when not tied, or both copies are on one rank. Every rank calls it."""
    first, last = cfg["stages"][0]["pp_rank"], cfg["stages"][-1]["pp_rank"]
    if not config.tied or first == last:
        return None
    dp, tp = cfg["mesh"]["dp"], cfg["mesh"]["tp"]
    mine = None
    for d in range(dp):
        for t in range(tp):
            group = dist.new_group([(first * dp + d) * tp + t, (last * dp + d) * tp + t])
            if (d, t) == (rank.dp, rank.tp) and rank.pp in (first, last):
                mine = group
    return mine


def sync_tied(parts: dict[int, StageModule], config: ModelConfig, group: dist.ProcessGroup | None) -> None:
    """Sum the gradients of the embedding table and the tied head's copy (both hold the sum).

    A gradient is first laid out like its parameter (an embedding's may come back replicated
    while its table is split), so that the two copies' local pieces match element for element.
    """
    if not config.tied:
        return
    names = ("layers.0.wte.weight", f"layers.{config.num_layers - 1}.lm_head.weight")
    params = [p for part in parts.values() for name, p in part.named_parameters() if name in names]
    with torch.no_grad():
        for p in params:
            if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads = [p.grad for p in params if p.grad is not None]
        if group is not None:
            for g in grads:
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)
        elif len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])


class Runner:
    """One training step's forward and backward over all micro-batches; returns the mean loss or None."""

    def __init__(self, cfg: dict[str, Any], config: ModelConfig, parts: dict[int, StageModule], rank: Rank) -> None:
        self.parts, self.micro = parts, cfg["micro_batches"]
        self.num_stages = len(cfg["stages"])
        self.schedule: Any = None
        if cfg["mesh"]["pp"] > 1:
            group = rank.mesh["pp"].get_group()
            stages: list[Any] = []
            for i, part in parts.items():
                example_in, example_out = self._example_io(cfg, config, i, rank.device)
                stages.append(PipelineStage(part, i, self.num_stages, rank.device, input_args=example_in,
                                            output_args=example_out, group=group))
            if cfg["schedule"] == "interleaved_1f1b":
                self.schedule = ScheduleInterleaved1F1B(stages, self.micro, loss_fn=loss_fn)
            else:
                cls = ScheduleGPipe if cfg["schedule"] == "gpipe" else Schedule1F1B
                self.schedule = cls(stages[0], self.micro, loss_fn=loss_fn)

    def _example_io(self, cfg: dict[str, Any], config: ModelConfig, index: int, device: torch.device) -> tuple[
            torch.Tensor, torch.Tensor]:
        """One micro-batch's input and output of stage `index` (static shapes: no metadata inference,
        whose forward on meta tensors does not mix with tensor-parallel collectives)."""
        batch = cfg["global_batch"] // cfg["mesh"]["dp"] // self.micro
        seq = cfg["seq_len"] // (cfg["mesh"]["tp"] if cfg["sequence_parallel"] else 1)
        hidden = torch.empty(batch, seq, config.hidden, device=device, requires_grad=True)
        first = torch.empty(batch, cfg["seq_len"], dtype=torch.long, device=device)
        last = torch.empty(batch, cfg["seq_len"], config.vocab, device=device, requires_grad=True)
        return first if index == 0 else hidden, last if index == self.num_stages - 1 else hidden

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Forward and backward of this rank's share of one batch; gradients end averaged."""
        if self.schedule is None:
            return self._local(tokens, labels)
        first, last = 0 in self.parts, self.num_stages - 1 in self.parts
        losses: list[torch.Tensor] = []
        args = (tokens,) if first else ()
        self.schedule.step(*args, target=labels if last else None, losses=losses if last else None)
        return float(torch.stack(losses).mean()) if last else None

    def _local(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        losses = []
        for m, (x, y) in enumerate(zip(tokens.chunk(self.micro), labels.chunk(self.micro), strict=True)):
            for part in self.parts.values():
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(m == self.micro - 1)
                x = part(x)
            loss = loss_fn(x, y)
            (loss / self.micro).backward()
            losses.append(loss.detach())
        return float(torch.stack(losses).mean())


def full_grads(parts: dict[int, StageModule]) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by name (collective over the stage's dp x tp ranks)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts.values():
        for name, p in part.named_parameters():
            g = p.grad
            if g is None:
                continue
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().cpu().clone()
    return out


def dp_mean(value: float | None, rank: Rank) -> float | None:
    """The loss averaged over the stage's replicas (all ranks of a dp group must call it)."""
    if value is None or rank.mesh["dp"].size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=rank.device)
    dist.all_reduce(t, group=rank.mesh["dp"].get_group())
    return float(t.item()) / rank.mesh["dp"].size()


def setup(cfg: dict[str, Any], timeout_s: float) -> Rank:
    """Process group and the ("pp", "dp", "tp") mesh; CUDA (NCCL) when available, else CPU (gloo)."""
    cuda = torch.cuda.is_available() and os.environ.get("TAGPLAN_DEVICE", "") != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    shape = (cfg["mesh"]["pp"], cfg["mesh"]["dp"], cfg["mesh"]["tp"])
    mesh = init_device_mesh("cuda" if cuda else "cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return Rank(mesh, mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank(),
                device)


def train(cfg: dict[str, Any], rank: Rank, *, steps: int, verify: Path | None) -> None:
    """`steps` training steps (Adam), one JSON line per step; with `verify`, dump step 0's gradients."""
    config = model_config(cfg["model"], seq_len=cfg["seq_len"])
    torch.manual_seed(cfg["seed"])
    parts = build_parts(cfg, config, rank, track=verify is not None)
    group = tie_group(cfg, config, rank)
    runner = Runner(cfg, config, parts, rank)
    params = [p for part in parts.values() for p in part.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    per_replica = cfg["global_batch"] // cfg["mesh"]["dp"]
    for step in range(steps):
        tokens, labels = synthetic_batch(config.vocab, cfg["global_batch"], cfg["seq_len"], step=step,
                                         seed=cfg["seed"])
        rows = slice(rank.dp * per_replica, (rank.dp + 1) * per_replica)
        start = time.perf_counter()
        loss = runner.step(tokens[rows].to(rank.device), labels[rows].to(rank.device))
        sync_tied(parts, config, group)
        loss = dp_mean(loss, rank)
        if verify is not None and step == 0:
            dump(verify, parts, loss, rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        line = {"step": step, "rank": dist.get_rank(), "stages": sorted(parts), "pp": rank.pp, "dp": rank.dp,
                "tp": rank.tp, "time_s": seconds, "loss": loss}
        print(json.dumps(line), flush=True)


def dump(out: Path, parts: dict[int, StageModule], loss: float | None, rank: Rank) -> None:
    """Save this stage's full gradients and (last stage) the loss from the (dp 0, tp 0) rank."""
    grads = full_grads(parts)
    if rank.dp == 0 and rank.tp == 0:
        torch.save(grads, out / f"grads_pp{rank.pp}.pt")
        if loss is not None:
            (out / "loss.json").write_text(json.dumps({"loss": loss}))


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
    rank = setup(cfg, args.timeout_s)
    try:
        train(cfg, rank, steps=args.steps or cfg["steps"], verify=args.verify)
    except Exception as err:
        if args.verify is not None:
            report = {"rank": dist.get_rank(), "time": time.time(), "op": _CURRENT_OP[0],
                      "error": f"{type(err).__name__}: {err}",
                      "traceback": traceback.format_exc()[-4000:]}
            (args.verify / f"error_rank{dist.get_rank()}.json").write_text(json.dumps(report))
        raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
