"""The analytic blocks' eager traffic (`Op.eager_extra_bytes`, `Op.eager_uniform_extra_bytes`, plus each op's own
bytes) against the bytes the kernels of tagplan's own eager torch modules read and write (`profiling.iterations`
GPT block, `profiling.layers.LlamaBlock`), counted with a dispatch mode on fake tensors: every non-view kernel's
input and output tensors, GEMMs and attention apart (their time is the op model's FLOPs), weight casts apart
(`compute.eager_extra_s` derives those from the weights). Three runtimes: bf16 autocast over fp32 weights, plain
fp32, and the module cast to bf16 (16-bit weights, no autocast: FSDP's MixedPrecision)."""

from collections import Counter
from types import MethodType

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode

from tagplan.cost.calibration import DEFAULT_CALIBRATION
from tagplan.cost.compute import WEIGHT_CAST_PASSES, eager_extra_s, eager_traffic_bytes
from tagplan.cost.sharding import divides
from tagplan.frontends.analytic import BlockBuilder
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.families import TransformerShape, gpt_block, llama_block
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Block
from tagplan.ir.model import Op, OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType
from tagplan.profiling.iterations import _Block
from tagplan.profiling.layers import LlamaBlock, _ShardedBlock

_GEMMS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"}
_NO_KERNEL = {"aten.detach", "aten.empty", "aten.empty_strided", "aten.lift_fresh", "aten._unsafe_view", "aten.t"}
SAMPLES, SEQ = 2, 256


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


class _Bytes(TorchDispatchMode):
    """Bytes each kernel reads and writes, by kind: GEMMs and attention not counted; casts of a weight apart."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__()
        self.weights = weights
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if func.is_view or name in _NO_KERNEL or not name.startswith("aten.") or name in _GEMMS \
                or "scaled_dot_product" in name:
            return out
        weight_cast = name == "aten._to_copy" and any(a is w for a in args for w in self.weights)
        moved = _nbytes(list(args)) + _nbytes(list((kwargs or {}).values())) + _nbytes(out)
        self.bytes["weight casts" if weight_cast else "traffic"] += moved
        if name == "aten.clone":  # also apart: the CPU's copy of attention's output into the projection's layout
            self.bytes["clone"] += moved
        return out


def _one_kernel_norm(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm as CUDA runs it, one kernel each way (the CPU decomposes it into a dozen); the same bytes."""
    return functional.layer_norm(x, norm.normalized_shape, norm.weight, None, norm.eps or 1e-5)


RUNTIMES = ["autocast", "fp32", "bf16-weights"]
"""How `_counted` runs a module: bf16 autocast over its fp32 weights, fp32, or cast to bf16 without autocast."""
NBYTES = {"autocast": 2, "fp32": 4, "bf16-weights": 2}
"""The graph's element size each runtime's blocks are built at."""


def _counted(make: type[nn.Module] | object, hidden: int, *, runtime: str) -> tuple[Counter[str], Counter[str]]:
    """(forward, backward) bytes of one block's eager kernels on `SAMPLES` x `SEQ` tokens run as `runtime` says
    (`RUNTIMES`). Backward, the weight gradients' casts back to fp32 (as many bytes as the forward's weight casts)
    are moved out of the traffic."""
    dtype, default = torch.bfloat16 if runtime == "bf16-weights" else torch.float32, torch.get_default_dtype()
    with FakeTensorMode():
        torch.set_default_dtype(dtype)  # the module built in it (`.to()` cannot swap fake parameters)
        try:
            block = make()  # type: ignore[operator]
        finally:
            torch.set_default_dtype(default)
        for norm in (m for m in block.modules() if isinstance(m, nn.RMSNorm)):
            norm.forward = MethodType(_one_kernel_norm, norm)
        weights = list(block.parameters())
        x = torch.randn(SAMPLES, SEQ, hidden, dtype=dtype, requires_grad=True)
        forward = _Bytes(weights)
        with forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=runtime == "autocast"):
            y = block(x)
        grad, backward = torch.randn_like(y), _Bytes(weights)
        with backward:
            y.backward(grad)
    backward.bytes["traffic"] -= forward.bytes["weight casts"]
    backward.bytes["weight casts"] = forward.bytes["weight casts"]
    return forward.bytes, backward.bytes


