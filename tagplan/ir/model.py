"""ModelGraph: ops grouped into blocks, and the ordered layer sequence that pipelines split.

Folding is built in: a `Block` is stored once per structural hash and each `Layer` names the
block it instantiates, so a 96-layer GPT holds one transformer block, not 96 copies.

All per-op quantities are per sample (one sequence of `seq_len` tokens) in the graph's dtype;
a batch of b samples costs b times as much. Parameter quantities are per model copy.
"""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property

from pydantic import Field, model_validator

from tagplan.ir.base import Record
from tagplan.ir.workload import DType


class OpKind(StrEnum):
    """What an op does, as far as cost and sharding care."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    LAYERNORM = "layernorm"
    SOFTMAX = "softmax"
    ELEMENTWISE = "elementwise"
    REDUCTION = "reduction"
    EMBEDDING = "embedding"
    CONV = "conv"
    ALL_TO_ALL = "all_to_all"
    VIEW = "view"
    OTHER = "other"


class PartitionDim(StrEnum):
    """A dimension an op may be partitioned along."""

    BATCH = "batch"
    SEQUENCE = "sequence"
    HEADS = "heads"
    HIDDEN_IN = "hidden_in"
    HIDDEN_OUT = "hidden_out"
    EXPERTS = "experts"


CHECKPOINT_SKIPPED: frozenset[str] = frozenset({"embedding", "head"})
"""Block kinds recomputation keeps whole (Megatron and the torch program checkpoint the transformer blocks)."""

HASH_EXCLUDED: frozenset[str] = frozenset({"score_elements", "shared_param_bytes", "eager_kernels",
                                           "eager_cast_kernels", "eager_extra_bytes", "eager_uniform_extra_bytes",
                                           "eager_bias_bytes", "causal"})
"""Op fields that block hashes leave out: derived from shapes the hash already covers, or describing how a
runtime issues the op rather than what it computes (so adding them kept every earlier hash, and the layer
profiles that name blocks by hash, valid). `causal` changes what a fused kernel computes once a calibration
fits its figures (`Calibration.causal_time_fraction`), so two traced layers alike but for their mask share a block
(the first one's flag); no model tagplan builds has such a pair."""


class Op(Record):
    """One operator of a block. Byte and FLOP figures are forward, per sample, in the graph's dtype; the eager
    runtime's extra bytes (`eager_extra_bytes`, `eager_bias_bytes`) give the backward's too, in the dtypes the
    eager program holds."""

    name: str = Field(min_length=1)
    kind: OpKind
    flops: float = Field(ge=0, description="forward FLOPs per sample")
    bytes_read: float = Field(ge=0, description="bytes read per sample, weights included")
    bytes_written: float = Field(ge=0, description="bytes written per sample")
    param_bytes: float = Field(default=0, ge=0, description="bytes of parameters this op owns")
    saved_bytes: float = Field(default=0, ge=0, description="activation bytes kept for backward")
    score_elements: float = Field(default=0, ge=0, description="attention only: score-matrix elements per sample "
                                  "(heads x queries x keys), which a kernel without fused attention writes to memory; "
                                  "derived from the shapes, so block hashes leave it out")
    shared_param_bytes: float = Field(
        default=0, ge=0, description="bytes of parameters this op uses but the model's first layer owns (a head "
        "tied to the token embedding); a pipeline stage that holds this op but not the first layer keeps a copy; "
        "block hashes leave it out")
    eager_kernels: tuple[int, int] | None = Field(
        default=None, description="(forward, backward) kernels eager PyTorch dispatches for this op per micro-batch "
        "under autocast mixed precision (the weight casts and gradient accumulation included): what the host "
        "issues when the runtime runs the model op by op (`Workload.eager`); None: one forward, two backward. "
        "Block hashes leave it out")
    eager_cast_kernels: tuple[int, int] = Field(
        default=(0, 0), description="(forward, backward) of `eager_kernels` that are autocast's casts (a weight's, a "
        "bias's, an fp32 input's; their gradients' backward): an eager runtime computing in the weights' own dtype "
        "(fp32, no autocast) dispatches the rest. Block hashes leave it out")
    eager_extra_bytes: tuple[float, float] = Field(
        default=(0.0, 0.0), description="(forward, backward) bytes per sample that eager PyTorch's unfused kernels "
        "move for this op beyond its own traffic (`bytes_read` and `bytes_written` forward, twice that backward), "
        "weights' casts apart (`cost.compute.eager_extra_s` derives those from `param_bytes`): autocast's casts of "
        "fp32 inputs and their gradients, the fp32 residual stream and norm outputs, unfused rotary, gradient sums "
        "of a tensor read twice, bias gradients, layout copies. Negative where the op's own backward (twice its "
        "forward) overstates eager's. In the graph's dtype's runtime: autocast for a 16-bit graph, plain fp32 for an "
        "fp32 one. Costed only under an eager runtime (`Workload.eager`). Block hashes leave it out")
    eager_uniform_extra_bytes: tuple[float, float] | None = Field(
        default=None, description="`eager_extra_bytes` for an eager runtime that holds every tensor in the "
        "graph's dtype (`Workload.eager_16bit_weights`: FSDP's MixedPrecision, DeepSpeed's bf16 and fp16 engines; "
        "no autocast, or norms run in 16 bits): no casts and no fp32 residual stream, the gradient sums, pointwise "
        "backward reads, unfused rotary and layout copies in the graph's dtype. Equal to `eager_extra_bytes` for an "
        "fp32 graph. None where not given (a graph written before the field, an op given by hand): "
        "`eager_extra_bytes` is costed, an upper bound. Block hashes leave it out")
    eager_bias_bytes: float = Field(
        default=0.0, ge=0, description="projections with a bias: the backward bytes per sample eager PyTorch moves "
        "summing the bias gradient over the output gradient, apart from `eager_extra_bytes` because it is about the "
        "output (whole under row parallelism, split under column), where those are about the input. Costed only "
        "under an eager runtime. Block hashes leave it out")
    causal: bool = Field(
        default=False, description="attention only: each query attends to the keys before it (a decoder's self-"
        "attention). `flops` still count every query against every key, as FlopCounterMode does; a fused kernel "
        "skips the masked tiles (`compute.attention_fraction`), a materialised one computes them and masks them. "
        "Block hashes leave it out")
    output_shape: tuple[int, ...] = ()
    partition_dims: tuple[PartitionDim, ...] = ()
    inputs: tuple[str, ...] = Field(default=(), description="names of producer ops in the block")

    @model_validator(mode="after")
    def _casts_among_kernels(self) -> Op:
        kernels = self.eager_kernels or (0, 0)
        casts = self.eager_cast_kernels
        if min(casts) < 0 or casts[0] > kernels[0] or casts[1] > kernels[1]:
            raise ValueError(f"op {self.name}: eager_cast_kernels = {casts} must be non-negative and among its "
                             f"eager_kernels = {self.eager_kernels} (forward, backward)")
        return self


class Block(Record):
    """A unique block (folding unit). `hash` is structural: equal blocks hash equal."""

    hash: str = Field(min_length=1)
    kind: str = Field(default="block", description="embedding, block, head, ... (free text)")
    ops: tuple[Op, ...]
    params: int = Field(ge=0, description="parameter count")
    output_bytes: float = Field(ge=0, description="activation bytes per sample sent to the next layer")

    @model_validator(mode="after")
    def _unique_op_names(self) -> Block:
        names = [op.name for op in self.ops]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"block {self.hash}: duplicate op names {dup[:5]}")
        return self

    @cached_property
    def flops(self) -> float:
        """Forward FLOPs per sample."""
        return sum(op.flops for op in self.ops)

    @cached_property
    def param_bytes(self) -> float:
        """Parameter bytes in the graph's dtype."""
        return sum(op.param_bytes for op in self.ops)

    @cached_property
    def saved_bytes(self) -> float:
        """Activation bytes per sample saved for the backward pass."""
        return sum(op.saved_bytes for op in self.ops)

    @cached_property
    def largest_output_bytes(self) -> float:
        """Bytes per sample of the block's largest op output."""
        return max((op.bytes_written for op in self.ops), default=0.0)


