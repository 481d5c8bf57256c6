import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tagplan.cost.calibration import Calibration
from tagplan.cost.comm import Collective, CommMode
from tagplan.cost.report import Report
from tagplan.cost.simulator import ReduceOverlap, Simulator
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import (
    Block,
    Cluster,
    DType,
    Layer,
    LinkKind,
    ModelGraph,
    Network,
    Node,
    Op,
    OpKind,
    Plan,
    Schedule,
    Stage,
    Workload,
)

from .conftest import flat_cluster, matmul_model, unit_spec


def simulate(model: ModelGraph, cluster: Cluster, plan: Plan, workload: Workload, *,
             calibration: Calibration | None = None, comm_mode: CommMode = CommMode.TOPOLOGY) -> Report:
    """One plan's Report from a fresh Simulator (the tests here change the cluster between calls)."""
    extra = {} if calibration is None else {"calibration": calibration}
    return Simulator(model, cluster, workload, comm_mode=comm_mode, **extra).simulate(plan)


def one_per_stage(stages: int, layers: int, micro_batches: int, schedule: Schedule = Schedule.ONE_F_ONE_B) -> Plan:
    per = layers // stages
    return Plan(micro_batches=micro_batches, schedule=schedule,
                stages=tuple(Stage(layers=(s * per, (s + 1) * per), devices=(s,)) for s in range(stages)))


@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (2, 4), (4, 8), (4, 3)])
def test_1f1b_equal_stages_take_m_plus_s_minus_1_slots(ideal: Calibration, stages: int, micro_batches: int) -> None:
    """(M + S - 1) * (t_f + t_b) without communication; t_f = FLOPs / peak, t_b = 2 t_f."""
    model = matmul_model(8, flops=1e9)
    workload = Workload(global_batch=micro_batches * 2, seq_len=1)
    report = simulate(model, flat_cluster(stages), one_per_stage(stages, 8, micro_batches), workload,
                      calibration=ideal)
    t_f = (8 // stages) * 1e9 * 2 / 1e12  # layers x FLOPs x samples per micro-batch / peak
    assert report.iteration_time_s == pytest.approx((micro_batches + stages - 1) * 3 * t_f, rel=1e-9)
    assert report.breakdown.total_s == pytest.approx(report.iteration_time_s, rel=1e-9)
    assert report.breakdown.compute == pytest.approx(micro_batches * 3 * t_f, rel=1e-9)


def test_a_slow_stage_dominates(ideal: Calibration) -> None:
    """Stage 1 on a device 4x slower: GPipe takes sum(t_s) + (M - 1) * t_slow (a flow shop)."""
    fast, slow = unit_spec("FAST", peak=4e12), unit_spec("SLOW", peak=1e12)
    nodes = (Node(name="a", device=fast, gpus=1, fabric_bandwidth_Bps=1e30),
             Node(name="b", device=slow, gpus=1, fabric_bandwidth_Bps=1e30, nic_bandwidth_Bps=1e30))
    cluster = Cluster(name="mixed", nodes=nodes, network=Network(latency_s=0.0))
    model, m = matmul_model(2, flops=1e9), 6
    report = simulate(model, cluster, one_per_stage(2, 2, m, Schedule.GPIPE), Workload(global_batch=m, seq_len=1),
                      calibration=ideal)
    t_fast, t_slow = 3e9 / 4e12, 3e9 / 1e12
    assert report.iteration_time_s == pytest.approx(t_fast + t_slow + (m - 1) * t_slow, rel=1e-9)
    assert report.breakdown.bubble > 0


def test_p2p_on_the_links_between_stages_lengthens_the_pipeline(ideal: Calibration) -> None:
    """GPipe: (M + S - 1)(t_f + t_b) + 2 (S - 1) c, with c one micro-batch's transfer time."""
    model = matmul_model(2, flops=1e9, output_bytes=1e6)
    plan = one_per_stage(2, 2, 4, Schedule.GPIPE)
    workload = Workload(global_batch=4, seq_len=1)
    fast = simulate(model, flat_cluster(2), plan, workload, calibration=ideal)
    slow = simulate(model, flat_cluster(2, bandwidth_Bps=1e9, latency_s=1e-5), plan, workload, calibration=ideal)
    transfer = 1e-5 + 1e6 / 1e9  # one micro-batch's activations over the stage link
    assert slow.iteration_time_s == pytest.approx(fast.iteration_time_s + 2 * transfer, rel=1e-6)
    assert slow.breakdown.pp_comm == pytest.approx(2 * transfer, rel=1e-6)


def test_uneven_batch_shares_are_simulated_replica_by_replica(ideal: Calibration) -> None:
    """Two replicas, one 3x faster: even shares wait for the slow one; 3:1 shares balance them."""
    fast, slow = unit_spec("FAST", peak=3e12), unit_spec("SLOW", peak=1e12)
    nodes = (Node(name="a", device=fast, gpus=1, fabric_bandwidth_Bps=1e30, nic_bandwidth_Bps=1e30),
             Node(name="b", device=slow, gpus=1, fabric_bandwidth_Bps=1e30, nic_bandwidth_Bps=1e30))
    cluster = Cluster(name="mixed", nodes=nodes, network=Network(latency_s=0.0))
    model, workload = matmul_model(4, flops=1e9), Workload(global_batch=8, seq_len=1)
    even = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), dp=2),))
    balanced = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), dp=2, batch_shares=(0.75, 0.25)),))
    t_even = simulate(model, cluster, even, workload, calibration=ideal).iteration_time_s
    t_balanced = simulate(model, cluster, balanced, workload, calibration=ideal).iteration_time_s
    assert t_even == pytest.approx(4 * 3 * 1e9 * 4 / 1e12, rel=1e-9)  # slow replica, 4 samples
    assert t_balanced == pytest.approx(4 * 3 * 1e9 * 6 / 3e12, rel=1e-9)  # both replicas finish together
    assert t_balanced < t_even