def _modelled(block: Block, *, uniform: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes the op model moves for `block`'s memory-bound ops under an eager runtime:
    each op's own traffic (backward twice the forward's) and its eager extra (`uniform`: the figure for a program
    in the graph's dtype, 16-bit weights), for `SAMPLES` samples."""
    forward = backward = 0.0
    for op in block.ops:
        own = 0.0 if op.kind in (OpKind.MATMUL, OpKind.ATTENTION) else (
            max(op.bytes_read - op.param_bytes, 0.0) + op.bytes_written)
        extra = op.eager_uniform_extra_bytes if uniform and op.eager_uniform_extra_bytes else op.eager_extra_bytes
        forward += SAMPLES * (own + extra[0])
        backward += SAMPLES * (2 * own + extra[1] + op.eager_bias_bytes)
    return forward, backward


SHAPES = [TransformerShape(layers=1, hidden=256, heads=4, kv_heads=2, ffn=704, vocab=100),
          TransformerShape(layers=1, hidden=512, heads=8, kv_heads=8, ffn=1536, vocab=100)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.hidden}")
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_gpt_block_moves_the_bytes_its_eager_module_moves(shape: TransformerShape, runtime: str) -> None:
    """Autocast's casts of the norms' fp32 outputs, the fp32 residual sums, the bias gradients, the fused QKV
    gradient's stack and copy, the residual stream's gradient sums: byte for byte."""
    gpt = TransformerShape(layers=1, hidden=shape.hidden, heads=shape.heads)
    forward, backward = _counted(lambda: _Block(shape.hidden, shape.heads), shape.hidden, runtime=runtime)
    block = gpt_block(gpt, SEQ, NBYTES[runtime])
    modelled = _modelled(block, uniform=runtime == "bf16-weights")
    assert modelled[0] == pytest.approx(forward["traffic"], rel=0.01)
    assert modelled[1] == pytest.approx(backward["traffic"], rel=0.01)
    own = _modelled(block.model_copy(update={"ops": tuple(op.model_copy(update={
        "eager_extra_bytes": (0.0, 0.0), "eager_uniform_extra_bytes": (0.0, 0.0), "eager_bias_bytes": 0.0})
        for op in block.ops)}))
    assert backward["traffic"] > 1.2 * own[1]  # what the op model alone charges falls well short


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.hidden}")
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_llama_block_moves_the_bytes_its_eager_module_moves(shape: TransformerShape, runtime: str) -> None:
    """Also the unfused rotary (strided products, stack, slices' scatters) and the gradient sums of the norm
    output the q, k, v (and gate, up) projections each read. Forward the CPU also copies attention's output into
    the projection's layout (CUDA's fused kernels write it so), which the model leaves out (counted apart here),
    and the rotary rebuilds its angle table per call (per micro-batch, not per sample: up to a tenth of a small
    block's forward traffic here, less than a percent at real sizes), which the model leaves out too."""
    forward, backward = _counted(lambda: LlamaBlock(shape, tp=1), shape.hidden, runtime=runtime)
    modelled = _modelled(llama_block(shape, SEQ, NBYTES[runtime]), uniform=runtime == "bf16-weights")
    assert (forward["traffic"] - forward["clone"]) * 0.9 < modelled[0] <= forward["traffic"] - forward["clone"]
    assert modelled[1] == pytest.approx(backward["traffic"], rel=0.01)


