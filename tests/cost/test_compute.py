import pytest

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration, EfficiencyCurve
from tagplan.cost.compute import block_time, issued_kernels, op_time
from tagplan.ir import Block, DeviceSpec, DType, Op, OpKind, ShardStrategy
from tagplan.ir.workload import Workload

SPEC = DeviceSpec(name="X", peak_flops_bf16=100e12, peak_flops_fp16=100e12, peak_flops_fp32=10e12,
                  mem_bytes=10**10, mem_bandwidth_Bps=1e12)
FLAT = Calibration(compute={"*": {OpKind.MATMUL: EfficiencyCurve(flops=(1.0,), efficiency=(0.5,)),
                                  OpKind.ATTENTION: EfficiencyCurve(flops=(1.0,), efficiency=(0.5,))}},
                   memory_efficiency={"*": 0.8}, launch_overhead_s=1e-6)


def test_compute_bound_matmul_uses_flops_and_backward_is_two_gemms() -> None:
    op = Op(name="mm", kind=OpKind.MATMUL, flops=1e9, bytes_read=1e3, bytes_written=1e3)
    t = op_time(op, samples=4, tp=2, strategy=ShardStrategy.COLUMN, spec=SPEC, dtype=DType.BF16, calibration=FLAT)
    body = 4 * 1e9 / 2 / (100e12 * 0.5)
    assert t.forward_s == pytest.approx(body + 1e-6)
    assert t.backward_s == pytest.approx(2 * body + 2e-6)


def test_memory_bound_op_uses_bandwidth() -> None:
    op = Op(name="ln", kind=OpKind.LAYERNORM, flops=10.0, bytes_read=4e6, bytes_written=4e6)
    t = op_time(op, samples=2, tp=1, strategy=ShardStrategy.SEQUENCE, spec=SPEC, dtype=DType.BF16, calibration=FLAT)
    assert t.forward_s == pytest.approx(2 * 8e6 / (1e12 * 0.8) + 1e-6)


def test_weights_are_read_once_per_micro_batch_not_per_sample() -> None:
    op = Op(name="mm", kind=OpKind.MATMUL, flops=1.0, bytes_read=1e6 + 8e8, bytes_written=1e6, param_bytes=8e8)
    one = op_time(op, samples=1, tp=1, strategy=ShardStrategy.COLUMN, spec=SPEC, dtype=DType.BF16, calibration=FLAT)
    many = op_time(op, samples=8, tp=1, strategy=ShardStrategy.COLUMN, spec=SPEC, dtype=DType.BF16,
                   calibration=FLAT)
    assert many.forward_s - 1e-6 == pytest.approx((8 * 2e6 + 8e8) / 0.8e12)
    assert many.forward_s < 8 * one.forward_s


def test_replicated_ops_are_not_divided_and_views_are_free() -> None:
    op = Op(name="mm", kind=OpKind.MATMUL, flops=1e9, bytes_read=0, bytes_written=0)
    rep = op_time(op, samples=1, tp=4, strategy=ShardStrategy.REPLICATE, spec=SPEC, dtype=DType.BF16,
                  calibration=FLAT)
    col = op_time(op, samples=1, tp=4, strategy=ShardStrategy.COLUMN, spec=SPEC, dtype=DType.BF16, calibration=FLAT)
    assert rep.forward_s - 1e-6 == pytest.approx(4 * (col.forward_s - 1e-6))
    view = Op(name="v", kind=OpKind.VIEW, flops=0, bytes_read=1e9, bytes_written=1e9)
    assert op_time(view, samples=1, tp=1, strategy=ShardStrategy.SEQUENCE, spec=SPEC, dtype=DType.BF16,
                   calibration=FLAT).forward_s == 0.0


def test_default_gemm_efficiency_grows_with_size_and_stays_below_peak() -> None:
    curve = DEFAULT_CALIBRATION.curve("A100-SXM-80GB", OpKind.MATMUL)
    assert curve is not None
    values = [curve.at(f) for f in (1e5, 1e7, 1e9, 1e11, 1e13)]
    assert values == sorted(values) and values[-1] < 1.0 and values[0] > 0
    assert DEFAULT_CALIBRATION.curve("A100-SXM-80GB", OpKind.LAYERNORM) is None  # memory-bound


def test_calibration_validation_and_round_trip() -> None:
    with pytest.raises(ValueError, match="increasing"):
        EfficiencyCurve(flops=(10.0, 1.0), efficiency=(0.5, 0.6))
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        EfficiencyCurve(flops=(1.0,), efficiency=(1.5,))
    assert Calibration.from_json(DEFAULT_CALIBRATION.to_json()) == DEFAULT_CALIBRATION
    curve = EfficiencyCurve(flops=(1e6, 1e8), efficiency=(0.2, 0.6))
    assert curve.at(1e7) == pytest.approx(0.4)  # linear in log10(FLOPs)