class Layer(Record):
    """One entry of the layer sequence: a named instance of a block."""

    name: str = Field(min_length=1)
    block: str = Field(min_length=1, description="hash of the Block this layer instantiates")
    inputs: tuple[int, ...] | None = Field(
        default=None, description="indices of earlier layers read; None means the previous one"
    )


class ModelGraph(Record):
    """A model as an ordered sequence of layers over unique blocks, traced at `seq_len`."""

    name: str = Field(min_length=1)
    family: str = Field(default="custom")
    seq_len: int = Field(gt=0, description="tokens per sample the figures were computed for")
    dtype: DType = DType.BF16
    blocks: tuple[Block, ...] = Field(min_length=1)
    layers: tuple[Layer, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> ModelGraph:
        hashes = [b.hash for b in self.blocks]
        if len(set(hashes)) != len(hashes):
            raise ValueError(f"model {self.name!r}: blocks repeat a hash")
        known = set(hashes)
        for i, layer in enumerate(self.layers):
            if layer.block not in known:
                raise ValueError(
                    f"layers[{i}] ({layer.name!r}): block {layer.block!r} is not one of "
                    f"the model's blocks {sorted(known)[:8]}"
                )
            for src in layer.inputs or ():
                if not 0 <= src < i:
                    raise ValueError(f"layers[{i}].inputs: {src} must index an earlier layer (0..{i - 1})")
        return self

    @cached_property
    def block_by_hash(self) -> dict[str, Block]:
        """Blocks keyed by structural hash."""
        return {b.hash: b for b in self.blocks}

    def block_of(self, layer_index: int) -> Block:
        """The block instantiated by layer `layer_index`."""
        return self.block_by_hash[self.layers[layer_index].block]

    def layer_inputs(self, layer_index: int) -> tuple[int, ...]:
        """Indices of the layers whose outputs layer `layer_index` reads."""
        explicit = self.layers[layer_index].inputs
        if explicit is not None:
            return explicit
        return () if layer_index == 0 else (layer_index - 1,)

    def checkpointable(self, start: int, end: int) -> tuple[int, ...]:
        """Indices of the layers in `[start, end)` that recomputation checkpoints, in order: every layer whose
        block is not an embedding or a head (`CHECKPOINT_SKIPPED`)."""
        return tuple(i for i in range(start, end) if self.block_of(i).kind not in CHECKPOINT_SKIPPED)

    @cached_property
    def params(self) -> int:
        """Total parameter count."""
        return sum(self.block_of(i).params for i in range(len(self.layers)))

    @cached_property
    def flops_per_sample(self) -> float:
        """Forward FLOPs per sample (a training step is about 3x this)."""
        return sum(self.block_of(i).flops for i in range(len(self.layers)))

    @cached_property
    def unique_blocks(self) -> int:
        """Number of distinct blocks after folding."""
        return len({layer.block for layer in self.layers})
