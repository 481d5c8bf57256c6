import itertools

from tagplan.cost.calibration import DEFAULT_CALIBRATION
from tagplan.cost.comm import CommModel
from tagplan.cost.sharding import comm_events, default_strategies
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import DType, ShardStrategy
from tagplan.search.intra import solve_block


def solutions(spec: str, cluster_spec: str, seq: int, tp: int, micro_batches: int = 8):
    cluster = load_cluster(cluster_spec)
    comm = CommModel(cluster)
    group = tuple(range(tp))
    block = load_model(spec, seq_len=seq).block_of(1)
    sols = solve_block(block, tp=tp, samples=1, spec=cluster.devices[0].spec, dtype=DType.BF16,
                       calibration=DEFAULT_CALIBRATION,
                       comm=lambda c, n: comm.collective(c, group, n).time_s, micro_batches=micro_batches)
    return block, sols


def test_recovers_megatron_column_row_pattern_as_the_least_memory_plan() -> None:
    for spec in ("gpt?layers=1&hidden=2048&heads=16&vocab=100", "llama?layers=1&hidden=2048&heads=16&vocab=100"):
        block, sols = solutions(spec, "dgx-a100-80gb", 2048, 4)
        leanest = min(sols, key=lambda s: s.memory_bytes)
        megatron = default_strategies(block)
        matmuls = [op.name for op in block.ops if op.kind.value == "matmul"]
        assert {n: leanest.strategies[n] for n in matmuls} == {n: megatron[n] for n in matmuls}
        assert leanest.strategies["attn.sdpa"] is ShardStrategy.HEADS


def test_frontier_is_sorted_and_non_dominated() -> None:
    _, sols = solutions("gpt?layers=1&hidden=1024&heads=16&vocab=100", "dgx-a100-80gb", 512, 4)
    assert sols
    for a, b in itertools.pairwise(sols):
        assert a.time_s <= b.time_s and a.memory_bytes > b.memory_bytes


def test_slow_links_push_the_fastest_plan_away_from_activation_collectives() -> None:
    """On PCIe T4s the time-optimal plan splits tokens (DP-like) rather than paying per-layer collectives."""
    block, fast = solutions("gpt?layers=1&hidden=1024&heads=16&vocab=100", "dgx-a100-80gb", 1024, 4, 64)
    _, slow = solutions("gpt?layers=1&hidden=1024&heads=16&vocab=100", "g4dn.12xlarge", 1024, 4, 64)
    megatron = default_strategies(block)
    assert slow[0].strategies["mlp.fc1"] is not megatron["mlp.fc1"] or slow[0].strategies["attn.q"] is not \
        megatron["attn.q"]
    assert fast[0].time_s < slow[0].time_s


def test_the_fastest_head_sharding_hands_the_loss_its_logits_where_they_lie() -> None:
    """On a tp-4 group the solver's fastest head pairs the projection and the loss in one layout: the
    simulator's costing of it (`comm_events`) moves no logits (a vocabulary-parallel or token-split loss)."""
    cluster = load_cluster("dgx-a100-80gb")
    comm = CommModel(cluster)
    model = load_model("gpt?layers=1&hidden=1024&heads=16&vocab=50000", seq_len=1024)
    head = model.block_of(len(model.layers) - 1)
    logits = next(op.bytes_written for op in head.ops if op.name == "lm_head.tied")
    sols = solve_block(head, tp=4, samples=1, spec=cluster.devices[0].spec, dtype=DType.BF16,
                       calibration=DEFAULT_CALIBRATION, micro_batches=8,
                       comm=lambda c, n: comm.collective(c, tuple(range(4)), n).time_s)
    fastest = sols[0].strategies
    assert fastest["lm_head.tied"] is not ShardStrategy.ROW
    assert not [e for e in comm_events(head, fastest) if e.bytes_per_sample == logits and not e.per_iteration]


def test_a_solve_past_its_deadline_is_abandoned_and_the_refinement_changes_nothing() -> None:
    """The refinement after the search kept a service worker for minutes past a 5 s budget on a block of 10,000
    ops: a deadline now bounds it, and an abandoned solve is not remembered as a block without a solution."""
    import time

    import pytest

    from tagplan.cost.simulator import Simulator
    from tagplan.ir import Workload
    from tagplan.ir.plan import Plan, Stage
    from tagplan.search.intra import OutOfTimeError
    from tagplan.search.refine import refine_sharding

    cluster = load_cluster("dgx-a100-80gb")
    model = load_model("gpt?layers=2&hidden=256&heads=4&vocab=100", seq_len=128)
    comm = CommModel(cluster)
    with pytest.raises(OutOfTimeError):
        solve_block(model.block_of(1), tp=2, samples=1, spec=cluster.devices[0].spec, dtype=DType.BF16,
                    calibration=DEFAULT_CALIBRATION, comm=lambda c, n: comm.collective(c, (0, 1), n).time_s,
                    deadline=time.perf_counter() - 1.0)
    sim = Simulator(model, cluster, Workload(global_batch=8, seq_len=128))
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2),))
    assert refine_sharding(sim, plan, deadline=time.perf_counter() - 1.0) == (None, 1, 0, True)
    refined, solves, hits, cut = refine_sharding(sim, plan)  # in time: solved now, not taken from the abandoned one
    assert solves >= 1 and hits == 0 and refined is not None and not cut