def _megatron_split(block: Block) -> dict[str, ShardStrategy]:
    """Megatron's split without sequence parallelism, as the sharded measuring modules hold it: projections
    reading the whole activation column-parallel, those reading the split one row-parallel, attention by heads,
    the pointwise ops between split, norms and residual sums whole."""
    split: set[str] = set()
    out: dict[str, ShardStrategy] = {}
    for op in block.ops:
        sharded = any(src in split for src in op.inputs)
        if op.kind is OpKind.MATMUL:
            out[op.name] = ShardStrategy.ROW if sharded else ShardStrategy.COLUMN
        elif op.kind is OpKind.ATTENTION:
            out[op.name] = ShardStrategy.HEADS
        else:
            out[op.name] = ShardStrategy.COLUMN if sharded else ShardStrategy.REPLICATE
        if out[op.name] in (ShardStrategy.COLUMN, ShardStrategy.HEADS):
            split.add(op.name)
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_one_device_of_a_tensor_parallel_pair_moves_its_shares_bytes(family: str, runtime: str) -> None:
    """One device's share of a tp=2 pair (`_ShardedBlock`, `LlamaBlock(shape, tp=2)`): the column-parallel
    projections read (and cast) their input whole and sum a split bias gradient, the row-parallel ones read a
    split input and sum the whole bias gradient, the attention and pointwise ops between are split, the norms
    and residual sums whole (`compute.eager_split`, `eager_traffic_bytes`); under autocast each device casts its
    share of the weights."""
    shape, tp = SHAPES[0], 2
    if family == "gpt":
        gpt = TransformerShape(layers=1, hidden=shape.hidden, heads=shape.heads)
        forward, backward = _counted(lambda: _ShardedBlock(shape.hidden, shape.heads, tp), shape.hidden,
                                     runtime=runtime)
        block = gpt_block(gpt, SEQ, NBYTES[runtime])
    else:
        forward, backward = _counted(lambda: LlamaBlock(shape, tp=tp), shape.hidden, runtime=runtime)
        block = llama_block(shape, SEQ, NBYTES[runtime])
    strategies = _megatron_split(block)
    modelled = [0.0, 0.0]
    for op in block.ops:
        share = tp if divides(strategies[op.name]) else 1
        own = 0.0 if op.kind in (OpKind.MATMUL, OpKind.ATTENTION) else (
            max(op.bytes_read - op.param_bytes, 0.0) + op.bytes_written) * SAMPLES / share
        extra = eager_traffic_bytes(op, samples=SAMPLES, tp=tp, strategy=strategies[op.name],
                                    autocast=runtime == "autocast", sixteen_bit_weights=runtime == "bf16-weights")
        modelled[0] += own + extra[0]
        modelled[1] += 2 * own + extra[1]
    counted = [forward["traffic"] - forward["clone"] + forward["weight casts"],
               backward["traffic"] + backward["weight casts"]]
    assert counted[0] * 0.9 < modelled[0] <= counted[0] * 1.001
    assert modelled[1] == pytest.approx(counted[1], rel=0.02)


def test_weight_casts_are_three_passes_over_the_16_bit_weights_each_way() -> None:
    """Autocast reads each fp32 weight and writes its 16-bit copy per micro-batch, and casts the gradient back:
    what `eager_extra_s` charges a GEMM from its weights, only under autocast."""
    shape = SHAPES[0]
    forward, _ = _counted(lambda: LlamaBlock(shape, tp=1), shape.hidden, runtime="autocast")
    block = llama_block(shape, SEQ, 2)
    weights = sum(op.param_bytes for op in block.ops if op.kind is OpKind.MATMUL)
    assert forward["weight casts"] == pytest.approx(WEIGHT_CAST_PASSES * weights, rel=0.01)
    spec = lookup_device("H100-SXM")
    gemm = next(op for op in block.ops if op.kind is OpKind.MATMUL)
    kwargs = {"samples": 0.0, "tp": 1, "strategy": ShardStrategy.REPLICATE, "spec": spec,
              "calibration": DEFAULT_CALIBRATION}
    cast = eager_extra_s(gemm, autocast=True, **kwargs)
    bandwidth_Bps = spec.mem_bandwidth_Bps * DEFAULT_CALIBRATION.bandwidth_fraction(spec.name, OpKind.ELEMENTWISE)
    assert cast.forward_s == pytest.approx(WEIGHT_CAST_PASSES * gemm.param_bytes / bandwidth_Bps)
    assert eager_extra_s(gemm, autocast=False, **kwargs).forward_s == 0.0