def test_interleaving_shrinks_the_bubble(ideal: Calibration) -> None:
    model, workload = matmul_model(8, flops=1e9), Workload(global_batch=8, seq_len=1)
    plain = one_per_stage(2, 8, 8)
    groups = [(0,), (1,)]
    inter = Plan(micro_batches=8, schedule=Schedule.INTERLEAVED_1F1B,
                 stages=tuple(Stage(layers=(2 * i, 2 * i + 2), devices=groups[i % 2]) for i in range(4)))
    a = simulate(model, flat_cluster(2), plain, workload, calibration=ideal)
    b = simulate(model, flat_cluster(2), inter, workload, calibration=ideal)
    assert b.iteration_time_s < a.iteration_time_s
    assert b.breakdown.bubble == pytest.approx(a.breakdown.bubble / 2, rel=1e-9)


def test_gpt3_175b_stage_memory_under_tp8_pp8_zero1_matches_a_hand_computation() -> None:
    model = load_model("gpt3-175b")
    cluster = load_cluster("dgx-a100-80gb:nodes=128")
    h, s, tp, pp, dp, m = 12288, 2048, 8, 8, 16, 64
    bounds = [0] + [1 + 12 * (i + 1) for i in range(7)] + [98]
    plan = Plan(micro_batches=m, stages=tuple(
        Stage(layers=(bounds[i], bounds[i + 1]), devices=tuple(range(128 * i, 128 * (i + 1))), dp=dp, tp=tp, zero=1)
        for i in range(pp)))
    report = Simulator(model, cluster, Workload(global_batch=1024, seq_len=s)).simulate(plan)
    mem = report.stages[1].memory  # stage 1: twelve transformer blocks
    # Matmul weights and biases split 8 ways (12h^2 + 9h per block); the two LayerNorms (4h) replicated.
    params = 12 * ((12 * h * h + 9 * h) / tp + 4 * h)
    assert mem.weights_bytes == pytest.approx(2 * params, rel=1e-9)
    assert mem.gradients_bytes == pytest.approx(2 * params, rel=1e-9)
    assert mem.optimizer_bytes == pytest.approx(12 * params / dp, rel=1e-9)  # ZeRO-1: fp32 master, m, v
    # 1F1B: stage 1 of 8 holds 7 micro-batches; each block saves 16 s h bf16 elements per sample
    # (Korthikanti et al. 2022's 34 s h bytes minus the two dropout masks, with flash attention),
    # divided by tp under sequence parallelism; one sample per micro-batch per replica.
    assert report.stages[1].in_flight == 7
    assert mem.activations_bytes == pytest.approx(7 * 12 * 32 * s * h / tp, rel=0.01)
    assert report.fits


