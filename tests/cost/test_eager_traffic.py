"""`compute.block_time` under an eager runtime: each op's eager traffic (`eager_extra_s`) on top of its time."""

import pytest

from tagplan.cost.calibration import DEFAULT_CALIBRATION
from tagplan.cost.compute import block_time, eager_extra_s, eager_split, eager_traffic_bytes
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.families import TransformerShape, gpt_block, llama_block, token_embedding
from tagplan.ir.model import OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType


def test_only_an_eager_runtime_pays_for_the_traffic() -> None:
    """A fused runtime's block time is its ops'; an eager one's adds each op's eager seconds (the block is
    compute-bound here, so the host's issue floor does not set it)."""
    shape = TransformerShape(layers=1, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    block = llama_block(shape, 4096, 2)
    spec = lookup_device("H200-SXM")
    strategies = {op.name: ShardStrategy.REPLICATE for op in block.ops}
    common = {"samples": 4.0, "tp": 1, "spec": spec, "dtype": DType.BF16, "calibration": DEFAULT_CALIBRATION}
    fused = block_time(block, strategies, eager=False, autocast=False, **common)
    eager = block_time(block, strategies, eager=True, autocast=True, **common)
    assert not eager.host_bound
    extra = [eager_extra_s(op, samples=4.0, tp=1, strategy=ShardStrategy.REPLICATE, spec=spec,
                           calibration=DEFAULT_CALIBRATION, autocast=True) for op in block.ops]
    assert eager.forward_s == pytest.approx(fused.forward_s + sum(e.forward_s for e in extra))
    assert eager.backward_s == pytest.approx(fused.backward_s + sum(e.backward_s for e in extra))
    assert eager.forward_s > 1.05 * fused.forward_s  # an 8B block at 16k tokens: casts and fp32 residuals weigh


def test_a_bias_gradient_divides_as_the_output_and_an_input_cast_as_the_input() -> None:
    """Column parallel: the whole input cast on every device, a split bias gradient; row parallel: a split
    input, the whole bias gradient."""
    qkv = next(op for op in gpt_block(TransformerShape(layers=1, hidden=256, heads=4), 128, 2).ops
               if op.kind is OpKind.MATMUL and op.eager_bias_bytes)
    assert qkv.eager_extra_bytes[0] > 0  # it reads the norm's fp32 output
    qkv = qkv.model_copy(update={"param_bytes": 0.0})  # the weights' casts apart
    whole = eager_traffic_bytes(qkv, samples=1.0, tp=1, strategy=ShardStrategy.REPLICATE, autocast=True)
    column = eager_traffic_bytes(qkv, samples=1.0, tp=4, strategy=ShardStrategy.COLUMN, autocast=True)
    row = eager_traffic_bytes(qkv, samples=1.0, tp=4, strategy=ShardStrategy.ROW, autocast=True)
    assert column[0] == whole[0] and row[0] == pytest.approx(whole[0] / 4)
    assert column[1] == pytest.approx(qkv.eager_extra_bytes[1] + qkv.eager_bias_bytes / 4)
    assert row[1] == pytest.approx(qkv.eager_extra_bytes[1] / 4 + qkv.eager_bias_bytes)


def test_sixteen_bit_weights_move_the_uniform_bytes_and_cast_nothing() -> None:
    """An eager runtime over 16-bit weights (`Workload.eager_16bit_weights`, `autocast` False): no weight casts and
    no fp32 residual stream, so a projection reading a norm's output moves no cast, and the block's traffic is
    below autocast's; the gradient sums and bias gradients stay."""
    block = gpt_block(TransformerShape(layers=1, hidden=256, heads=4), 128, 2)
    qkv = next(op for op in block.ops if op.kind is OpKind.MATMUL and op.eager_bias_bytes)
    common = {"samples": 1.0, "tp": 1, "strategy": ShardStrategy.REPLICATE}
    assert eager_traffic_bytes(qkv, autocast=False, sixteen_bit_weights=True, **common) == (0.0, qkv.eager_bias_bytes)
    autocast = [eager_traffic_bytes(op, autocast=True, **common) for op in block.ops]
    uniform = [eager_traffic_bytes(op, autocast=False, sixteen_bit_weights=True, **common) for op in block.ops]
    assert sum(b for _, b in uniform) > 0  # the residual stream's gradient sums, the bias gradients
    assert sum(f for f, _ in uniform) < sum(f for f, _ in autocast) / 3
    assert sum(b for _, b in uniform) < sum(b for _, b in autocast) / 2


def test_an_op_without_the_uniform_figure_is_costed_at_its_own() -> None:
    """A graph written before `Op.eager_uniform_extra_bytes` existed (or an op given by hand) has none: over 16-bit
    weights its `eager_extra_bytes` are costed (exact for an fp32 graph, an upper bound for a 16-bit one), not
    nothing."""
    op = next(op for op in gpt_block(TransformerShape(layers=1, hidden=256, heads=4), 128, 4).ops
              if op.eager_extra_bytes[1] > 0)
    old = op.model_copy(update={"eager_uniform_extra_bytes": None})
    common = {"samples": 1.0, "tp": 1, "strategy": ShardStrategy.REPLICATE, "autocast": False}
    assert eager_traffic_bytes(old, sixteen_bit_weights=True, **common) == eager_traffic_bytes(old, **common)
    assert eager_traffic_bytes(old, sixteen_bit_weights=True, **common)[1] > 0


def test_a_vocabulary_parallel_lookup_moves_its_whole_output_on_every_device() -> None:
    """A lookup's eager bytes are about its output: a vocabulary-parallel table (ROW) writes a whole partial sum on
    every device, a hidden-split one (COLUMN) its share; replicated, whole."""
    lookup = next(op for op in token_embedding(TransformerShape(layers=1, hidden=256, heads=4, vocab=1000), 128, 2).ops
                  if op.kind is OpKind.EMBEDDING)
    assert lookup.eager_extra_bytes[0] > 0  # fp32 rows read and written under autocast
    assert eager_split(lookup, ShardStrategy.ROW, 4) == 1
    assert eager_split(lookup, ShardStrategy.COLUMN, 4) == 4
    assert eager_split(lookup, ShardStrategy.REPLICATE, 4) == 1
    whole = eager_traffic_bytes(lookup, samples=1.0, tp=1, strategy=ShardStrategy.REPLICATE, autocast=False)
    row = eager_traffic_bytes(lookup, samples=1.0, tp=4, strategy=ShardStrategy.ROW, autocast=False)
    assert row == whole
