from tagplan.cost.baselines import data_parallel, megatron, megatron_plan
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Workload


def test_data_parallel_takes_the_least_zero_stage_that_fits() -> None:
    small = Simulator(load_model("gpt3-125m", seq_len=512), load_cluster("dgx-a100-80gb"),
                      Workload(global_batch=16, seq_len=512))
    plan = data_parallel(small).plan
    assert plan is not None and plan.stages[0].zero == 0 and plan.stages[0].dp == 8
    big = Simulator(load_model("gpt3-6.7b", seq_len=512), load_cluster("dgx-a100-40gb"),
                    Workload(global_batch=16, seq_len=512))
    plan = data_parallel(big).plan
    assert plan is not None and plan.stages[0].zero >= 1
    for zero in range(plan.stages[0].zero):  # every smaller stage really does not fit
        stage = plan.stages[0].model_copy(update={"zero": zero})
        assert not big.simulate(plan.model_copy(update={"stages": (stage,)})).fits


def test_data_parallel_refuses_with_a_reason() -> None:
    sim = Simulator(load_model("gpt3-175b"), load_cluster("dgx-a100-80gb"), Workload(global_batch=8, seq_len=2048))
    result = data_parallel(sim)
    assert result.plan is None and "does not fit" in result.reason


def test_megatron_keeps_tp_in_the_node_and_pipelines_across_nodes() -> None:
    sim = Simulator(load_model("gpt3-175b"), load_cluster("dgx-a100-80gb:nodes=16"),
                    Workload(global_batch=512, seq_len=2048))
    plan = megatron(sim).plan
    assert plan is not None
    assert {s.tp for s in plan.stages} == {8}
    pp = len(plan.stages)
    assert pp > 1 and 16 % pp == 0
    assert all(s.devices == tuple(range(i * 128 // pp, (i + 1) * 128 // pp)) for i, s in enumerate(plan.stages))
    assert plan.micro_batches == 512 // plan.stages[0].dp
    sizes = [s.num_layers for s in plan.stages]
    assert max(sizes) - min(sizes) <= 2  # even split; embedding and head ride on the ends
    assert sim.simulate(plan).fits
    assert megatron_plan(sim, tp=8, pp=pp // 2).plan is None or pp == 1  # fewest fitting stages chosen


def test_megatron_refuses_unequal_nodes() -> None:
    sim = Simulator(load_model("gpt3-125m"), load_cluster("dgx-a100-80gb+g4dn.12xlarge"), Workload(global_batch=24))
    result = megatron(sim)
    assert result.plan is None and "GPU count" in result.reason