def test_more_bandwidth_never_makes_the_dgx_plan_slower() -> None:
    model = load_model("gpt?layers=8&hidden=1024&heads=16&vocab=1000", seq_len=512)
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 5), devices=tuple(range(8)), dp=2, tp=4, zero=1),
                                         Stage(layers=(5, 10), devices=tuple(range(8, 16)), dp=2, tp=4)))
    workload = Workload(global_batch=16, seq_len=512)
    times = []
    for factor in (1.0, 2.0, 10.0):
        cluster = load_cluster("dgx-a100-40gb:nodes=2")
        nodes = tuple(n.model_copy(update={"fabric_bandwidth_Bps": n.fabric_bandwidth_Bps * factor,
                                           "nic_bandwidth_Bps": n.nic_bandwidth_Bps * factor}) for n in cluster.nodes)
        times.append(simulate(model, cluster.model_copy(update={"nodes": nodes}), plan, workload).iteration_time_s)
    assert times[0] >= times[1] >= times[2]
    assert times[0] > times[2]


@settings(max_examples=25, deadline=None)
@given(st.floats(1.0, 100.0), st.floats(1e8, 1e11), st.sampled_from([1, 2, 4]), st.integers(0, 3),
       st.sampled_from(list(Schedule)[:2]))
def test_property_more_bandwidth_is_never_slower(factor: float, nic: float, tp: int, zero: int,
                                                 schedule: Schedule) -> None:
    model = load_model("llama?layers=4&hidden=256&heads=4&vocab=500", seq_len=128)
    spec = unit_spec("G", peak=1e14, mem_bytes=10**11).model_copy(update={"mem_bandwidth_Bps": 1e12})

    def cluster(f: float) -> Cluster:
        node = Node(name="n", device=spec, gpus=4, fabric=LinkKind.PCIE, fabric_bandwidth_Bps=2e10 * f,
                    nics=1, nic_bandwidth_Bps=nic * f)
        return Cluster(name="c", nodes=(node, node.model_copy(update={"name": "m"})))

    per = 8 // (2 * tp)
    plan = Plan(micro_batches=2, schedule=schedule, stages=(
        Stage(layers=(0, 3), devices=tuple(range(4)), dp=4 // tp, tp=tp, zero=zero),
        Stage(layers=(3, 6), devices=tuple(range(4, 8)), dp=per if per else 1, tp=4 // max(per, 1), zero=zero)))
    workload = Workload(global_batch=8, seq_len=128)
    slow = simulate(model, cluster(1.0), plan, workload).iteration_time_s
    fast = simulate(model, cluster(factor), plan, workload).iteration_time_s
    assert fast <= slow * (1 + 1e-9)


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_more_micro_batches_never_raise_peak_activation_memory(schedule: Schedule) -> None:
    """Fixed global batch: GPipe keeps all M in flight (M x B/M constant); 1F1B at most S (falls)."""
    model = load_model("gpt?layers=6&hidden=256&heads=4&vocab=500", seq_len=128)
    cluster = flat_cluster(4, spec=unit_spec(mem_bytes=10**12))
    workload = Workload(global_batch=32, seq_len=128)
    acts = []
    for m in (1, 2, 4, 8, 16, 32):
        plan = Plan(micro_batches=m, schedule=schedule, stages=tuple(
            Stage(layers=(2 * i, 2 * i + 2), devices=(i,)) for i in range(4)))
        report = simulate(model, cluster, plan, workload)
        acts.append(max(st.memory.activations_bytes for st in report.stages))
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(acts))
    if schedule is Schedule.ONE_F_ONE_B:
        assert acts[-1] < acts[0]


def test_1f1b_never_holds_more_activations_than_gpipe() -> None:
    model = load_model("gpt?layers=6&hidden=256&heads=4&vocab=500", seq_len=128)
    cluster, workload = flat_cluster(4), Workload(global_batch=32, seq_len=128)
    for m in (2, 8, 32):
        mems = []
        for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
            plan = Plan(micro_batches=m, schedule=schedule, stages=tuple(
                Stage(layers=(2 * i, 2 * i + 2), devices=(i,)) for i in range(4)))
            mems.append(simulate(model, cluster, plan, workload).peak_memory_bytes)
        assert mems[0] <= mems[1]


def test_a_plan_that_does_not_fit_is_reported_not_raised() -> None:
    model = load_model("gpt3-6.7b")
    cluster = load_cluster("g4dn.12xlarge")  # 4 x T4 16 GB
    plan = Plan(micro_batches=1, stages=(Stage(layers=(0, len(model.layers)), devices=(0, 1, 2, 3), dp=4),))
    report = simulate(model, cluster, plan, Workload(global_batch=4, seq_len=2048))
    assert not report.fits
    assert report.worst_device in (0, 1, 2, 3)
    assert report.peak_memory_bytes > 16e9
    assert report.worst_device_memory.memory_bytes == report.peak_memory_bytes


def test_plans_that_do_not_apply_name_the_problem() -> None:
    model = matmul_model(4, flops=1.0)
    with pytest.raises(SpecError, match=r"devices \[9\] are not in cluster"):
        simulate(model, flat_cluster(2), Plan(stages=(Stage(layers=(0, 4), devices=(9,)),)), Workload())
    with pytest.raises(SpecError, match=r"covers layers \[0, 3\)"):
        simulate(model, flat_cluster(2), Plan(stages=(Stage(layers=(0, 3), devices=(0,)),)), Workload())
    inter = Plan(micro_batches=3, schedule=Schedule.INTERLEAVED_1F1B, stages=tuple(
        Stage(layers=(i, i + 1), devices=((0,), (1,))[i % 2]) for i in range(4)))
    with pytest.raises(SpecError, match=r"micro_batches \(3\) to be a multiple of the pipeline depth \(2\)"):
        simulate(model, flat_cluster(2), inter, Workload(global_batch=8))


def test_bytes_only_mode_ignores_the_topology() -> None:
    model = load_model("gpt?layers=4&hidden=512&heads=8&vocab=1000", seq_len=256)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=tuple(range(8)), dp=8),))
    workload = Workload(global_batch=16, seq_len=256)
    fast, slow = load_cluster("dgx-a100-80gb"), load_cluster("p3.16xlarge")
    topo = [simulate(model, c, plan, workload).breakdown.dp_comm for c in (fast, slow)]
    volume = [simulate(model, c, plan, workload, comm_mode=CommMode.BYTES_ONLY).stages[0].dp_sync_s
              for c in (fast, slow)]
    assert topo[0] < topo[1]
    assert volume[0] == pytest.approx(volume[1])


