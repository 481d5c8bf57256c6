from collections import Counter

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Plan, Stage, Workload


def test_prefix_block_counts_equal_a_direct_count_for_every_range() -> None:
    model = load_model("t5?layers=3&hidden=64&heads=4&ffn=128&vocab=50", seq_len=8)
    coster = Simulator(model, load_cluster("dgx-a100-80gb"), Workload()).coster
    n = len(model.layers)
    for start in range(n):
        for end in range(start + 1, n + 1):
            expected = Counter(model.layers[i].block for i in range(start, end))
            assert coster.block_counts(Stage(layers=(start, end), devices=(0,))) == expected


def test_equal_blocks_on_equal_links_are_costed_once() -> None:
    model = load_model("gpt?layers=8&hidden=256&heads=4&vocab=100", seq_len=64)
    sim = Simulator(model, load_cluster("dgx-a100-80gb:nodes=2"), Workload(global_batch=8, seq_len=64))
    a = Stage(layers=(0, 10), devices=(0, 1, 2, 3), tp=4)
    b = Stage(layers=(0, 10), devices=(8, 9, 10, 11), tp=4)  # another node, same link class
    sim.coster.group_cost(a, 0, 1.0)
    before = (len(sim.coster.block_memo), len(sim.coster.tp_memo))
    sim.coster.group_cost(b, 0, 1.0)
    assert (len(sim.coster.block_memo), len(sim.coster.tp_memo)) == before


def test_a_cut_inside_the_t5_decoder_carries_the_encoder_output_too() -> None:
    model = load_model("t5?layers=3&hidden=64&heads=4&ffn=128&vocab=50", seq_len=8)
    coster = Simulator(model, load_cluster("dgx-a100-80gb"), Workload()).coster
    names = [layer.name for layer in model.layers]
    inside_decoder = names.index("decoder.block.2")
    in_encoder = names.index("encoder.block.2")
    width = model.block_of(1).output_bytes
    assert coster.cut_bytes(in_encoder) == width
    assert coster.cut_bytes(inside_decoder) == 2 * width  # the previous block's output and the encoder's


def test_a_mixed_group_is_paced_by_its_slowest_figure_of_each_kind() -> None:
    cluster = load_cluster("dgx-a100-40gb+dgx-a100-80gb")  # equal peaks, different memory bandwidth
    sim = Simulator(load_model("gpt?layers=2&hidden=64&heads=4&vocab=10", seq_len=8), cluster, Workload())
    a40, a80 = cluster.devices[0].spec, cluster.devices[8].spec
    paced = sim.coster.slowest((8, 0))
    assert paced.mem_bandwidth_Bps == min(a40.mem_bandwidth_Bps, a80.mem_bandwidth_Bps)
    assert paced.peak_flops_bf16 == min(a40.peak_flops_bf16 or 0, a80.peak_flops_bf16 or 0)
    assert sim.coster.slowest((8, 9)) == a80  # one type: itself


def test_a_mixed_groups_cost_does_not_depend_on_its_named_type_being_costed_first() -> None:
    # the combined spec of an A100-80GB + A100-40GB group is named A100-80GB (equal peaks) but has the
    # 40GB's lower memory bandwidth: it must not share the 80GB's memoised block times
    model = load_model("gpt?layers=4&hidden=1024&heads=16&vocab=5000", seq_len=512)
    cluster, workload = load_cluster("dgx-a100-80gb+dgx-a100-40gb"), Workload(global_batch=8, seq_len=512)
    pure = Plan(stages=(Stage(layers=(0, len(model.layers)), devices=(0, 1), tp=2),))
    mixed = Plan(stages=(Stage(layers=(0, len(model.layers)), devices=(0, 8), tp=2),))
    fresh = Simulator(model, cluster, workload).simulate(mixed).iteration_time_s
    warmed = Simulator(model, cluster, workload)
    assert warmed.simulate(pure).iteration_time_s < fresh  # the 80GB pair is faster: the two differ
    assert warmed.simulate(mixed).iteration_time_s == fresh


def _plans_that_differ_in_what_memos_key_on(sim: Simulator) -> list[Plan]:
    """Plans on 2 x 8 GPUs (one node of each of two types) that differ only in what a memo might
    forget: per-replica samples, which replica is uneven, which tensor-parallel group spans the
    nodes, the GPU types of a group, and the sharding stage."""
    layers = len(sim.model.layers)
    whole = (0, layers)
    plans = []
    for samples in [(5, 1, 1, 1), (1, 1, 1, 5), (2, 2, 2, 2), (3, 3, 1, 1)]:
        plans.append(Plan(micro_batches=2, stages=(Stage(layers=whole, devices=(0, 1, 2, 3), dp=4,
                                                         batch_samples=samples),)))
    for devices in [(0, 1, 7, 8), (7, 8, 0, 1), (0, 8, 1, 9), (8, 9, 10, 11)]:  # intra / across nodes / mixed types
        for zero in (0, 3):
            plans.append(Plan(micro_batches=2, stages=(Stage(layers=whole, devices=devices, dp=2, tp=2, zero=zero,
                                                             batch_samples=(3, 5)),)))
    return plans


