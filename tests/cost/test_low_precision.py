"""The quantized recipes beyond delayed-scaling fp8: fp8 current scaling, mxfp8, nvfp4 (Transformer Engine),
and the Blackwell Ultra parts that run them."""

from __future__ import annotations

import pytest

from tagplan.cost.calibration import Calibration
from tagplan.cost.compute import op_time
from tagplan.cost.simulator import Simulator
from tagplan.frontends.catalog import CATALOG
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import Op, OpKind
from tagplan.ir.plan import Plan, ShardStrategy, Stage
from tagplan.ir.workload import DType, Workload

IDEAL = Calibration(name="ideal", launch_overhead_s=0.0)
FLOPS = 2 * 8192**3


def _gemm_s(dtype: DType, device: str, *, calibration: Calibration = IDEAL, bytes_in: float = 0.0,
            bytes_out: float = 0.0) -> tuple[float, float]:
    gemm = Op(name="mm", kind=OpKind.MATMUL, flops=FLOPS, bytes_read=bytes_in, bytes_written=bytes_out)
    t = op_time(gemm, samples=1, tp=1, strategy=ShardStrategy.REPLICATE, spec=CATALOG[device], dtype=dtype,
                calibration=calibration)
    return t.forward_s, t.backward_s


def test_each_recipe_has_its_operand_bytes_and_weight_copies() -> None:
    assert [d.value for d in DType if d.quantized] == ["fp8", "fp8-cs", "mxfp8", "nvfp4"]
    assert not DType.BF16.quantized and DType.NVFP4.elementwise is DType.BF16
    assert DType.MXFP8.gemm_nbytes == pytest.approx(1 + 1 / 32)  # E4M3 and an E8M0 scale per 32
    assert DType.NVFP4.gemm_nbytes == pytest.approx(0.5 + 1 / 16)  # E2M1 and an E4M3 scale per 16
    assert Workload(dtype=DType.FP8_CS).weight_bytes_per_param == 3  # as delayed scaling: one fp8 copy
    # block scaling keeps a rowwise and a columnwise copy of each weight
    assert Workload(dtype=DType.MXFP8).weight_bytes_per_param == pytest.approx(2 + 2 * (1 + 1 / 32))
    assert Workload(dtype=DType.NVFP4).weight_bytes_per_param == pytest.approx(2 + 2 * (0.5 + 1 / 16))
    assert (DType.FP8.amax_passes, DType.FP8_CS.amax_passes, DType.MXFP8.amax_passes, DType.NVFP4.amax_passes) == \
        (0, 1, 0, 1)


def test_peak_rates_fall_back_to_the_next_wider_format_a_device_has() -> None:
    gb300, gb200, h100, a100 = (CATALOG[n] for n in ("GB300", "GB200", "H100-SXM", "A100-SXM-80GB"))
    assert gb300.peak_flops(DType.NVFP4) == 15000e12 and gb200.peak_flops(DType.NVFP4) == 10000e12
    assert gb300.peak_flops(DType.MXFP8) == gb300.peak_flops(DType.FP8) == 5000e12
    assert h100.peak_flops_fp4 is None and h100.peak_flops(DType.NVFP4) == 1979e12  # fp8 tensor cores
    assert a100.peak_flops(DType.NVFP4) == a100.peak_flops(DType.FP8_CS) == 312e12  # bf16
    assert CATALOG["B300"].mem_bytes > CATALOG["B200"].mem_bytes  # 288 GB of HBM3e


def test_block_scaled_gemms_run_at_their_fitted_fraction_only_on_blackwell() -> None:
    fp8, _ = _gemm_s(DType.FP8, "GB200")
    nvfp4, _ = _gemm_s(DType.NVFP4, "GB200")
    mxfp8, _ = _gemm_s(DType.MXFP8, "GB200")
    fraction = IDEAL.block_scaled_gemm_fraction
    assert 0 < fraction[DType.NVFP4] < 1 and 0 < fraction[DType.MXFP8] <= 1
    # the same GEMM curve at twice the fp8 rate, times the fraction nvfp4's kernels reach
    assert fp8 / nvfp4 == pytest.approx(2 * fraction[DType.NVFP4], rel=0.02)
    assert fp8 / mxfp8 == pytest.approx(fraction[DType.MXFP8], rel=1e-9)
    # an H100 runs mxfp8 as the fp8 it has: no block-scaled kernels, no fraction
    assert _gemm_s(DType.MXFP8, "H100-SXM") == _gemm_s(DType.FP8, "H100-SXM")
    unfitted = IDEAL.model_copy(update={"block_scaled_gemm_fraction": {}})
    assert _gemm_s(DType.MXFP8, "GB200", calibration=unfitted)[0] == pytest.approx(fp8)


