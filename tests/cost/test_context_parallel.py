"""Context parallelism (`Stage.cp`): a replica's samples split by sequence over cp tensor-parallel groups,
keys and values passed around the cp ring, gradients reduced over dp * cp."""

from __future__ import annotations

import pytest

from tagplan.cost.compute import op_time
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import OpKind
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import Workload

SPEC = "llama?layers=4&hidden=2048&heads=16&kv_heads=8&vocab=32000"
SEQ = 16384


def _sim(cluster: str = "dgx-h100:nodes=2") -> Simulator:
    model = load_model(SPEC, seq_len=SEQ)
    return Simulator(model, load_cluster(cluster), Workload(global_batch=4, seq_len=SEQ))


def _plan(dp: int, cp: int, tp: int, devices: tuple[int, ...], *, zero: int = 0) -> Plan:
    return Plan(micro_batches=4 // dp, stages=(Stage(layers=(0, 6), devices=devices, dp=dp, cp=cp, tp=tp, zero=zero),))


def test_the_mesh_orders_devices_tp_fastest_then_cp_then_dp() -> None:
    stage = Stage(layers=(0, 2), devices=tuple(range(8)), dp=2, cp=2, tp=2)
    assert stage.dp_cp == 4
    assert [stage.tp_group(g) for g in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert stage.replica(1) == (4, 5, 6, 7)  # both of replica 1's context-parallel ranks
    with pytest.raises(ValueError, match=r"dp \* cp \* tp = 2 \* 2 \* 2 = 8 but the stage has 4 devices"):
        Stage(layers=(0, 2), devices=(0, 1, 2, 3), dp=2, cp=2, tp=2)
    with pytest.raises(ValueError, match=r"dp \* tp = 2 \* 2 = 4 but the stage has 2 devices"):
        Stage(layers=(0, 2), devices=(0, 1), dp=2, tp=2)  # without cp the message is as it was


def test_a_context_parallel_replica_costs_what_two_replicas_of_half_its_samples_do() -> None:
    """One replica over two cp ranks, each with half of every sample's tokens, computes, holds and reduces as two
    data-parallel replicas with half the samples each; the ring, inside one NVSwitch node at 16k tokens, hides
    behind attention, so the iterations take the same time."""
    sim = _sim()
    def plan(dp: int, cp: int) -> Plan:
        return Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=(0, 1), dp=dp, cp=cp, zero=1),))
    ring, halves = sim.simulate(plan(1, 2)), sim.simulate(plan(2, 1))
    assert ring.stages[0].cp == 2 and ring.stages[0].samples_per_micro_batch == 2  # whole samples per replica
    assert halves.stages[0].samples_per_micro_batch == 1
    assert ring.stages[0].tp_comm_s == 0.0
    assert ring.stages[0].forward_s == pytest.approx(halves.stages[0].forward_s, rel=1e-12)
    assert ring.stages[0].memory.activations_bytes == pytest.approx(halves.stages[0].memory.activations_bytes)
    assert ring.iteration_time_s == pytest.approx(halves.iteration_time_s, rel=1e-9)


def test_activations_divide_by_cp_and_zero_shards_over_dp_times_cp() -> None:
    sim = _sim()
    whole = sim.simulate(_plan(1, 1, 2, (0, 1)))
    split = sim.simulate(_plan(1, 2, 2, (0, 1, 2, 3)))
    assert split.stages[0].memory.activations_bytes == pytest.approx(whole.stages[0].memory.activations_bytes / 2)
    sharded_cp = sim.simulate(_plan(1, 2, 2, (0, 1, 2, 3), zero=1)).stages[0].memory
    sharded_dp = sim.simulate(_plan(2, 1, 2, (0, 1, 2, 3), zero=1)).stages[0].memory
    assert sharded_cp.optimizer_bytes == pytest.approx(sharded_dp.optimizer_bytes)
    unsharded = sim.simulate(_plan(1, 2, 2, (0, 1, 2, 3))).stages[0].memory
    assert sharded_cp.optimizer_bytes == pytest.approx(unsharded.optimizer_bytes / 2)


def test_the_ring_exposes_what_a_send_takes_beyond_its_chunk_of_attention() -> None:
    """Across two nodes on a slow network the key/value chunk outlasts a chunk's attention: per attention op the
    exposed time is (cp - 1) x (send - attention / cp), forward with the chunk, backward with the chunk and its
    gradient."""
    model = load_model(SPEC, seq_len=SEQ)
    base = load_cluster("dgx-h100:nodes=2")
    slow = base.model_copy(update={"nodes": tuple(n.model_copy(update={"nic_bandwidth_Bps": 1e8}) for n in base.nodes)})
    sim = Simulator(model, slow, Workload(global_batch=4, seq_len=SEQ))
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 6), devices=(0, 8), cp=2),))
    stage = plan.stages[0]
    spec = slow.devices[0].spec
    expected = 0.0
    for block_hash, count in sim.coster.units(stage):
        strategies = sim.coster.sharded(block_hash, None).strategies
        for op in model.block_by_hash[block_hash].ops:
            if op.kind is not OpKind.ATTENTION:
                continue
            chunk = (op.bytes_read - op.bytes_written) * 0.5  # half of one sample's keys and values
            t = op_time(op, samples=0.5, tp=1, strategy=strategies[op.name], spec=spec, dtype=model.dtype,
                        calibration=sim.calibration)
            forward = max(0.0, sim.comm.p2p_groups((0,), (8,), chunk).time_s - t.forward_s / 2)
            backward = max(0.0, sim.comm.p2p_groups((0,), (8,), 2 * chunk).time_s - t.backward_s / 2)
            expected += count * (forward + backward)
    assert expected > 0
    assert sim.simulate(plan).stages[0].tp_comm_s == pytest.approx(expected, rel=1e-9)
    fast = Simulator(model, base, Workload(global_batch=4, seq_len=SEQ)).simulate(plan)
    assert fast.stages[0].tp_comm_s < expected