def test_folding_changes_speed_not_results() -> None:
    model = load_model("gpt?layers=6&hidden=256&heads=4&vocab=500", seq_len=128)
    cluster, workload = load_cluster("dgx-a100-80gb"), Workload(global_batch=16, seq_len=128)
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), dp=2, tp=2, zero=1),
                                         Stage(layers=(4, 8), devices=(4, 5, 6, 7), dp=1, tp=4)))
    folded = Simulator(model, cluster, workload).simulate(plan)
    unfolded = Simulator(model, cluster, workload, fold=False).simulate(plan)
    assert unfolded.iteration_time_s == pytest.approx(folded.iteration_time_s, rel=1e-12)
    assert unfolded.peak_memory_bytes == pytest.approx(folded.peak_memory_bytes, rel=1e-12)


def test_interleaved_memory_is_the_lane_peak_not_the_sum_of_chunk_peaks(ideal: Calibration) -> None:
    """S=4 lanes, v=2 chunks, M=8: lane 1 holds at most 9 chunk-micro-batches at once, not 6 + 6."""
    model = matmul_model(8, flops=1e9, output_bytes=1e6)
    groups = [(0,), (1,), (2,), (3,)]
    plan = Plan(micro_batches=8, schedule=Schedule.INTERLEAVED_1F1B,
                stages=tuple(Stage(layers=(i, i + 1), devices=groups[i % 4]) for i in range(8)))
    report = simulate(model, flat_cluster(4), plan, Workload(global_batch=8, seq_len=1), calibration=ideal)
    lane1 = [s.memory.activations_bytes for s in report.stages if s.index % 4 == 1]
    assert report.stages[1].memory.activations_bytes == pytest.approx(9 * 1e6, rel=1e-9)
    assert len(lane1) == 2