def test_current_scaling_reads_each_gemm_operand_once_more_for_its_amax() -> None:
    """fp8-cs costs delayed scaling's time plus one memory-bound read of the input forward and of the output
    gradient backward, at the reduction kernels' bandwidth."""
    bytes_in, bytes_out = 3e9, 5e9
    h100 = CATALOG["H100-SXM"]
    delayed = _gemm_s(DType.FP8, "H100-SXM", bytes_in=bytes_in, bytes_out=bytes_out)
    current = _gemm_s(DType.FP8_CS, "H100-SXM", bytes_in=bytes_in, bytes_out=bytes_out)
    bandwidth = h100.mem_bandwidth_Bps * IDEAL.bandwidth_fraction("H100-SXM", OpKind.REDUCTION)
    assert current[0] - delayed[0] == pytest.approx(bytes_in / bandwidth)
    assert current[1] - delayed[1] == pytest.approx(bytes_out / bandwidth)


def test_block_scaled_activations_keep_their_cast_copy_with_its_scales() -> None:
    """What a block's GEMMs save is kept at the cast copy's bytes (with the block scales), the rest in bf16."""
    cluster = load_cluster("gb200-nvl72")
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 26), devices=tuple(range(8)), dp=2, tp=4),))
    spec = "llama?layers=24&hidden=2048&heads=16&kv_heads=8&vocab=32000"
    acts = {}
    for dtype in (DType.BF16, DType.MXFP8, DType.NVFP4):
        model = load_model(spec, seq_len=2048, dtype=dtype)
        report = Simulator(model, cluster, Workload(global_batch=8, seq_len=2048, dtype=dtype)).simulate(plan)
        acts[dtype] = report.stages[0].memory.activations_bytes
    blocks = [model.block_by_hash[layer.block] for layer in model.layers]
    gemm = sum(op.saved_bytes for b in blocks for op in b.ops if op.kind is OpKind.MATMUL)
    total = sum(b.saved_bytes for b in blocks)
    for dtype in (DType.MXFP8, DType.NVFP4):
        kept = total - gemm + gemm * dtype.gemm_nbytes / 2
        assert acts[dtype] / acts[DType.BF16] == pytest.approx(kept / total, rel=1e-6)


def test_nvfp4_makes_a_blackwell_plan_faster_and_a_hopper_plan_no_faster() -> None:
    spec = "llama?layers=8&hidden=4096&heads=32&kv_heads=8&vocab=32000"
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 10), devices=tuple(range(8)), dp=8),))
    def seconds(cluster: str, dtype: DType) -> float:
        model = load_model(spec, seq_len=4096, dtype=dtype)
        workload = Workload(global_batch=32, seq_len=4096, dtype=dtype)
        return Simulator(model, load_cluster(cluster), workload).simulate(plan).iteration_time_s
    assert seconds("gb300-nvl72", DType.NVFP4) < 0.9 * seconds("gb300-nvl72", DType.FP8)
    # on an H100 nvfp4 runs fp8 GEMMs and pays its amax reads: never faster than delayed-scaling fp8
    assert seconds("dgx-h100", DType.NVFP4) >= seconds("dgx-h100", DType.FP8)


def test_blackwell_ultra_presets() -> None:
    gb300 = load_cluster("gb300-nvl72")
    assert gb300.nodes[0].device.name == "GB300" and gb300.nodes[0].gpus == 72
    assert gb300.nodes[0].nic_bandwidth_Bps == pytest.approx(800e9 / 8)  # ConnectX-8
    b300 = load_cluster("dgx-b300:nodes=2")
    assert [n.device.name for n in b300.nodes] == ["B300", "B300"] and b300.nodes[0].gpus == 8
    # the fitted sustained clock: a 1400 W GB300 above a 1200 W GB200
    assert CATALOG["GB300"].sustained_peak_fraction > CATALOG["GB200"].sustained_peak_fraction


def test_zero_gathers_and_the_optimizer_move_weights_as_stored_not_their_cast_copies() -> None:
    """Megatron gathers the bf16 parameters and casts them afterwards (tagplan's exports write no
    --fp8-param-gather), so a quantized recipe's sync costs what bf16's does; only memory holds the copies."""
    spec = "llama?layers=4&hidden=2048&heads=16&kv_heads=8&vocab=32000"
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=tuple(range(8)), dp=8, zero=1),))
    reports = {}
    for dtype in (DType.BF16, DType.MXFP8):
        model = load_model(spec, seq_len=2048, dtype=dtype)
        reports[dtype] = Simulator(model, load_cluster("dgx-b300"),
                                   Workload(global_batch=16, seq_len=2048, dtype=dtype)).simulate(plan)
    bf16, mxfp8 = (reports[d].stages[0] for d in (DType.BF16, DType.MXFP8))
    assert mxfp8.dp_sync_s == pytest.approx(bf16.dp_sync_s, rel=1e-12)
    assert mxfp8.memory.weights_bytes > 1.9 * bf16.memory.weights_bytes  # bf16 + two ~1-byte copies
    assert Workload(dtype=DType.NVFP4).stored_weight_bytes_per_param == 2