def test_attention_without_a_fused_kernel_pays_its_score_matrix_in_memory_passes() -> None:
    op = Op(name="sdpa", kind=OpKind.ATTENTION, flops=1e9, bytes_read=1e6, bytes_written=1e6, score_elements=5e7)
    old = SPEC.model_copy(update={"fused_attention": False})
    kwargs = {"samples": 2, "tp": 2, "strategy": ShardStrategy.HEADS, "dtype": DType.FP16, "calibration": FLAT}
    fused, unfused = op_time(op, spec=SPEC, **kwargs), op_time(op, spec=old, **kwargs)  # type: ignore[arg-type]
    one_pass_s = 5e7 * 2 / 2 * 2 / (1e12 * 0.8)  # elements x samples / tp x fp16 bytes / achieved bandwidth
    assert unfused.forward_s - fused.forward_s == pytest.approx(6 * one_pass_s + 3e-6)
    assert unfused.backward_s - fused.backward_s == pytest.approx(9 * one_pass_s + 4e-6)
    without_scores = op.model_copy(update={"score_elements": 0.0})
    assert op_time(without_scores, spec=old, **kwargs) == fused  # type: ignore[arg-type]


def test_a_power_capped_device_runs_tensor_work_at_its_sustained_clock() -> None:
    capped = SPEC.model_copy(update={"sustained_peak_fraction": 0.5})
    mm = Op(name="mm", kind=OpKind.MATMUL, flops=1e9, bytes_read=1e3, bytes_written=1e3)
    ln = Op(name="ln", kind=OpKind.LAYERNORM, flops=10.0, bytes_read=4e6, bytes_written=4e6)
    kwargs = {"samples": 1, "tp": 1, "dtype": DType.BF16, "calibration": FLAT}
    full = op_time(mm, strategy=ShardStrategy.COLUMN, spec=SPEC, **kwargs)  # type: ignore[arg-type]
    slow = op_time(mm, strategy=ShardStrategy.COLUMN, spec=capped, **kwargs)  # type: ignore[arg-type]
    assert slow.forward_s - 1e-6 == pytest.approx(2 * (full.forward_s - 1e-6))
    # memory-bound kernels keep the memory clock
    assert (op_time(ln, strategy=ShardStrategy.SEQUENCE, spec=capped, **kwargs)  # type: ignore[arg-type]
            == op_time(ln, strategy=ShardStrategy.SEQUENCE, spec=SPEC, **kwargs))  # type: ignore[arg-type]