def test_megatron_runs_context_parallelism_and_the_others_refuse_it() -> None:
    from tagplan.export import ExportError
    from tagplan.export.capability import exportable
    from tagplan.export.deepspeed import deepspeed_config
    from tagplan.export.megatron import megatron_arguments
    from tagplan.export.torch_checks import check_expressible

    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1, 2, 3), cp=2, tp=2),
                                         Stage(layers=(2, 4), devices=(4, 5, 6, 7), cp=2, tp=2)))
    args = megatron_arguments(model, plan, global_batch=8, seq_len=16)
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert args[args.index("--micro-batch-size") + 1] == "4"  # dp 1: the replica takes the whole micro-batch
    odd = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=18)
    with pytest.raises(ExportError, match=r"2 \* cp = 4 chunks"):
        megatron_arguments(odd, plan, global_batch=8, seq_len=18)
    mixed = plan.model_copy(update={"stages": (plan.stages[0], Stage(layers=(2, 4), devices=(4, 5, 6, 7), dp=2, tp=2))})
    assert "stages[1].cp = 1 but stages[0].cp = 2" in (exportable(mixed, "megatron", model, global_batch=8) or "")
    with pytest.raises(ExportError, match=r"stages\[0\]\.cp = 2: DeepSpeed"):
        deepspeed_config(model, Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1), cp=2),)),
                         global_batch=8, seq_len=16)
    with pytest.raises(ExportError, match=r"stages\[0\]\.cp = 2: the program has no context parallelism"):
        check_expressible(plan, model)
    # with the cluster, each tensor-parallel group is judged for the TP overlap, not the whole replica
    assert exportable(plan, "megatron", model, global_batch=8, cluster=load_cluster("dgx-h100"),
                      tp_comm_overlap=True) is None


def test_the_gnn_features_a_context_parallel_plan() -> None:
    from tagplan.gnn.features import featurize

    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=64)
    cluster = load_cluster("dgx-h100")
    workload = Workload(global_batch=8, seq_len=64)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=tuple(range(8)), dp=2, cp=2, tp=2),))
    data = featurize(model, cluster, workload, plan)
    flat = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=tuple(range(8)), dp=4, tp=2),))
    assert data["device"].x.shape == featurize(model, cluster, workload, flat)["device"].x.shape


def test_context_parallel_ranks_reduce_gradients_so_megatron_overlaps_them_at_dp_1() -> None:
    """With dp 1 and cp 2 the two context-parallel ranks still reduce their gradients (and ZeRO-1 shards over
    them): the export keeps the overlap it was costed with, and says the reduction overlaps."""
    from tagplan.export.megatron import grad_reduce, megatron_arguments

    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), cp=2, tp=2, zero=1),))
    args = megatron_arguments(model, plan, global_batch=8, seq_len=16)
    assert "--overlap-grad-reduce" in args and "--overlap-param-gather" in args
    assert grad_reduce(plan, model.dtype).overlap is True
    sim = Simulator(model, load_cluster("dgx-h100"), Workload(global_batch=8, seq_len=16))
    assert sim.simulate(plan).stages[0].dp_sync_s > 0


def test_sequence_parallelism_must_split_each_context_rank_s_tokens() -> None:
    from tagplan.export import ExportError
    from tagplan.export.megatron import megatron_arguments
    from tagplan.search.baselines import context_degrees

    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=12)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=tuple(range(8)), cp=2, tp=4),))
    with pytest.raises(ExportError, match=r"seq_len / cp tokens over tp"):  # 12 / 2 = 6 tokens over tp 4
        megatron_arguments(model, plan, global_batch=8, seq_len=12)
    sim = Simulator(load_model(SPEC, seq_len=8200), load_cluster("dgx-h100"), Workload(global_batch=4, seq_len=8200))
    assert context_degrees(sim, 8, 1) == [1, 2, 4]  # 16 does not divide 8200
    assert context_degrees(sim, 8, 8) == [1]  # 8200 / 2 = 4100 tokens do not split over tp 8
    from tagplan.ir.plan import context_split_whole  # the one rule both use
    assert context_split_whole(12, 2, 2) and not context_split_whole(12, 2, 4) and context_split_whole(7, 1, 1)
    short = Simulator(load_model(SPEC, seq_len=4096), load_cluster("dgx-h100"), Workload(global_batch=4, seq_len=4096))
    assert context_degrees(short, 8, 1) == [1]  # below 8k tokens the grid does not try cp
