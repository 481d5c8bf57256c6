"""The job requests (`service/requests.py`): one pydantic model per kind, used by the API and by the
worker; size limits read off the parsed request, with nothing built."""

from __future__ import annotations

from typing import Any

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import ClusterSpec
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind
from tagplan.service.requests import (
    LimitError,
    PlanRequest,
    TrainRequest,
    calibration_of,
    check_limits,
    cluster_devices,
    model_layers,
    read_request,
)
from tagplan.service.settings import Settings

TINY_PLAN = {"model": "gpt?layers=2&hidden=64&heads=4&vocab=100", "cluster": "p3.8xlarge",
             "workload": {"global_batch": 8, "seq_len": 16}, "max_evaluations": 20}


def plan_request(data: Any) -> PlanRequest:
    return read_request(PlanRequest, data, "plan request")


def validate(data: Any, settings: Settings) -> PlanRequest:
    """What the API runs on a body (the worker runs it again on the stored request)."""
    request = plan_request(data)
    check_limits(request, settings)
    calibration_of(request.calibration, settings)
    return request


def test_a_request_is_parsed_once_and_stored_as_given() -> None:
    request = plan_request(TINY_PLAN)
    assert isinstance(request.model, ModelSpec) and request.model.kind is ModelSpecKind.FAMILY
    assert request.model.blocks == 2
    assert isinstance(request.cluster, ClusterSpec) and request.cluster.nodes == 1
    stored = request.to_request()
    assert stored == TINY_PLAN
    assert plan_request(stored) == request  # the worker reads back exactly what the API accepted


def limit_error(request: dict[str, Any], settings: Settings) -> LimitError:
    with pytest.raises(LimitError) as caught:
        validate(request, settings)
    return caught.value


def test_limits_name_the_limit(settings: Settings) -> None:
    small = settings.model_copy(update={"max_budget_s": 10.0, "max_evaluations": 50, "max_layers": 6, "max_devices": 8})
    cases = {"max_budget_s": {**TINY_PLAN, "budget_s": 11},
             "max_evaluations": {**TINY_PLAN, "max_evaluations": 51},
             "max_layers": {**TINY_PLAN, "model": "gpt?layers=7&hidden=64&heads=4&vocab=100"},
             "max_devices": {**TINY_PLAN, "cluster": "p3.8xlarge:nodes=3"}}
    for limit, request in cases.items():
        err = limit_error(request, small)
        assert (err.limit, err.status) == (limit, 422)
        assert str(getattr(small, limit)).rstrip("0").rstrip(".") in str(err)
        assert f"TAGPLAN_{limit.upper()}" in str(err)
    huge_spec = {**TINY_PLAN, "cluster": "p3.8xlarge:nodes=999999999"}  # refused before building a node
    assert limit_error(huge_spec, small).limit == "max_devices"
    t5 = {**TINY_PLAN, "model": "t5?layers=4&hidden=64&heads=4&vocab=100"}  # encoder and decoder blocks: 8
    assert limit_error(t5, small).limit == "max_layers"
    hf = {**TINY_PLAN, "model": "hf:LlamaConfig?num_hidden_layers=100000"}
    assert limit_error(hf, small).limit == "max_layers"
    graph = {"blocks": {"b": {"kind": "mlp", "ops": [{"kind": "matmul", "flops": 1}], "output_bytes": 1}},
             "layers": [{"block": "b", "repeat": 10**9}]}
    assert limit_error({**TINY_PLAN, "model": graph}, small).limit == "max_layers"
    groups = {"node_groups": [{"preset": "p3.8xlarge", "nodes": 10**9}, {"preset": "p3.8xlarge", "nodes": -10**9}]}
    assert limit_error({**TINY_PLAN, "cluster": groups}, small).limit == "max_devices"  # a negative hides nothing
    gpus = {"node_groups": [{"gpu": "A100-SXM4-80GB", "gpus_per_node": 9}]}
    assert limit_error({**TINY_PLAN, "cluster": gpus}, small).limit == "max_devices"
    validate(TINY_PLAN, small)


@pytest.mark.parametrize("model", [
    "hf:MptConfig?n_layers=100000&d_model=64&n_heads=2&vocab_size=100",  # a depth key the SPEC grammar did not know
    "hf:T5Config?num_layers=4",  # the decoder's depth defaults to the encoder's: 8 blocks
    "hf:LlavaConfig",  # no depth key given: the config's own text and vision stacks
])
def test_a_hugging_face_models_layers_are_read_off_its_config(settings: Settings, model: str) -> None:
    small = settings.model_copy(update={"max_layers": 6})
    assert limit_error({**TINY_PLAN, "model": model}, small).limit == "max_layers"


def test_tokens_a_model_fixes_itself_are_bounded(settings: Settings) -> None:
    small = settings.model_copy(update={"max_seq_len": 1000})
    vit = {**TINY_PLAN, "model": "vit?layers=2&hidden=64&heads=4&image=2000&patch=1"}  # 4,000,001 tokens
    err = limit_error(vit, small)
    assert err.limit == "max_seq_len" and "model: tokens per sample: 4000001" in str(err)
    graph = {"seq_len": 2 * 10**9, "blocks": {"b": {"kind": "mlp", "ops": [{"kind": "matmul", "flops": 1}],
                                                     "output_bytes": 1}}, "layers": [{"block": "b"}]}
    assert limit_error({**TINY_PLAN, "model": graph}, small).limit == "max_seq_len"


