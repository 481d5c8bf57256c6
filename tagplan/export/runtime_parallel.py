"""How one rank of the exported program builds and parallelizes its pipeline stages.

Imported by the program (`tagplan.export.runtime_train`, copied into the run as `train.py`).
Per rank, `build_parts` builds the stage's layers (the same numbers a single process would
build), then applies, in this order:
1. tensor parallelism (`parallelize_module` on the "tp" mesh axis): column -> ColwiseParallel,
   row -> RowwiseParallel, replicate -> left whole, sequence -> left whole on this rank's part of
   the tokens (its weight gradients summed over the tp group once per step, `sum_token_split`); in
   a gpt, llama or moe block each matmul converts its input and output as `export.tp_flow` lays out
   (a moe block's experts: `ExpertsParallel`); a column head keeps its part of the vocabulary, a
   token-split or row head its part of the tokens, and the loss is computed on those parts
   (`LossSplit`); a replicated head computes whole logits; with sequence parallelism the residual
   stream between layers is split along the sequence;
2. recomputation: each block of a `recompute` stage checkpoints its forward;
3. data parallelism on the "dp" axis: ZeRO 0 -> `replicate` (DDP on FSDP2's machinery), ZeRO 1/2
   -> `fully_shard(reshard_after_forward=False)`, ZeRO 3 -> `fully_shard(reshard_after_forward=True)`.
A tied head keeps its own copy of the embedding table; `sync_tied` sums the two copies'
gradients after each backward (Megatron's embedding group), so they stay equal, whether or not
the two copies are split alike.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from tagplan.cost.sharding import Layout
from tagplan.export.modules import Block, build_layer, op_paths, set_stage_recompute, tied_param_names
from tagplan.export.runtime_loss import eager_loss, token_losses
from tagplan.export.shapes import ModelConfig
from tagplan.export.tp_flow import EXPERT_OPS, NEEDS, ExpertsFlow, Flow, block_flow, experts_flow, head_flow
from tagplan.ir.workload import LossKernel

SEQUENCE = Shard(1)  # activations (batch, seq, hidden) split along the sequence
PLACEMENT = {Layout.R: Replicate(), Layout.S: SEQUENCE, Layout.H: Shard(2)}  # tp_flow's layouts on a tp mesh
STREAM_WRITERS = ("attn.o", "mlp.fc2", "mlp.down")  # matmuls whose output joins the residual stream
CURRENT_OP = ["(before the first layer)"]  # verify mode: the last tensor-parallel op entered


class StageModule(nn.Module):
    """Layers `[start, end)` of the layer list, named by their index in the whole model.

    With `compute_dtype` set (bf16/fp16, as the plan was costed) the layers run under autocast over
    the fp32 weights (the master copy the optimizer updates) and the stage hands back fp32, so
    stages exchange one dtype whatever their compute; the last stage under a fused loss
    (`hands_back_logits`) hands its logits back as the head wrote them, for the loss to keep.
    """

    compute_dtype: torch.dtype | None = None
    hands_back_logits: bool = False

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})
        self.token_split: list[nn.Module] = []  # matmuls run on this rank's tokens with whole weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.compute_dtype or torch.bfloat16,
                            enabled=self.compute_dtype is not None):
            for layer in self.layers.values():
                x = layer(x)
        return x.float() if self.compute_dtype is not None and not self.hands_back_logits else x


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


def matmul_style(strategy: str, flow: Flow) -> ParallelStyle | None:
    """The style of a gpt, llama or moe Linear under `strategy` whose input arrives and output departs
    as `flow` says (`export.tp_flow`); None when it runs whole on what arrives and hands that on."""
    arrives, departs = PLACEMENT[flow.arrives], PLACEMENT[flow.departs]
    if strategy == "column":
        return ColwiseParallel(input_layouts=arrives, output_layouts=departs)
    if strategy == "row":
        return RowwiseParallel(input_layouts=arrives, output_layouts=departs)
    own = PLACEMENT[NEEDS[strategy]]  # replicate: whole tensors; sequence: this rank's tokens
    if arrives == own and departs == own:
        return None
    return PrepareModuleInputOutput(input_layouts=(arrives,), desired_input_layouts=(own,), use_local_input=True,
                                    output_layouts=(own,), desired_output_layouts=(departs,), use_local_output=True)


class ExpertsParallel(ParallelStyle):
    """A moe block's experts (`modules.Experts`) on the "tp" axis as `flow` says (`export.tp_flow.experts_flow`).

    Split: each expert's gate and up weights are split along the FFN (their rows), its down weights
    along the FFN (their columns); the tokens and logits are made whole, their gradients (partial sums
    over the FFN pieces) reduced back, and the output, a partial sum, is reduced into the stream's layout.
    Whole: the weights stay whole; tokens and logits are converted to the layout the experts run on, and
    the output to the stream's.
    """

    def __init__(self, flow: ExpertsFlow) -> None:
        super().__init__()
        self.flow = flow

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.flow.split:
            for name, dim in (("gate", 1), ("up", 1), ("down", 2)):
                whole = getattr(module, name)
                module.register_parameter(name, nn.Parameter(distribute_tensor(
                    whole.data, device_mesh, [Shard(dim)], src_data_rank=None)))
        module.register_forward_pre_hook(lambda _, args: self._inputs(args, device_mesh))
        module.register_forward_hook(lambda _, __, out: self._output(out, device_mesh))
        return module

    def _inputs(self, args: tuple[torch.Tensor, ...], mesh: DeviceMesh) -> tuple[torch.Tensor, ...]:
        tokens, logits = args
        return (self._convert(tokens, PLACEMENT[self.flow.tokens], mesh),
                self._convert(logits, PLACEMENT[self.flow.logits], mesh))

    def _convert(self, tensor: torch.Tensor, arrives: Placement, mesh: DeviceMesh) -> torch.Tensor:
        runs = PLACEMENT[self.flow.runs]
        moved = DTensor.from_local(tensor, mesh, [arrives], run_check=False).redistribute(mesh, [runs])
        return moved.to_local(grad_placements=[Partial()] if self.flow.split else None)

    def _output(self, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        held = Partial() if self.flow.split else PLACEMENT[self.flow.runs]
        return DTensor.from_local(out, mesh, [held], run_check=False).redistribute(
            mesh, [PLACEMENT[self.flow.departs]]).to_local()


def layer_styles(layer: nn.Module, index: int, config: ModelConfig, strategies: dict[str, str], *,
                 sp: bool) -> dict[str, ParallelStyle]:
    """Module path -> ParallelStyle for one layer. With sequence parallelism (`sp`) the residual
    stream between layers is split along the sequence: norms run on their part (SequenceParallel),
    attention and MLP gather it first (unless their first matmuls read their part of the sequence),
    and the embedding hands back this rank's part. A block's and an own family's head's matmuls convert
    what arrives and what departs as `export.tp_flow` lays out."""
    styles: dict[str, ParallelStyle | None] = {}
    block = block_flow(config.family, strategies, sp=sp) if isinstance(layer, Block) else None
    for op, path in op_paths(config, index, strategies).items():
        strategy = strategies.get(op, "replicate")
        if isinstance(layer.get_submodule(path), nn.Embedding):
            styles[path] = embedding_style(strategy)
        elif op in EXPERT_OPS:
            styles[path] = _experts_style(experts_flow(strategies, sp=sp))
        elif block is not None:
            styles[path] = matmul_style(strategy, block.flows[op])
        elif path == "lm_head" and config.family in ("gpt", "llama", "moe"):
            styles[path] = matmul_style(strategy, head_flow(strategy, sp=sp))
        elif path == "lm_head":
            styles[path] = head_style(strategy, sp=sp)
        else:
            styles[path] = linear_style(strategy, writes_stream=op in STREAM_WRITERS, sp=sp)
    if sp and isinstance(layer, Block):
        styles.update({name: SequenceParallel(use_local_output=True) for name in layer.norm_names})
        styles.update({module: _gather() for module, gathers in (block.gathers if block else {}).items() if gathers})
    if sp and index == config.num_layers - 1:
        styles["final_norm"] = SequenceParallel(use_local_output=True)
    return {path: style for path, style in styles.items() if style is not None}


def _experts_style(flow: ExpertsFlow) -> ParallelStyle | None:
    """None where whole experts run on the tokens as they arrive and hand them on as they are."""
    still = not flow.split and flow.tokens == flow.logits == flow.runs == flow.departs
    return None if still else ExpertsParallel(flow)


@dataclass(frozen=True)
class LossSplit:
    """How the last stage's logits lie on its tp ranks when the loss reads them (`tp_flow.loss_split`):
    "vocab" (a column head's part of the vocabulary: `loss_parallel`, whose backward must run inside it
    too), "tokens" (a token-split or row head's part of the tokens: each rank's share of the loss, summed
    over the ranks) or None (whole logits, `mesh` None). `kernel`: the cross-entropy the program runs
    (`export.runtime_loss`): eager, or fused (its own collectives over a vocabulary split, no DTensor)."""

    kind: str | None = None
    mesh: DeviceMesh | None = None
    kernel: LossKernel = LossKernel.EAGER
    vocab: int = 0
    """The whole vocabulary (0: each rank's part times the ranks). A column head's rows lie on the ranks as
    `torch.chunk` deals them: ceil(vocab / tp) each, the last rank fewer where tp does not divide it."""

    def vocab_start(self, local: int) -> int:
        """The first class of this rank's part of a vocabulary split (`local` classes here)."""
        assert self.mesh is not None
        per_rank = -(-self.vocab // self.mesh.size()) if self.vocab else local
        return self.mesh.get_local_rank() * per_rank

    def local_vocab(self) -> int:
        """The classes this rank's head rows cover: all of `vocab`, or under a vocabulary split its `torch.chunk` part
        (ceil(vocab / tp), the last rank what is left)."""
        if self.kind != "vocab" or self.mesh is None:
            return self.vocab
        return max(0, min(-(-self.vocab // self.mesh.size()), self.vocab - self.vocab_start(0)))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, *, reduction: str = "mean") -> torch.Tensor:
        """The cross-entropy of this rank's `logits` [b, s, V or V / tp] against `labels` (all of the rank's
        micro-batch's tokens; `labels` picks this rank's): the mean (or sum) over the tokens this rank holds."""
        target = self.labels(labels).flatten()
        if self.kernel is LossKernel.EAGER:
            return eager_loss(self.logits(logits), target, reduction=reduction)
        mesh = self.mesh if self.kind == "vocab" else None  # the ranks that split the vocabulary
        per_token = token_losses(logits, target, group=mesh.get_group() if mesh else None,
                                 vocab_start=self.vocab_start(logits.shape[-1]) if mesh else 0)
        return per_token.sum() if reduction == "sum" else per_token.mean()

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's local logits as the loss reads them (a vocabulary split: the DTensor `loss_parallel` takes)."""
        if self.kind == "vocab" and self.mesh is not None:
            if not self.vocab:
                return DTensor.from_local(logits, self.mesh, [Shard(logits.dim() - 1)], run_check=False)
            shape = torch.Size((*logits.shape[:-1], self.vocab))  # an uneven split: the whole, not local x ranks
            return DTensor.from_local(logits, self.mesh, [Shard(logits.dim() - 1)], run_check=False, shape=shape,
                                      stride=torch.empty(shape, device="meta").stride())
        return logits

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The labels of the tokens this rank's logits cover: (batch, seq), or its part of the sequence."""
        if self.kind == "tokens" and self.mesh is not None:
            return labels.chunk(self.mesh.size(), dim=1)[self.mesh.get_local_rank()]
        return labels

    def share(self, labels: torch.Tensor) -> float:
        """The weight of a mean over this rank's tokens in the mean over all of them (`labels`: all of them)."""
        return self.labels(labels).numel() / labels.numel()

    def context(self) -> contextlib.AbstractContextManager[None]:
        """`loss_parallel` for an eager vocabulary-parallel loss (forward and backward), else nothing."""
        return loss_parallel() if self.kind == "vocab" and self.kernel is LossKernel.EAGER else contextlib.nullcontext()

    def value(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss as a plain detached tensor: this rank's share where the tokens are split (`total` sums them)."""
        value = loss.detach()
        return value.full_tensor() if isinstance(value, DTensor) else value

    def total(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the tp ranks where each holds its tokens' share (a collective there), in place."""
        if self.kind == "tokens" and self.mesh is not None:
            dist.all_reduce(value, group=self.mesh.get_group())
        return value


def token_split_modules(layer: nn.Module, index: int, config: ModelConfig,
                        strategies: dict[str, str]) -> list[nn.Module]:
    """The layer's matmuls that run on this rank's tokens with whole weights (strategy `sequence`; a moe
    block's three expert weights are one module, listed once)."""
    paths = {path for op, path in op_paths(config, index, strategies).items() if strategies.get(op) == "sequence"}
    return [layer.get_submodule(path) for path in sorted(paths)
            if not isinstance(layer.get_submodule(path), nn.Embedding)]


def apply_tp(part: StageModule, config: ModelConfig, stage: dict[str, Any], mesh: DeviceMesh, *, sp: bool,
             track: bool) -> None:
    """Split each layer's matmuls and embeddings over the "tp" axis as the stage's strategies say."""
    for key, layer in part.layers.items():
        index, strategies = int(key), stage["strategies"].get(key, {})
        styles = layer_styles(layer, index, config, strategies, sp=sp)
        if track:
            for op, path in op_paths(config, index, strategies).items():
                label = f"layers.{index}.{path} ({strategies.get(op, 'replicate')})"
                layer.get_submodule(path).register_forward_pre_hook(
                    lambda *_, label=label: CURRENT_OP.__setitem__(0, label))
        if styles:
            parallelize_module(layer, mesh, styles)
        part.token_split += token_split_modules(layer, index, config, strategies)
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
        set_stage_recompute(part.layers.values(), bool(stage["recompute"]), stage.get("recompute_layers"))
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


def sum_token_split(part: StageModule, group: dist.ProcessGroup) -> None:
    """Sum the gradients of the stage's token-split matmuls over its tp group: each rank ran them on
    its part of the tokens with the whole weights (once per step, as `cost.sharding` costs them)."""
    with torch.no_grad():
        for module in part.token_split:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)


def sync_tied(parts: dict[int, StageModule], config: ModelConfig, group: dist.ProcessGroup | None, *,
              alike: bool = True) -> None:
    """Sum the gradients of the embedding table and the tied head's copy (both hold the sum).

    A gradient is first laid out like its parameter (an embedding's may come back replicated
    while its table is split). Copies split `alike` (`torch_program.tied_split_alike`) sum their
    local pieces element for element; others sum whole tables, each taking its own piece back.
    """
    names = tied_param_names(config)
    if names is None:
        return
    params = [p for part in parts.values() for name, p in part.named_parameters() if name in names]
    with torch.no_grad():
        for p in params:
            if isinstance(p.grad, DTensor) and isinstance(p, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if not alike:
            _sync_whole(params, group)
            return
        grads = [p.grad for p in params if p.grad is not None]
        if group is not None:
            for g in grads:
                dist.all_reduce(g.to_local() if isinstance(g, DTensor) else g, group=group)
        elif len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])


def _sync_whole(params: list[nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """The tied copies' sum through whole tables (gathered over each copy's mesh), for copies split unalike."""
    wholes = [(p, p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for p in params
              if p.grad is not None]
    if not wholes:
        return
    total = sum((w for _, w in wholes[1:]), wholes[0][1].clone())
    if group is not None:
        dist.all_reduce(total, group=group)
    for p, _ in wholes:
        p.grad = distribute_tensor(total, p.device_mesh, p.placements, src_data_rank=None) \
            if isinstance(p, DTensor) else total.clone()
