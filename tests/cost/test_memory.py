import pytest

from tagplan.cost.memory import model_state_bytes
from tagplan.ir import DType, Optimizer, Workload


@pytest.mark.parametrize(("zero", "expected"), [
    (0, (2.0, 2.0, 12.0)), (1, (2.0, 2.0, 12.0 / 8)), (2, (2.0, 2.0 / 8, 12.0 / 8)), (3, (2.0 / 8, 2.0 / 8, 12.0 / 8)),
])
def test_zero_stages_divide_state_by_dp(zero: int, expected: tuple[float, float, float]) -> None:
    """Mixed-precision Adam: 2 + 2 + 12 bytes per parameter (reference/hardware.md)."""
    assert model_state_bytes(1.0, Workload(), zero=zero, dp=8) == pytest.approx(expected)


def test_optimizer_state_follows_the_workload() -> None:
    assert model_state_bytes(1.0, Workload(dtype=DType.FP32, optimizer=Optimizer.SGD), zero=0, dp=1) == (4, 4, 0)
    assert model_state_bytes(1.0, Workload(optimizer=Optimizer.SGD_MOMENTUM), zero=0, dp=1)[2] == 8


def test_eager_autocast_keeps_a_16_bit_copy_of_every_multiplied_weight_per_micro_batch_in_flight() -> None:
    """Under autocast over fp32 weights (`Workload.eager`) each GEMM's weight is cast once per micro-batch and
    the backward keeps the copy: 2 bytes per multiplied parameter per micro-batch in flight, the tied head's
    table included, the lookup tables not; none in fp32 or for a runtime with 16-bit weights."""
    from tagplan.cost.baselines import megatron_plan
    from tagplan.cost.simulator import Simulator
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model

    model = load_model("gpt?layers=4&hidden=256&heads=4&vocab=1024", seq_len=64)
    cluster = load_cluster("dgx-a100-80gb")
    fused = Workload(global_batch=8, seq_len=64)
    base_plan = megatron_plan(Simulator(model, cluster, fused), tp=1, pp=2).plan
    assert base_plan is not None
    plan = base_plan.model_copy(update={"micro_batches": 2})
    h = 256  # per block q, k, v, o and the MLP with their biases (norms and lookup tables are not multiplied),
    multiplied = 4 * (4 * (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)) + 1024 * h  # and the tied head's table
    for workload, copies in ((fused, 0), (fused.model_copy(update={"eager": True}), 2),
                             (Workload(global_batch=8, seq_len=64, dtype=DType.FP32, eager=True), 0),
                             (fused.model_copy(update={"eager": True, "eager_16bit_weights": True}), 0)):
        sim = Simulator(model, cluster, workload)
        report = sim.simulate(plan)
        first, last = (report.stages[i].memory for i in (0, -1))
        base = Simulator(model, cluster, workload.model_copy(update={"eager": False, "eager_16bit_weights": False})
                         ).simulate(plan)
        extra_first = first.activations_bytes - base.stages[0].memory.activations_bytes
        extra_last = last.activations_bytes - base.stages[-1].memory.activations_bytes
        held = [sim.coster.multiplied_params(s) for s in plan.stages]
        assert sum(held) == multiplied
        assert extra_first == pytest.approx(copies * held[0] * report.stages[0].in_flight)
        assert extra_last == pytest.approx(copies * held[-1] * report.stages[-1].in_flight)


def test_a_recomputed_layers_weight_copies_are_held_once_not_per_micro_batch_in_flight() -> None:
    """With recomputation a checkpointed layer's backward keeps no copy of its weights (its forward saved nothing,
    its replay casts again), so only the layers that keep their activations hold copies per micro-batch in
    flight; the recomputed ones' copies count once."""
    from tagplan.cost.baselines import megatron_plan
    from tagplan.cost.simulator import Simulator
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model

    model = load_model("gpt?layers=4&hidden=256&heads=4&vocab=1024", seq_len=64)
    cluster = load_cluster("dgx-a100-80gb")
    eager = Workload(global_batch=8, seq_len=64, eager=True)
    sim = Simulator(model, cluster, eager)
    base_plan = megatron_plan(sim, tp=1, pp=2).plan
    assert base_plan is not None
    plan = base_plan.model_copy(update={"micro_batches": 2, "stages": tuple(
        s.model_copy(update={"recompute": True}) for s in base_plan.stages)})
    first = plan.stages[0]  # the embedding (kept) and two blocks (recomputed)
    h = 256
    block = 4 * (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h)
    assert sim.coster.multiplied_params(first, recomputed=True) == 2 * block
    assert sim.coster.multiplied_params(first, recomputed=False) == 0  # a lookup table is not multiplied
    report = sim.simulate(plan)
    fused = Simulator(model, cluster, eager.model_copy(update={"eager": False})).simulate(plan)
    extra = report.stages[0].memory.activations_bytes - fused.stages[0].memory.activations_bytes
    assert report.stages[0].in_flight > 1 and extra == pytest.approx(2 * 2 * block)  # once, not per micro-batch
    last = plan.stages[-1]  # two recomputed blocks and the head, whose tied table is multiplied every micro-batch
    assert sim.coster.multiplied_params(last, recomputed=False) == 1024 * h