def test_a_queued_device_waits_for_the_host_to_issue_a_block_of_short_ops_and_a_cpu_adds_it() -> None:
    """Under an eager runtime a block whose kernels take less device time than their issue costs the issue (each
    op's eager kernels; one forward and two backward for an op without a count); the host runs ahead under a
    long op, so a short op beside it costs only its kernel time; ops keep the compute scale; a fused runtime
    gets no floor; on a CPU (which runs its kernels itself) the fitted dispatch time adds to the ops'."""
    host = FLAT.model_copy(update={"host_dispatch_s": {"X": 1e-3, "cpu-x": 1e-3}, "compute_scale": {"X": 2.0}})
    short = Op(name="ln", kind=OpKind.LAYERNORM, flops=10.0, bytes_read=4e3, bytes_written=4e3,
               eager_kernels=(3, 5))
    other = short.model_copy(update={"name": "ln2", "eager_kernels": None})
    long = Op(name="mm", kind=OpKind.MATMUL, flops=1e12, bytes_read=1e3, bytes_written=1e3)
    args = {"samples": 1, "tp": 1, "dtype": DType.BF16, "autocast": True}
    strategies = {"ln": ShardStrategy.SEQUENCE, "ln2": ShardStrategy.SEQUENCE, "mm": ShardStrategy.COLUMN}
    shorts = Block(hash="s", ops=(short, other), params=0, output_bytes=0)
    t = block_time(shorts, strategies, spec=SPEC, calibration=host, eager=True, **args)  # type: ignore[arg-type]
    assert (t.forward_s, t.backward_s) == (pytest.approx(4e-3), pytest.approx(7e-3))  # 3 + 1 and 5 + 2 kernels
    fused = block_time(shorts, strategies, spec=SPEC, calibration=host, eager=False, **args)  # type: ignore[arg-type]
    assert fused.forward_s < 1e-4 and not fused.host_bound  # a fused runtime keeps its kernel times
    assert issued_kernels(short, eager=False, autocast=True) == (1, 2)
    assert issued_kernels(short, eager=True, autocast=True) == (3, 5)
    assert issued_kernels(other, eager=True, autocast=True) == (1, 2)
    mixed = Block(hash="m", ops=(long, short), params=0, output_bytes=0)
    op_args = {"samples": 1, "tp": 1, "dtype": DType.BF16}
    plain = op_time(long, spec=SPEC, calibration=FLAT, strategy=ShardStrategy.COLUMN, **op_args)  # type: ignore[arg-type]
    t = block_time(mixed, strategies, spec=SPEC, calibration=host, eager=True, **args)  # type: ignore[arg-type]
    kernels_s = op_time(short, spec=SPEC, calibration=host, strategy=ShardStrategy.SEQUENCE,
                        **op_args).forward_s  # type: ignore[arg-type]
    assert t.forward_s == pytest.approx(2.0 * plain.forward_s + kernels_s) and t.forward_s > 4e-3
    cpu = SPEC.model_copy(update={"name": "cpu-x"})
    assert not cpu.queued and SPEC.queued
    bare = block_time(shorts, strategies, spec=cpu, calibration=FLAT, eager=True, **args)  # type: ignore[arg-type]
    assert bare.forward_s < 1e-4  # no figure fitted for this CPU: the GPU host's default does not apply
    t = block_time(shorts, strategies, spec=cpu, calibration=host, eager=True, **args)  # type: ignore[arg-type]
    assert (t.forward_s, t.backward_s) == (pytest.approx(bare.forward_s + 4e-3), pytest.approx(bare.backward_s + 7e-3))
    assert not t.host_bound  # a CPU runs each kernel as it is issued: the dispatch adds, it is no floor
    t = block_time(mixed, strategies, spec=cpu, calibration=host, eager=True, **args)  # type: ignore[arg-type]
    cpu_short_s = op_time(short, spec=cpu, calibration=host, strategy=ShardStrategy.SEQUENCE,
                          **op_args).forward_s  # type: ignore[arg-type]
    assert t.forward_s == pytest.approx(plain.forward_s + cpu_short_s + (1 + 3) * 1e-3)  # nothing hides it


def test_an_fp32_eager_runtime_issues_no_autocast_casts() -> None:
    cast = Op(name="fc", kind=OpKind.MATMUL, flops=1e6, bytes_read=1e3, bytes_written=1e3, eager_kernels=(4, 6),
              eager_cast_kernels=(3, 3))
    assert issued_kernels(cast, eager=True, autocast=True) == (4, 6)
    assert issued_kernels(cast, eager=True, autocast=False) == (1, 3)
    assert issued_kernels(cast, eager=False, autocast=False) == (1, 2)  # a fused runtime: one kernel, two back
    assert Workload(global_batch=8, seq_len=64, eager=True).autocast
    assert not Workload(global_batch=8, seq_len=64, eager=True, dtype=DType.FP32).autocast
    assert not Workload(global_batch=8, seq_len=64).autocast  # Megatron keeps 16-bit weights: nothing to cast
    assert not Workload(global_batch=8, seq_len=64, eager=True, eager_16bit_weights=True).autocast  # FSDP's
    with pytest.raises(ValueError, match=r"eager_16bit_weights true describes an eager runtime; this workload has "
                       r"eager false \(accepted: eager true beside it\)"):
        Workload(global_batch=8, seq_len=64, eager_16bit_weights=True, eager=False)
    with pytest.raises(ValueError, match=r"eager_16bit_weights true, dtype 'fp32': weights held in 16 bits need a "
                       r"dtype of 16 bits or fewer.*accepted: any dtype but fp32"):
        Workload(global_batch=8, seq_len=64, eager_16bit_weights=True, eager=True, dtype=DType.FP32)