def test_interleaved_chunks_reduce_gradients_as_each_finishes() -> None:
    """Chunk 1's gradients are ready long before chunk 0's: only the tail of the queue is exposed."""
    model = load_model("gpt?layers=8&hidden=1024&heads=16&vocab=1000", seq_len=512)
    cluster, workload = load_cluster("p3.8xlarge:nodes=4"), Workload(global_batch=32, seq_len=512)
    groups = [tuple(range(0, 8)), tuple(range(8, 16))]  # two nodes per group: DP over the slow network
    plan = Plan(micro_batches=8, schedule=Schedule.INTERLEAVED_1F1B, stages=tuple(
        Stage(layers=(b, e), devices=groups[i % 2], dp=2, tp=4) for i, (b, e) in
        enumerate([(0, 3), (3, 5), (5, 8), (8, 10)])))
    report = simulate(model, cluster, plan, workload)
    total_reduce = sum(s.dp_sync_s for s in report.stages)
    assert 0 < report.breakdown.dp_comm < total_reduce
    assert report.breakdown.total_s == pytest.approx(report.iteration_time_s, rel=1e-9)


def test_gradients_reduced_in_fp32_move_twice_the_bytes_of_fp16() -> None:
    model = load_model("gpt?layers=4&hidden=512&heads=8&vocab=1000", seq_len=256)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=tuple(range(8)), dp=8),))
    half = Workload(global_batch=16, seq_len=256, dtype=DType.FP16)
    full = half.model_copy(update={"grad_reduce_dtype": DType.FP32})
    cluster = load_cluster("p3.16xlarge")
    sync = [simulate(model, cluster, plan, w, comm_mode=CommMode.BYTES_ONLY).stages[0].dp_sync_s for w in (half, full)]
    assert sync[1] == pytest.approx(2 * sync[0])
    reports = [simulate(model, cluster, plan, w) for w in (half, full)]
    assert reports[1].breakdown.dp_comm > reports[0].breakdown.dp_comm
    assert reports[1].peak_memory_bytes == reports[0].peak_memory_bytes  # reduced in fp32, stored as before


def test_a_runtime_that_reduces_after_the_backward_exposes_the_whole_reduction() -> None:
    """DeepSpeed's pipeline engine all-reduces after the flush: nothing of the sync is hidden."""
    model = load_model("gpt?layers=4&hidden=1024&heads=16&vocab=1000", seq_len=512)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=tuple(range(8)), dp=8),))
    overlapped = Workload(global_batch=16, seq_len=512, dtype=DType.FP16)
    after = overlapped.model_copy(update={"grad_reduce_overlap": False})
    cluster = load_cluster("g4dn.12xlarge:nodes=2")  # 4 GPUs a node: the all-reduce crosses the network
    hidden, exposed = (simulate(model, cluster, plan, w) for w in (overlapped, after))
    sync = exposed.stages[0].dp_sync_s
    assert hidden.stages[0].dp_sync_s == pytest.approx(sync)  # the same collective, scheduled differently
    assert hidden.breakdown.dp_comm < sync  # buckets but the last hide behind the backward
    assert exposed.breakdown.dp_comm == pytest.approx(sync)
    assert exposed.iteration_time_s == pytest.approx(hidden.iteration_time_s - hidden.breakdown.dp_comm + sync)


def test_a_runtime_rule_decides_per_stage_which_reductions_overlap() -> None:
    model = load_model("gpt?layers=4&hidden=1024&heads=16&vocab=1000", seq_len=512)
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 3), devices=tuple(range(8)), dp=8),
                                         Stage(layers=(3, 6), devices=tuple(range(8, 16)), dp=8)))
    cluster = load_cluster("g4dn.12xlarge:nodes=4")
    overlapped = Workload(global_batch=32, seq_len=512, dtype=DType.FP16)
    after = overlapped.model_copy(update={"grad_reduce_overlap": False})

    def exposed(workload: Workload, rule: ReduceOverlap | None = None) -> float:
        return Simulator(model, cluster, workload, reduce_overlap=rule).simulate(plan).iteration_time_s

    assert exposed(overlapped, lambda p: {0: False, 1: False}) == pytest.approx(exposed(after))
    assert exposed(after, lambda p: {0: True, 1: True}) == pytest.approx(exposed(overlapped))
    assert exposed(overlapped) < exposed(overlapped, lambda p: {0: False}) <= exposed(after)