def test_a_norm_of_a_projections_output_is_cast_up_and_back_under_autocast() -> None:
    """A post-norm (BERT's transform) reading a 16-bit projection. CUDA's autocast runs layer_norm in fp32 (its
    fp32 op list): the input is cast up (2 + 4 bytes an element), normed (4 + 4), and backward the norm's
    gradient (4 + 4 + 4) is cast back (4 + 2). The CPU's autocast runs it in bf16, so a count on the CPU cannot
    show it; in fp32 (no casts anywhere) the count must match, and it does."""
    hidden, elems = 256, SAMPLES * SEQ * 256
    for nbytes, autocast in ((2, True), (4, False)):
        builder = BlockBuilder("head", SEQ, nbytes)
        builder.norm("norm", builder.linear("dense", "input", hidden, hidden, bias=True), hidden)
        ops = builder.build(hidden).ops
        norm = _modelled(Block(hash="n", ops=(ops[1],), params=0, output_bytes=0.0))
        if autocast:
            assert norm == (elems * (6 + 8), elems * (12 + 6))
        else:
            forward, backward = _counted(lambda: nn.Sequential(nn.Linear(hidden, hidden), nn.LayerNorm(hidden)),
                                         hidden, runtime="fp32")
            modelled = _modelled(builder.build(hidden))
            assert modelled[0] == pytest.approx(forward["traffic"], rel=0.01)
            assert modelled[1] == pytest.approx(backward["traffic"], rel=0.01)
            assert norm == (elems * 8, elems * 12)


@pytest.mark.parametrize("spec", ["bert-large", "t5-3b", "gpt3-1.3b", "llama3-8b", "mixtral-8x7b", "vit"])
def test_a_projection_issues_an_input_cast_exactly_where_it_moves_one(spec: str) -> None:
    """One rule for both costs of autocast's input cast: a projection reading an fp32 tensor (a norm's output,
    the residual stream, another block's output) issues the cast kernel (`Op.eager_cast_kernels`, the host's
    issue time) and moves its bytes (`Op.eager_extra_bytes`); one reading a 16-bit tensor does neither. (Expert
    banks' counts are per expert loop, `families._expert_loop_kernels`, and are recounted elsewhere.)"""
    model = load_model(spec, seq_len=128)
    checked = 0
    for i in range(len(model.layers)):
        for op in model.block_of(i).ops:
            if op.kind is not OpKind.MATMUL or op.eager_kernels in (None, (0, 0)) or op.name.startswith("experts."):
                continue
            input_casts = op.eager_cast_kernels[0] - 1 - int(op.eager_bias_bytes > 0)  # less the weight's and bias's
            assert input_casts in (0, 1)
            assert bool(input_casts) == (op.eager_extra_bytes[0] > 0), (spec, op.name)
            checked += 1
    assert checked


@pytest.mark.parametrize("spec", ["bert-large", "t5-3b", "gpt3-1.3b", "llama3-8b", "mixtral-8x7b", "vit"])
def test_one_dtype_throughout_moves_half_the_fp32_programs_bytes(spec: str) -> None:
    """`Op.eager_uniform_extra_bytes` is the program in the graph's dtype: for an fp32 graph the same as
    `Op.eager_extra_bytes`; for a bf16 one the same rules at 2 bytes an element, so exactly half the fp32 graph's
    figure, op by op (the expert dispatch's gradient sums and the lookups included), and never above autocast's."""
    fp32, bf16 = load_model(spec, seq_len=128, dtype=DType.FP32), load_model(spec, seq_len=128)

    def uniform(op: Op) -> tuple[float, float]:
        return op.eager_extra_bytes if op.eager_uniform_extra_bytes is None else op.eager_uniform_extra_bytes

    for i in range(len(fp32.layers)):
        for wide, narrow in zip(fp32.block_of(i).ops, bf16.block_of(i).ops, strict=True):
            assert uniform(wide) == wide.eager_extra_bytes, (spec, wide.name)
            assert uniform(narrow) == pytest.approx(tuple(b / 2 for b in wide.eager_extra_bytes)), (spec, narrow.name)
            assert all(u <= a for u, a in zip(uniform(narrow), narrow.eager_extra_bytes, strict=True)), (
                spec, narrow.name)