def test_an_eager_run_on_a_gpu_no_fit_names_takes_the_shipped_issue_time_and_a_fused_one_none() -> None:
    """`Calibration.host_issue_s`: under an eager runtime the fitted figure where one names the device (or *),
    else the eager default; a fused runtime no floor, fitted or not."""
    short = Op(name="ln", kind=OpKind.LAYERNORM, flops=10.0, bytes_read=4e3, bytes_written=4e3, eager_kernels=(3, 5))
    block = Block(hash="s", ops=(short,), params=0, output_bytes=0)
    args = {"samples": 1, "tp": 1, "dtype": DType.BF16, "spec": SPEC, "autocast": True}
    strategies = {"ln": ShardStrategy.SEQUENCE}
    default = FLAT.model_copy(update={"eager_host_dispatch_s": 1e-3})
    t = block_time(block, strategies, calibration=default, eager=True, **args)  # type: ignore[arg-type]
    assert (t.forward_s, t.backward_s) == (pytest.approx(3e-3), pytest.approx(5e-3)) and t.host_bound
    fused = block_time(block, strategies, calibration=default, eager=False, **args)  # type: ignore[arg-type]
    assert fused.forward_s < 1e-4 and not fused.host_bound  # a fused runtime's floor is not assumed
    fitted = default.model_copy(update={"host_dispatch_s": {"*": 2e-3}})
    t = block_time(block, strategies, calibration=fitted, eager=True, **args)  # type: ignore[arg-type]
    assert t.forward_s == pytest.approx(6e-3)
    assert fitted.host_issue_s("X", eager=False) == 0.0 == default.host_issue_s("X", eager=False)
    assert fitted.host_issue_s("X", eager=True) == 2e-3 and default.host_issue_s("Y", eager=True) == 1e-3
    assert DEFAULT_CALIBRATION.host_issue_s("X", eager=True) == DEFAULT_CALIBRATION.eager_host_dispatch_s > 0
    # a CPU takes its own fitted figure alone: the any-device one and the default come from GPU hosts
    assert fitted.host_issue_s("cpu-x", eager=True, queued=False) == 0.0
    own = fitted.model_copy(update={"host_dispatch_s": {"*": 2e-3, "cpu-x": 5e-6}})
    assert own.host_issue_s("cpu-x", eager=True, queued=False) == 5e-6


def test_an_op_cannot_cast_more_kernels_than_it_dispatches() -> None:
    with pytest.raises(ValueError, match="eager_cast_kernels"):
        Op(name="fc", kind=OpKind.MATMUL, flops=1.0, bytes_read=1.0, bytes_written=1.0, eager_kernels=(2, 4),
           eager_cast_kernels=(3, 1))
    with pytest.raises(ValueError, match="eager_cast_kernels"):
        Op(name="fc", kind=OpKind.MATMUL, flops=1.0, bytes_read=1.0, bytes_written=1.0, eager_cast_kernels=(1, 0))


def test_a_small_eager_model_on_a_gpu_is_reported_host_bound_and_costs_more_than_its_kernels() -> None:
    from tagplan.cost.baselines import megatron_plan
    from tagplan.cost.simulator import Simulator
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir import Workload

    model, cluster = load_model("gpt?layers=4&hidden=256&heads=4&vocab=1024", seq_len=128), load_cluster("dgx-h100")
    fused, eager = Workload(global_batch=8, seq_len=128), Workload(global_batch=8, seq_len=128, eager=True)
    plan = megatron_plan(Simulator(model, cluster, fused), tp=1, pp=1).plan
    assert plan is not None
    kernels_only = Simulator(model, cluster, fused).simulate(plan)
    issued = Simulator(model, cluster, eager).simulate(plan)
    assert "host-bound" in issued.stages[0].compute_source and "host-bound" not in kernels_only.stages[0].compute_source
    assert issued.iteration_time_s > 2 * kernels_only.iteration_time_s


def test_the_simulator_adds_an_fp32_cpu_runs_dispatch_without_autocasts_casts() -> None:
    """Stage times on a CPU under an eager fp32 runtime grow by the fitted dispatch time per kernel the blocks issue,
    counted without autocast's casts; under bf16 autocast by the count with them."""
    from tagplan.cost.simulator import Simulator
    from tagplan.frontends.cpu import build_cpu_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir import Plan, Stage

    cluster = build_cpu_cluster(SPEC.model_copy(update={"name": "cpu-x"}))
    fitted = DEFAULT_CALIBRATION.model_copy(update={"host_dispatch_s": {"cpu-x": 1e-3}})
    for dtype, autocast in ((DType.FP32, False), (DType.BF16, True)):
        workload = Workload(global_batch=4, seq_len=32, dtype=dtype, eager=True)
        model = load_model("llama?layers=2&hidden=64&heads=4&kv_heads=2&vocab=128", seq_len=32)
        plan = Plan(micro_batches=2, stages=(Stage(layers=(0, len(model.layers)), devices=(0,)),))
        bare = Simulator(model, cluster, workload).simulate(plan).stages[0]
        paid = Simulator(model, cluster, workload, calibration=fitted).simulate(plan).stages[0]
        kernels = [issued_kernels(op, eager=True, autocast=autocast)
                   for layer in model.layers for op in model.block_by_hash[layer.block].ops]
        assert paid.forward_s - bare.forward_s == pytest.approx(1e-3 * sum(k[0] for k in kernels), rel=1e-6)
        assert paid.backward_s - bare.backward_s == pytest.approx(1e-3 * sum(k[1] for k in kernels), rel=1e-6)