def test_a_tied_head_away_from_the_embedding_keeps_a_copy_and_sums_its_gradient_with_it() -> None:
    """Megatron's embedding group, DeepSpeed's ReduceTiedGrads: the head's stage holds and trains a copy
    of the token embedding and all-reduces its gradient with the first stage after the flush."""
    vocab, hidden = 8000, 512
    workload = Workload(global_batch=8, seq_len=256)
    cluster = load_cluster("p3.8xlarge:nodes=2")  # the two stages on two nodes, over the network
    split = Plan(micro_batches=2, stages=(Stage(layers=(0, 3), devices=(0,)), Stage(layers=(3, 6), devices=(4,))))
    whole = Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=(0,)),))
    for family, tied in (("gpt", True), ("llama", False)):
        model = load_model(f"{family}?layers=4&hidden={hidden}&heads=8&vocab={vocab}", seq_len=256)
        sim = Simulator(model, cluster, workload)
        copy = sim.coster.tied_copy_params(split.stages[1])
        assert copy == (vocab * hidden if tied else 0.0)
        assert sim.coster.tied_copy_params(whole.stages[0]) == 0.0
        seconds, waiting = sim.tied_sync(split)
        assert (seconds > 0, waiting) == ((True, frozenset({0, 1})) if tied else (False, frozenset()))
        report = sim.simulate(split)
        if tied:  # nothing else is reduced (dp 1): the exposed sync is the tied sum
            assert report.breakdown.dp_comm == pytest.approx(seconds)
            params = sim.coster.local_params(split.stages[0]) + sim.coster.local_params(split.stages[1])
            assert params == pytest.approx(sim.coster.local_params(whole.stages[0]) + copy)
    assert sim.tied_sync(whole) == (0.0, frozenset())


def test_stages_of_different_shapes_sum_the_whole_tied_table_over_both() -> None:
    """The torch pipeline runtime all-reduces the table over both stages where they pair no device to device."""
    model = load_model("gpt?layers=4&hidden=512&heads=8&vocab=8000", seq_len=256)
    sim = Simulator(model, load_cluster("p3.8xlarge:nodes=4"), Workload(global_batch=8, seq_len=256))
    even = Plan(micro_batches=2, stages=(Stage(layers=(0, 3), devices=(0, 4), dp=2),
                                         Stage(layers=(3, 6), devices=(8, 12), dp=2)))
    uneven = Plan(micro_batches=2, stages=(Stage(layers=(0, 3), devices=(0,)),
                                           Stage(layers=(3, 6), devices=(8, 9, 12, 13), dp=2, tp=2)))
    pair, _ = sim.tied_sync(even)
    whole, waiting = sim.tied_sync(uneven)
    assert waiting == frozenset({0, 1})
    table = 8000 * 512 * 2  # bytes of the bf16 gradient
    assert pair == pytest.approx(sim.comm.collective(Collective.ALL_REDUCE, (0, 8), table).time_s)
    assert whole == pytest.approx(sim.comm.collective(Collective.ALL_REDUCE, (0, 8, 9, 12, 13), table).time_s)


def test_attention_without_a_fused_kernel_keeps_its_probabilities_for_the_backward() -> None:
    """On a V100 each layer keeps softmax output, dropout mask and output: 5 bytes per score element."""
    layers, heads, seq = 2, 4, 512
    model = load_model(f"gpt?layers={layers}&hidden=256&heads={heads}&vocab=1000", seq_len=seq, dtype=DType.FP16)
    workload = Workload(global_batch=4, seq_len=seq, dtype=DType.FP16)

    def activations(preset: str, *, tp: int = 1, recompute: bool = False) -> float:
        plan = Plan(stages=(Stage(layers=(0, layers + 2), devices=tuple(range(tp)), tp=tp, recompute=recompute),))
        memory = simulate(model, load_cluster(preset), plan, workload).stages[0].memory
        return memory.activations_bytes + memory.other_bytes  # the recomputed layer's working set is "other"

    scores = layers * heads * seq * seq * 4  # per layer and sample, times the 4 samples
    assert activations("p3.8xlarge") - activations("p4d.24xlarge") == pytest.approx(5 * scores)
    assert activations("p3.8xlarge", tp=2) - activations("p4d.24xlarge", tp=2) == pytest.approx(5 * scores / 2)
    # a runtime whose attention is fused everywhere (PyTorch SDPA) keeps none, and pays no score passes
    fused = workload.model_copy(update={"fused_attention": True})
    plan = Plan(stages=(Stage(layers=(0, layers + 2), devices=(0,)),))
    v100 = [simulate(model, load_cluster("p3.8xlarge"), plan, w) for w in (workload, fused)]
    a100 = simulate(model, load_cluster("p4d.24xlarge"), plan, fused)
    assert v100[1].stages[0].memory.activations_bytes == pytest.approx(a100.stages[0].memory.activations_bytes)
    assert v100[1].iteration_time_s < v100[0].iteration_time_s
    # attention kept whole on every rank keeps all of its scores
    whole = Plan(stages=(Stage(layers=(0, layers + 2), devices=(0, 1), tp=2, sharding={"attn.sdpa": "replicate"}),))
    kept = [simulate(model, load_cluster(p), whole, workload).stages[0].memory.activations_bytes
            for p in ("p3.8xlarge", "p4d.24xlarge")]
    assert kept[0] - kept[1] == pytest.approx(5 * scores)
    # recomputed: only the layer being recomputed holds them
    assert activations("p3.8xlarge", recompute=True) - activations("p4d.24xlarge", recompute=True) == \
        pytest.approx(5 * scores / layers)


