import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tagplan.frontends.families import TransformerShape
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.parametric import build_gpt
from tagplan.ir import Plan, Schedule, ShardStrategy, Stage, check_plan
from tagplan.ir.workload import DType


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    """Random valid plans: uneven layer splits, per-stage (dp, tp), uneven batch shares."""
    n_stages = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(1, 40), min_size=n_stages - 1, max_size=n_stages - 1, unique=True)))
    bounds = [0, *cuts, 41]
    stages, next_device = [], 0
    for i in range(n_stages):
        dp, tp = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
        devices = tuple(range(next_device, next_device + dp * tp))
        next_device += dp * tp
        shares = None
        if dp > 1 and draw(st.booleans()):
            weights = draw(st.lists(st.floats(0.1, 10.0), min_size=dp, max_size=dp))
            shares = tuple(w / sum(weights) for w in weights)
        sharding = draw(st.none() | st.dictionaries(st.sampled_from(["attn.q", "mlp.fc1"]),
                                                    st.sampled_from(list(ShardStrategy))))
        stages.append(Stage(layers=(bounds[i], bounds[i + 1]), devices=devices, dp=dp, tp=tp,
                            batch_shares=shares, recompute=draw(st.booleans()), zero=draw(st.integers(0, 3)),
                            sharding=sharding))
    return Plan(micro_batches=draw(st.integers(1, 64)),
                schedule=draw(st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B])), stages=tuple(stages))


@given(plans())
def test_plan_json_round_trip_is_exact(plan: Plan) -> None:
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text


def test_stage_rejects_mesh_that_does_not_match_devices() -> None:
    with pytest.raises(ValidationError, match=r"dp \* tp = 2 \* 2 = 4 but the stage has 3 devices"):
        Stage(layers=(0, 2), devices=(0, 1, 2), dp=2, tp=2)


@pytest.mark.parametrize(("shares", "message"), [
    ((0.5, 0.3), "sum to 1"),
    ((1.2, -0.2), "must all be > 0"),
    ((1.0,), "has 1 entries; dp is 2"),
])
def test_stage_rejects_bad_batch_shares(shares: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Stage(layers=(0, 2), devices=(0, 1), dp=2, batch_shares=shares)


def test_uneven_shares_and_replicas() -> None:
    stage = Stage(layers=(0, 3), devices=(4, 5, 6, 7, 8, 9), dp=3, tp=2, batch_shares=(0.5, 0.3, 0.2))
    assert stage.replica(1) == (6, 7)  # tp-fastest ordering
    assert stage.shares() == (0.5, 0.3, 0.2)
    assert Stage(layers=(0, 1), devices=(0, 1), dp=2).shares() == (0.5, 0.5)


def test_plan_rejects_gaps_and_reused_devices() -> None:
    with pytest.raises(ValidationError, match=r"stages\[1\].layers starts at 3 but stages\[0\] ends at 2"):
        Plan(stages=(Stage(layers=(0, 2), devices=(0,)), Stage(layers=(3, 5), devices=(1,))))
    with pytest.raises(ValidationError, match="device 0 is in stages 0 and 1"):
        Plan(stages=(Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 5), devices=(0,))))


def test_interleaved_schedule_reuses_device_groups_round_robin() -> None:
    groups = [(0, 1), (2, 3)]
    stages = tuple(Stage(layers=(i, i + 1), devices=groups[i % 2], tp=2) for i in range(4))
    plan = Plan(schedule=Schedule.INTERLEAVED_1F1B, micro_batches=4, stages=stages)
    assert plan.devices == (0, 1, 2, 3)
    swapped = (stages[3].model_copy(update={"layers": (2, 3)}), stages[2].model_copy(update={"layers": (3, 4)}))
    bad = (stages[0], stages[1], *swapped)
    with pytest.raises(ValidationError, match="round-robin"):
        Plan(schedule=Schedule.INTERLEAVED_1F1B, stages=bad)


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ValidationError, match="micro_batch"):
        Plan.model_validate({"micro_batch": 4, "stages": [{"layers": [0, 1], "devices": [0]}]})


def test_check_plan_against_model_and_cluster() -> None:
    model = build_gpt("tiny", TransformerShape(layers=4, hidden=64, heads=4, vocab=100), 16, DType.BF16)
    from tagplan.ir import Cluster, DeviceSpec, Node

    spec = DeviceSpec(name="X", peak_flops_bf16=1e12, peak_flops_fp16=1e12, peak_flops_fp32=1e11,
                      mem_bytes=10**9, mem_bandwidth_Bps=1e11)
    cluster = Cluster(name="c", nodes=(Node(name="n0", device=spec, gpus=2, fabric_bandwidth_Bps=1e10),))
    good = Plan(stages=(Stage(layers=(0, 3), devices=(0,)), Stage(layers=(3, 6), devices=(1,))))
    check_plan(good, model, cluster)
    with pytest.raises(ValueError, match=r"covers layers \[0, 5\) but model 'tiny' has 6 layers"):
        check_plan(Plan(stages=(Stage(layers=(0, 5), devices=(0,)),)), model, cluster)
    with pytest.raises(ValueError, match=r"devices \[2\] are not in cluster"):
        check_plan(Plan(stages=(Stage(layers=(0, 6), devices=(2,)),)), model, cluster)
    assert load_model("gpt?layers=2&hidden=64&heads=4&vocab=10", seq_len=8).layers[0].name == "embed"


def test_whole_samples_per_replica() -> None:
    from tagplan.ir.plan import check_whole_samples

    stage = Stage(layers=(0, 2), devices=(0, 1), dp=2, batch_samples=(3, 1))
    assert stage.replica_samples(4) == (3, 1)
    assert stage.shares() == (0.75, 0.25)
    with pytest.raises(ValueError, match=r"sum to 4, not the micro-batch size 6"):
        stage.replica_samples(6)
    even = Stage(layers=(0, 2), devices=(0, 1, 2), dp=3)
    assert even.replica_samples(6) == (2, 2, 2)
    with pytest.raises(ValueError, match=r"1.33, 1.33, 1.33 samples each"):
        even.replica_samples(4)
    for too_few in (0, 2):  # fewer samples than replicas: divisible (0) or not, no replica may get none
        with pytest.raises(ValueError, match=r"at least 1"):
            even.replica_samples(too_few)
    sharded = Stage(layers=(0, 2), devices=(0, 1, 2, 3), dp=2, tp=2, batch_shares=(0.5, 0.5))
    assert sharded.replica_samples(4) == (2, 2) == Stage(layers=(0, 2), devices=(0, 1), dp=2).replica_samples(4)
    plan = Plan(micro_batches=2, stages=(even,))
    with pytest.raises(ValueError, match=r"stages\[0\]: a micro-batch of 4 samples"):
        check_whole_samples(plan, 8)
    with pytest.raises(ValueError, match=r"micro_batches=2 does not divide the global batch 7"):
        check_whole_samples(plan, 7)
    check_whole_samples(plan, 12)
    with pytest.raises(ValueError, match=r"whole samples >= 1"):
        Stage(layers=(0, 2), devices=(0, 1), dp=2, batch_samples=(4, 0))
    with pytest.raises(ValueError, match=r"not both"):
        Stage(layers=(0, 2), devices=(0, 1), dp=2, batch_samples=(1, 1), batch_shares=(0.5, 0.5))