def test_a_shared_simulator_gives_each_plan_what_a_fresh_one_gives() -> None:
    """Every memo a simulator keeps between plans keys on all its value depends on: after simulating
    plans that differ only in replica samples, link classes and GPU types, each report equals a fresh
    simulator's (a key missing any of them hands one plan another's cost)."""
    model = load_model("gpt?layers=4&hidden=512&heads=8&vocab=1000", seq_len=256)
    cluster, workload = load_cluster("dgx-a100-80gb+p3.16xlarge"), Workload(global_batch=16, seq_len=256)
    shared = Simulator(model, cluster, workload)
    plans = _plans_that_differ_in_what_memos_key_on(shared)
    for plan in plans + plans[::-1]:
        assert shared.simulate(plan) == Simulator(model, cluster, workload).simulate(plan), plan
    uneven = [shared.simulate(p).stages[0].forward_s for p in plans[:2]]
    assert uneven[0] == uneven[1]  # the 5-sample replica paces the stage wherever it sits
    # the same replica groups with the same samples, listed in the other order, pace the stage alike:
    # a mixed-type pair across the nodes, an A100 (0) with a V100 (8), and two A100 pairs on different links
    nodes = "dgx-a100-80gb:nodes=2+p3.16xlarge"
    for cluster_spec, pair in [(cluster, [((0, 1, 7, 8), (3, 5)), ((7, 8, 0, 1), (5, 3))]),
                               (cluster, [((0, 8), (4, 4)), ((8, 0), (4, 4))]),
                               (load_cluster(nodes), [((0, 1, 7, 8), (4, 4)), ((7, 8, 0, 1), (4, 4))])]:
        sim = Simulator(model, cluster_spec, workload)
        tp = len(pair[0][0]) // 2
        stages = [sim.simulate(Plan(micro_batches=2, stages=(Stage(layers=(0, len(model.layers)), devices=d, dp=2,
                                                                   tp=tp, batch_samples=n),))).stages[0]
                  for d, n in pair]
        same = [(st.model_dump(exclude={"memory"}), st.memory.memory_bytes) for st in stages]  # not which device
        assert same[0] == same[1], (cluster_spec.name, pair)


def _tp_costs(spec: str, cluster: str, *, overlap: bool, tp: int, recompute: bool) -> tuple[Simulator, Stage]:
    m = load_model(spec, seq_len=2048)
    sim = Simulator(m, load_cluster(cluster), Workload(global_batch=8, seq_len=2048, tp_comm_overlap=overlap))
    return sim, Stage(layers=(0, len(m.layers)), devices=tuple(range(tp)), tp=tp, recompute=recompute)


def test_tp_comm_overlap_exposes_per_block_what_its_compute_cannot_cover() -> None:
    from tagplan.cost.stage_cost import CHECKPOINT_SKIPPED, TP_OVERLAP_SKIPPED, exposed_tp_s

    spec = "gpt?layers=4&hidden=4096&heads=32&vocab=5000"
    for cluster, tp in (("dgx-a100-80gb", 8), ("p3.8xlarge", 4)):  # NVSwitch; NVLink pairs over PCIe
        for recompute in (False, True):
            sim, stage = _tp_costs(spec, cluster, overlap=False, tp=tp, recompute=recompute)
            plain = sim.coster.group_cost(stage, 0, 1.0)
            osim, _ = _tp_costs(spec, cluster, overlap=True, tp=tp, recompute=recompute)
            over = osim.coster.group_cost(stage, 0, 1.0)
            assert (over.forward_compute_s, over.backward_compute_s) == (
                plain.forward_compute_s, plain.backward_compute_s)
            # block by block: forward comm under forward compute, backward under backward compute, and
            # a recomputed block's replayed forward collectives exposed as in the forward; the embedding's
            # and head's collectives (outside Transformer Engine's linear layers) exposed whole
            fwd = bwd = edge = 0.0
            for block_hash, count in osim.coster.units(stage):
                sharded = osim.coster.sharded(block_hash, None)
                t = osim.coster._block(block_hash, sharded, osim.coster.slowest(stage.devices), tp, 1.0, None)
                comm_f, comm_b = osim.coster._tp(block_hash, sharded, stage.devices, 1.0, None)
                f, b = exposed_tp_s(comm_f, t.forward_s, tp), exposed_tp_s(comm_b, t.backward_s, tp)
                if osim.model.block_by_hash[block_hash].kind in TP_OVERLAP_SKIPPED:
                    f, b = comm_f, comm_b
                    edge += comm_f + comm_b
                replay = recompute and osim.model.block_by_hash[block_hash].kind not in CHECKPOINT_SKIPPED
                fwd += count * f
                bwd += count * (b + (f if replay else 0.0))
            assert over.forward_tp_s == fwd and over.backward_tp_s == bwd
            assert edge > 0.0  # the embedding and head do communicate
            assert plain.forward_tp_s / tp - 1e-12 <= over.forward_tp_s < plain.forward_tp_s
    # the rule itself: what the compute cannot cover, at least one chunk, nothing without a collective
    assert exposed_tp_s(3.0, 1.0, 4) == 2.0
    assert exposed_tp_s(1.0, 5.0, 4) == 0.25
    assert exposed_tp_s(0.0, 5.0, 4) == 0.0


def test_tp_comm_overlap_shortens_the_simulated_iteration_by_the_tp_time_it_hides() -> None:
    m = load_model("gpt?layers=4&hidden=4096&heads=32&vocab=5000", seq_len=2048)
    cluster = load_cluster("dgx-a100-80gb")
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, len(m.layers)), devices=tuple(range(8)), tp=8),))
    reports = {flag: Simulator(m, cluster, Workload(global_batch=8, seq_len=2048, tp_comm_overlap=flag)).simulate(plan)
               for flag in (False, True)}
    off, on = reports[False].breakdown, reports[True].breakdown
    assert on.compute == off.compute and 0.0 < on.tp_comm < off.tp_comm
    saved = reports[False].iteration_time_s - reports[True].iteration_time_s
    assert saved == pytest.approx(off.tp_comm - on.tp_comm, rel=1e-6)