def test_sharded_stages_pay_one_collective_latency_per_layer(ideal: Calibration) -> None:
    """ZeRO 1-2 reduce-scatter and gather layer by layer (FSDP units, distributed-optimizer buckets)."""
    model = matmul_model(6, flops=1.0, params=1000)
    cluster = flat_cluster(4, latency_s=1e-3)  # unlimited bandwidth: only latency counts
    sim = Simulator(model, cluster, Workload(global_batch=2, seq_len=1), calibration=ideal)

    def sync(zero: int, layers: tuple[int, int] = (0, 6)) -> tuple[float, float]:
        rest = [Stage(layers=(layers[1], 6), devices=(2, 3), dp=2)] if layers[1] < 6 else []
        plan = Plan(stages=(Stage(layers=layers, devices=(0, 1), dp=2, zero=zero), *rest))
        return sim.stage_costs(plan)[0][0].dp_sync_s

    whole_reduce, _ = sync(0)
    reduce, gather = sync(1)
    assert gather == pytest.approx(reduce)  # six reduce-scatters, six all-gathers, one step each on 2 ranks
    assert reduce == pytest.approx(6 * sync(1, (0, 1))[0])  # six layers: six latencies, one layer: one
    assert reduce > whole_reduce  # one all-reduce for the whole unsharded stage


def test_the_sync_memo_tells_apart_stages_with_equal_parameters_in_different_layer_counts(ideal: Calibration) -> None:
    """One 4000-parameter layer and four 1000-parameter layers on the same devices sync differently."""
    big = Block(hash="big", ops=(Op(name="mm", kind=OpKind.MATMUL, flops=1.0, bytes_read=0.0, bytes_written=0.0,
                                    param_bytes=8000.0),), params=4000, output_bytes=0.0)
    small = Block(hash="small", ops=(Op(name="mm", kind=OpKind.MATMUL, flops=1.0, bytes_read=0.0, bytes_written=0.0,
                                        param_bytes=2000.0),), params=1000, output_bytes=0.0)
    model = ModelGraph(name="m", seq_len=1, blocks=(big, small), layers=(
        Layer(name="b", block="big"), *(Layer(name=f"s{i}", block="small") for i in range(4))))
    sim = Simulator(model, flat_cluster(4, latency_s=1e-3), Workload(global_batch=2, seq_len=1), calibration=ideal)

    def reduce_on_01(first_on_01: bool) -> float:
        a, b = (0, 1), (2, 3)
        stages = (Stage(layers=(0, 1), devices=a if first_on_01 else b, dp=2, zero=1),
                  Stage(layers=(1, 5), devices=b if first_on_01 else a, dp=2, zero=1))
        costs = sim.stage_costs(Plan(stages=stages))[0]
        return costs[0 if first_on_01 else 1].dp_sync_s[0]

    one_layer, four_layers = reduce_on_01(True), reduce_on_01(False)  # same simulator, same memo
    assert four_layers == pytest.approx(4 * one_layer)