def test_numbers_an_inline_object_holds_must_be_finite_and_a_calibration_in_range() -> None:
    from tagplan.service.requests import check_inline

    graph = {"blocks": {"b": {"kind": "mlp", "ops": [{"kind": "matmul", "flops": float("inf")}], "output_bytes": 1}},
             "layers": [{"block": "b"}]}
    with pytest.raises(SpecError, match=r"graph's graph\.blocks\.b\.ops\[0\]\.flops is not a finite number"):
        plan_request({**TINY_PLAN, "model": graph})
    cluster = {"node_groups": [{"preset": "p3.8xlarge"}], "network": {"latency_us": float("nan")}}
    with pytest.raises(SpecError, match=r"cluster\.network\.latency_us is not a finite number"):
        plan_request({**TINY_PLAN, "cluster": cluster})
    for calibration, message in (({"memory_efficiency": {"*": 0}}, r"memory_efficiency must be in \(0, 1\]"),
                                 ({"micro_batch_overhead_s": {"*": -1e9}}, "micro_batch_overhead_s must be in"),
                                 ({"launch_overhead_s": float("inf")}, r"calibration\.launch_overhead_s: numbers must "
                                                                       "be finite")):
        with pytest.raises(SpecError, match=message):
            check_inline(plan_request({**TINY_PLAN, "calibration": calibration}))


def test_sizes_are_read_off_the_request() -> None:
    assert model_layers(plan_request({**TINY_PLAN, "model": "gpt3-1.3b"}).model) == 24
    assert model_layers({"layers": [{"block": "b", "repeat": 3}, {"block": "c"}, {"block": "d", "repeat": "x"}]}) == 5
    assert cluster_devices(plan_request({**TINY_PLAN, "cluster": "p3.8xlarge:nodes=3+g4dn.12xlarge"}).cluster) == 16
    assert cluster_devices({"node_groups": [{"preset": "dgx-a100-80gb", "nodes": 2}, {"preset": "nonesuch"}]}) == 17


@pytest.mark.parametrize(("change", "names"), [
    ({"model": "gpt5-huge"}, "gpt5-huge"),
    ({"model": "/etc/passwd"}, "file path"),
    ({"model": "my_models.py:Net"}, "file path"),
    ({"model": 7}, "model: int"),
    ({"cluster": "../cluster.yaml"}, "file path"),
    ({"cluster": "p3.8xlarge:gpu=/tmp/gpu.yaml"}, "file path"),
    ({"cluster": "p3.8xlarge:gpu=gpu.json"}, "file path"),
    ({"cluster": "p3.8xlarge:nodes=5_0000"}, "5_0000"),
    ({"cluster": 7}, "cluster: int"),
    ({"cluster": "name: lab\nnode_groups: &g []\nnetwork: *g\n"}, "aliases"),
    ({"cluster": "- just\n- a list\n"}, "mapping"),
    ({"workload": {"global_batch": 0}}, "global_batch"),
    ({"workload": {"seq_len": 16.0}}, "seq_len"),
    ({"workload": {"batch": 8}}, "batch"),
    ({"objective": "fastest"}, "fastest"),
    ({"budget_s": -1}, "budget_s"),
    ({"budget_s": float("nan")}, "budget_s"),
    ({"budget_s": "30"}, "budget_s"),
    ({"max_evaluations": 2.5}, "max_evaluations"),
    ({"seed": True}, "seed"),
    ({"calibration": "/etc/calibration.json"}, "calibration"),
    ({"calibration": {"nonsense": 1}}, "calibration"),
    ({"colour": "red"}, "colour"),
])
def test_bad_requests_are_spec_errors(settings: Settings, change: dict[str, Any], names: str) -> None:
    with pytest.raises(SpecError, match=names):
        validate({**TINY_PLAN, **change}, settings)


def test_inline_cluster_object_and_yaml_text() -> None:
    cluster = {"name": "lab", "node_groups": [{"preset": "p3.8xlarge", "nodes": 2}]}
    as_object = plan_request({**TINY_PLAN, "cluster": cluster})
    as_yaml = plan_request({**TINY_PLAN, "cluster": "name: lab\nnode_groups:\n  - {preset: p3.8xlarge, nodes: 2}\n"})
    assert as_object == as_yaml and as_yaml.cluster == cluster
    assert cluster_devices(as_yaml.cluster) == 8


def test_a_training_request_names_trace_bundles() -> None:
    request = read_request(TrainRequest, {"traces": ["/home/traces/1/abc"]}, "training request")
    assert request.traces == ["/home/traces/1/abc"] and request.calibration is None
    for bad, names in (({"traces": []}, "traces"), ({"traces": ["a"], "extra": 1}, "extra"),
                       ({"traces": [7]}, r"traces\.0")):
        with pytest.raises(SpecError, match=names):
            read_request(TrainRequest, bad, "training request")


def test_numbers_too_long_to_write_out_are_refused_by_their_size(settings: Settings) -> None:
    huge = 10**5000  # past Python's default int-to-text limit: quoting it whole would itself fail
    graph = {"blocks": {"b": {"kind": "mlp", "ops": [{"kind": "matmul", "flops": 1}], "output_bytes": 1}},
             "layers": [{"block": "b", "repeat": huge}]}
    err = limit_error({**TINY_PLAN, "model": graph}, settings)
    assert err.limit == "max_layers" and "a number of about 5001 digits is over" in str(err) and len(str(err)) < 300
    yaml_text = "node_groups:\n  - preset: p3.8xlarge\n    nodes: 0x" + "f" * 5000  # YAML reads hex of any length
    err = limit_error({**TINY_PLAN, "cluster": yaml_text}, settings)
    assert err.limit == "max_devices" and "a number of about 6022 digits is over" in str(err)
