from dataclasses import replace

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload
from tagplan.ir.plan import check_whole_samples
from tagplan.search.exhaustive import terminals
from tagplan.search.groups import partitions, tp_options
from tagplan.search.space import MEMORY_OPTIONS, PlanSpace, PlanState, apportion, divisors


def space(model: str, cluster: str, batch: int = 8, seq: int = 128) -> PlanSpace:
    return PlanSpace(Simulator(load_model(model, seq_len=seq), load_cluster(cluster), Workload(global_batch=batch,
                                                                                               seq_len=seq)))


def test_every_terminal_is_a_valid_plan_covering_the_model() -> None:
    sp = space("gpt?layers=4&hidden=128&heads=4&vocab=100", "p3.8xlarge+g4dn.12xlarge")
    states = terminals(sp, limit=20000)
    assert states
    used = set()
    for state in states[:: max(len(states) // 200, 1)]:
        plan = sp.to_plan(state)
        assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 6
        assert set(plan.devices) <= set(range(8))
        check_whole_samples(plan, 8)  # every replica gets whole samples of every micro-batch
        used.add(len(plan.devices))
    assert used == {4, 8}  # every node, or the V100 node alone (the T4 node idle)


def test_whole_samples_on_an_uneven_split() -> None:
    sp = space("gpt?layers=4&hidden=128&heads=4&vocab=100", "p3.8xlarge+g4dn.12xlarge", batch=6)
    for state in terminals(sp, limit=20000) or []:
        plan = sp.to_plan(state)
        check_whole_samples(plan, 6)
        for stage in plan.stages:
            if stage.batch_samples is not None:
                assert sum(stage.batch_samples) == 6 // plan.micro_batches
                assert min(stage.batch_samples) >= 1


def test_apportion_and_divisors() -> None:
    assert apportion(7, [3.0, 1.0]) == (5, 2)
    assert apportion(2, [100.0, 1.0]) == (1, 1)  # at least one sample each
    assert sum(apportion(1000, [1.0, 2.0, 3.0])) == 1000
    assert divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(999_999_937) == [1, 999_999_937]  # a prime: trial division to sqrt, not a walk to n


def test_tp_groups_never_cross_nodes() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    assert tp_options(cluster, tuple(range(16))) == [1, 2, 4, 8]
    mixed = load_cluster("dgx-a100-80gb+g4dn.12xlarge")
    assert 8 not in tp_options(mixed, tuple(range(12)))  # the T4 node has only 4 GPUs
    for part in partitions(mixed, 2, space("gpt?layers=2&hidden=64&heads=4&vocab=10", "dgx-a100-80gb")
                           .sim.workload.dtype):
        assert sorted(d for group in part for d in group) == list(range(12))


def test_boundaries_give_faster_stages_more_layers() -> None:
    sp = space("gpt?layers=24&hidden=256&heads=4&vocab=100", "dgx-a100-80gb+g4dn.12xlarge")
    state = PlanState(nodes=sp.on_every_node().nodes, stages=2)
    fast_first = next(a.value for a in sp.actions(state) if a.value[0][0] == 0)  # A100 node first
    state = PlanState(nodes=sp.on_every_node().nodes, stages=2, groups=fast_first, tps=(1, 1), cp=1)
    cut = sp.actions(state)[0].value
    assert cut > 13  # 8 A100s (312 TFLOP/s each) against 4 T4s (65): most of the 26 layers go first


def test_default_completion_is_deterministic_and_terminal() -> None:
    sp = space("gpt?layers=4&hidden=128&heads=4&vocab=100", "dgx-a100-80gb")
    a, b = sp.complete(PlanState()), sp.complete(PlanState())
    assert a == b and sp.is_terminal(a)


def test_interleaved_plans_are_proposed_and_valid() -> None:
    sp = space("gpt?layers=8&hidden=128&heads=4&vocab=100", "p3.8xlarge:nodes=2", batch=8)
    state = PlanState(nodes=sp.on_every_node().nodes, stages=2)
    state = sp.step(state, sp.actions(state)[0])
    state = sp.step(sp.step(state, sp.actions(state)[0]), sp.actions(sp.step(state, sp.actions(state)[0]))[0])
    while state.chunks is None:
        options = sp.actions(state)
        if options[0].field == "micro_batches":
            options = [a for a in options if a.value % 2 == 0] or options
        if options[0].field == "chunks":
            assert [a.value for a in options] == [1, 2]
            state = sp.step(state, options[1])
            break
        state = sp.step(state, options[0])
    plan = sp.to_plan(sp.complete(state))
    assert plan.schedule.value == "interleaved_1f1b" and len(plan.stages) == 4
    assert plan.stages[0].devices == plan.stages[2].devices != plan.stages[1].devices
    sp.sim.simulate(plan)  # valid and simulable


def test_default_completion_takes_the_first_memory_option_that_fits() -> None:
    # Llama-2-70B on two A100 nodes fits only with recompute and ZeRO-3: the rollout must say so, not
    # complete every plan with the first option (ZeRO-1, no recompute) and value it as not fitting
    sp = space("llama2-70b", "dgx-a100-80gb:nodes=2", batch=16, seq=4096)
    done = sp.complete(PlanState())
    fits = [sp.sim.fits(sp.to_plan(replace(done, memory=m))) for m in MEMORY_OPTIONS]
    assert done.memory != MEMORY_OPTIONS[0] and True in fits
    assert done.memory == MEMORY_OPTIONS[fits.index(True)]  # the cheapest option that fits, by its order


def test_default_completion_prefers_the_earlier_of_several_memory_options_that_fit() -> None:
    # Llama-2-7B on eight 40 GB A100s at tp 1: ZeRO-1's replicated weights and gradients do not fit,
    # ZeRO-2 and everything after it do; the rollout takes ZeRO-2 (no recompute), not a later one
    sp = space("llama2-7b", "dgx-a100-40gb", batch=16, seq=2048)
    state = PlanState()
    while not state.tps:
        options = sp.actions(state)
        one = [a for a in options if a.field in ("stages", "tps") and a.value == 1]
        state = sp.step(state, one[0] if one else options[0])
    done = sp.complete(state)
    fits = [sp.sim.fits(sp.to_plan(replace(done, memory=m))) for m in MEMORY_OPTIONS]
    assert fits[:2] == [False, False] and all(fits[2:])
    assert done.memory == MEMORY_OPTIONS[2] == (False, 2)


def test_default_completion_keeps_the_first_memory_option_when_none_fits() -> None:
    sp = space("gpt3-13b", "p3.8xlarge", batch=8, seq=2048)  # 13B on four 16 GB V100s
    done = sp.complete(PlanState())
    assert not any(sp.sim.fits(sp.to_plan(replace(done, memory=m))) for m in MEMORY_OPTIONS)
    assert done.memory == MEMORY_OPTIONS[0]


def test_long_sequences_add_the_context_parallel_decision_and_its_plans_are_valid() -> None:
    short = space("llama?layers=4&hidden=256&heads=8&kv_heads=4&vocab=512", "dgx-h100:nodes=1", batch=4, seq=4096)
    assert all(sp_plan.stages[0].cp == 1 for sp_plan in map(short.to_plan, terminals(short, limit=3000)))
    sp = space("llama?layers=4&hidden=256&heads=8&kv_heads=4&vocab=512", "dgx-h100:nodes=1", batch=8, seq=8192)
    one_stage = PlanState(nodes=(0,), stages=1, groups=(tuple(range(8)),), tps=(2,))
    assert [(a.field, a.value) for a in sp.actions(one_stage)] == [("cp", 1), ("cp", 2), ("cp", 4)]  # of 4 replicas
    seen = set()
    for terminal in terminals(sp, limit=20000):
        plan = sp.to_plan(terminal)
        check_whole_samples(plan, 8)
        for stage in plan.stages:
            assert stage.dp * stage.cp * stage.tp == len(stage.devices)
            assert stage.zero == 0 or stage.dp * stage.cp > 1  # ZeRO shards over dp x cp
        seen.add(plan.stages[0].cp)
        assert (sp.plan_key(terminal)[1] == plan.stages[0].cp)  # cp is part of what makes the plan
    assert seen == {1, 2, 4, 8}


def test_the_search_alone_finds_context_parallelism_where_it_pays() -> None:
    from tagplan.search.mcts import mcts, uniform_prior
    from tagplan.search.planner import SimulatorEvaluator

    sp = space("llama3-8b", "dgx-h100:nodes=2", batch=16, seq=32768)
    judge = SimulatorEvaluator(sp)
    mcts(sp, PlanState(), prior=uniform_prior, evaluator=judge, max_evaluations=300, max_wall_s=60, seed=0, local=sp)
    fitting = [c for c in judge.candidates.values() if c.report.fits]
    best = min(fitting, key=lambda c: c.report.iteration_time_s)
    without = [c.report.iteration_time_s for c in fitting if all(s.cp == 1 for s in c.plan.stages)]
    assert best.plan.stages[0].cp > 1 and best.report.iteration_time_s < min(without)