def test_recompute_replays_the_blocks_but_not_the_embedding_or_the_head() -> None:
    model = load_model("gpt?layers=2&hidden=256&heads=4&vocab=30000", seq_len=128)
    sim = Simulator(model, load_cluster("p3.8xlarge"), Workload(global_batch=4, seq_len=128))
    n = len(model.layers)

    def run(recompute: bool) -> tuple[list[tuple[float, float]], Report]:
        plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 1), devices=(0,), recompute=recompute),
                                             Stage(layers=(1, n - 1), devices=(1,), recompute=recompute),
                                             Stage(layers=(n - 1, n), devices=(2,), recompute=recompute)))
        return [(t.forward_s, t.backward_s) for t in sim.stage_costs(plan)[1]], sim.simulate(plan)

    (plain, plain_report), (replayed, replayed_report) = run(False), run(True)
    assert replayed[1][1] == pytest.approx(plain[1][1] + plain[1][0])  # the blocks' forward is replayed
    assert replayed[0] == pytest.approx(plain[0]) and replayed[2] == pytest.approx(plain[2])  # not the ends'
    # the head keeps every activation it saves (the logits' softmax), as without recompute; the blocks do not
    memory = plain_report.memory_per_device_bytes, replayed_report.memory_per_device_bytes
    assert memory[1][2] == pytest.approx(memory[0][2]) and memory[1][1] < memory[0][1]


def test_a_head_recompute_does_not_checkpoint_keeps_its_own_split_of_what_it_saves() -> None:
    model = load_model("gpt?layers=2&hidden=256&heads=4&vocab=30000", seq_len=128)
    sim = Simulator(model, load_cluster("p3.8xlarge"), Workload(global_batch=4, seq_len=128))
    n = len(model.layers)
    whole = {"lm_head.tied": "replicate", "cross_entropy": "replicate"}  # the head is not split over its tp pair

    def head_memory(recompute: bool) -> float:
        plan = Plan(micro_batches=2, stages=(Stage(layers=(0, n - 1), devices=(0, 1), tp=2),
                                             Stage(layers=(n - 1, n), devices=(2, 3), tp=2, recompute=recompute,
                                                   sharding=whole)))
        return sim.simulate(plan).memory_per_device_bytes[2]

    assert head_memory(True) == pytest.approx(head_memory(False))


def test_fp8_keeps_gemm_inputs_as_fp8_copies_and_the_rest_in_bf16() -> None:
    """Under fp8 a block keeps what its GEMMs save at 1 byte an element and what its norms,
    attention and activations save at bf16's 2: the saving is exactly half the matmuls' share."""
    cluster = load_cluster("dgx-h100")
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 26), devices=tuple(range(8)), dp=2, tp=4),))
    acts = {}
    for dtype in (DType.BF16, DType.FP8):
        model = load_model("llama?layers=24&hidden=2048&heads=16&kv_heads=8&vocab=32000", seq_len=2048, dtype=dtype)
        report = Simulator(model, cluster, Workload(global_batch=8, seq_len=2048, dtype=dtype)).simulate(plan)
        acts[dtype] = report.stages[0].memory.activations_bytes
    blocks = [model.block_by_hash[layer.block] for layer in model.layers]
    gemm = sum(op.saved_bytes for b in blocks for op in b.ops if op.kind is OpKind.MATMUL)
    total = sum(b.saved_bytes for b in blocks)
    assert 0.2 < gemm / total < 0.8  # the test means something: both kinds save a real share
    assert acts[DType.FP8] / acts[DType.BF16] == pytest.approx((total - gemm / 2) / total, rel=1e-6)


def test_a_tied_sum_is_memoised_per_mesh_not_per_device_set() -> None:
    """The tied head's gradient sum runs pair by pair where the two stages' meshes match, else as one
    all-reduce: a simulator that costed one must not hand its figure to the other on the same devices."""
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir.plan import Plan, Stage
    from tagplan.ir.workload import Workload

    model, cluster = load_model("gpt?layers=4&hidden=1024&heads=16&vocab=50304", seq_len=512), load_cluster(
        "p3.8xlarge:nodes=2")
    workload = Workload(global_batch=8, seq_len=512)
    head = Stage(layers=(3, 6), devices=(4, 5, 6, 7), dp=4)
    paired = Plan(micro_batches=2, stages=(Stage(layers=(0, 3), devices=(0, 1, 2, 3), dp=4), head))
    whole = Plan(micro_batches=2, stages=(Stage(layers=(0, 3), devices=(0, 1, 2, 3), dp=2, tp=2), head))
    shared = Simulator(model, cluster, workload)
    shared.simulate(paired)
    fresh = Simulator(model, cluster, workload).simulate(whole).iteration_time_s
    assert shared.tied_sync(whole) != Simulator(model, cluster, workload).tied_sync(paired)
    assert shared.simulate(whole).iteration_time_s == fresh
