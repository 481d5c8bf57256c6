"""A plan job (`service/jobs/plan.py`) in this process: progress, cancellation, defaults, one problem."""

from __future__ import annotations

from typing import Any

import pytest

from tagplan.errors import SpecError
from tagplan.ir.workload import LossKernel
from tagplan.search.problem import DEFAULT_BUDGET_S, DEFAULT_GLOBAL_BATCH, DEFAULT_MAX_EVALUATIONS, Objective
from tagplan.service.jobs import LimitError, run_job
from tagplan.service.jobs.plan import plan_problem
from tagplan.service.requests import PlanRequest, calibration_of, read_request
from tagplan.service.settings import Settings
from tagplan.service.vocabulary import JobKind

TINY_PLAN = {"model": "gpt?layers=2&hidden=64&heads=4&vocab=100", "cluster": "p3.8xlarge",
             "workload": {"global_batch": 8, "seq_len": 16}, "max_evaluations": 20}


def problem(data: dict[str, Any], settings: Settings) -> Any:
    request = read_request(PlanRequest, data, "plan request")
    return plan_problem(request, settings, calibration_of(request.calibration, settings))


def test_run_job_reports_progress_and_stops_when_cancelled(settings: Settings) -> None:
    seen: list[tuple[float, str]] = []

    class StopError(Exception):
        pass

    def progress(fraction: float, message: str) -> None:
        seen.append((fraction, message))
        if message.startswith("evaluations 3/"):
            raise StopError

    with pytest.raises(StopError):
        run_job(JobKind.PLAN, {**TINY_PLAN, "max_evaluations": 20}, settings, progress)
    assert seen[-1][1] == "evaluations 3/20" and 0 < seen[-1][0] < 1
    with pytest.raises(SpecError, match="kind"):
        run_job("sleep", {}, settings, progress)


def test_the_problem_takes_the_planner_s_defaults_capped_by_the_limits(settings: Settings) -> None:
    defaults = problem({"model": "gpt3-125m", "cluster": "p3.8xlarge"}, settings)
    assert (defaults.budget_s, defaults.max_evaluations, defaults.objective, defaults.seed) == (
        DEFAULT_BUDGET_S, DEFAULT_MAX_EVALUATIONS, Objective.TIME, 0)
    assert defaults.workload.global_batch == DEFAULT_GLOBAL_BATCH and defaults.workload.seq_len == 2048
    small = Settings(database_url=settings.database_url, home=settings.home, max_budget_s=5.0, max_evaluations=7)
    capped = problem({"model": "gpt3-125m", "cluster": "p3.8xlarge"}, small)
    assert (capped.budget_s, capped.max_evaluations) == (5.0, 7)


def test_the_workload_says_which_attention_kernel_the_runtime_has(settings: Settings) -> None:
    from tagplan.service.jobs.plan import echo

    assert problem(TINY_PLAN, settings).workload.fused_attention is None  # each GPU's own
    for value in (True, False, None):  # None: an explicit null, as if left out
        asked = {**TINY_PLAN, "workload": {**TINY_PLAN["workload"], "fused_attention": value}}
        planned = problem(asked, settings)
        assert planned.workload.fused_attention is value
        request = read_request(PlanRequest, asked, "plan request")
        assert echo(request, planned)["workload"]["fused_attention"] is value  # the result says what was costed
    with pytest.raises(SpecError, match="fused_attention"):
        problem({**TINY_PLAN, "workload": {"fused_attention": "flash"}}, settings)


def test_the_workload_says_which_loss_the_runtime_runs(settings: Settings) -> None:
    from tagplan.service.jobs.plan import echo

    assert problem(TINY_PLAN, settings).workload.loss is LossKernel.EAGER  # PyTorch's eager loss unless asked
    for value, costed in (("fused", LossKernel.FUSED), ("in-place", LossKernel.IN_PLACE), ("eager", LossKernel.EAGER),
                          (None, LossKernel.EAGER)):  # None: an explicit null, as if left out
        asked = {**TINY_PLAN, "workload": {**TINY_PLAN["workload"], "loss": value}}
        planned = problem(asked, settings)
        assert planned.workload.loss is costed
        request = read_request(PlanRequest, asked, "plan request")
        assert echo(request, planned)["workload"]["loss"] == costed.value  # the result says what was costed
    for bad in ("liger", True):
        with pytest.raises(SpecError, match="loss"):
            problem({**TINY_PLAN, "workload": {"loss": bad}}, settings)
    # the earlier boolean field, which jobs stored before it was renamed hold, still means what it meant
    for old, costed in ((True, LossKernel.FUSED), (False, LossKernel.EAGER), (None, LossKernel.EAGER)):
        assert problem({**TINY_PLAN, "workload": {"fused_loss": old}}, settings).workload.loss is costed
    assert problem({**TINY_PLAN, "workload": {"fused_loss": None, "loss": "fused"}}, settings).workload.loss is \
        LossKernel.FUSED  # null: as if left out
    with pytest.raises(SpecError, match="fused_loss=true beside loss='fused'"):
        problem({**TINY_PLAN, "workload": {"fused_loss": True, "loss": "fused"}}, settings)
    with pytest.raises(SpecError, match=r"workload\.fused_loss"):  # the field named, the value clipped as any
        problem({**TINY_PLAN, "workload": {"fused_loss": "yes" * 2000}}, settings)
    asked = {**TINY_PLAN, "workload": {**TINY_PLAN["workload"], "fused_loss": True}}
    assert "fused_loss" not in echo(read_request(PlanRequest, asked, "plan request"), problem(asked, settings))[
        "workload"]  # the result speaks only the current name


def test_the_workload_says_whether_the_runtime_overlaps_the_gradient_reduction(settings: Settings) -> None:
    assert problem(TINY_PLAN, settings).workload.grad_reduce_overlap is True
    after = {**TINY_PLAN, "workload": {**TINY_PLAN["workload"], "grad_reduce_overlap": False}}
    assert problem(after, settings).workload.grad_reduce_overlap is False
    with pytest.raises(SpecError, match="grad_reduce_overlap"):
        problem({**TINY_PLAN, "workload": {"grad_reduce_overlap": "no"}}, settings)


def test_the_workload_says_whether_the_runtime_overlaps_tensor_parallel_collectives(settings: Settings) -> None:
    assert problem(TINY_PLAN, settings).workload.tp_comm_overlap is False
    overlapped = {**TINY_PLAN, "workload": {**TINY_PLAN["workload"], "tp_comm_overlap": True}}
    assert problem(overlapped, settings).workload.tp_comm_overlap is True
    with pytest.raises(SpecError, match=r"workload\.tp_comm_overlap: Input should be a valid boolean"):
        problem({**TINY_PLAN, "workload": {"tp_comm_overlap": "yes"}}, settings)


def test_the_workload_says_whether_the_runtime_runs_eager_and_how_it_holds_its_weights(settings: Settings) -> None:
    from tagplan.service.jobs.plan import echo

    assert problem(TINY_PLAN, settings).workload.eager is False
    for runtime, sixteen in (("autocast", False), ("16bit-weights", True)):
        asked = {**TINY_PLAN, "workload": {**TINY_PLAN["workload"], "eager": runtime}}
        planned = problem(asked, settings)
        assert planned.workload.eager is True and planned.workload.eager_16bit_weights is sixteen
        assert echo(read_request(PlanRequest, asked, "plan request"), planned)["workload"]["eager"] == runtime
    with pytest.raises(SpecError, match=r"workload: .*eager='16bit-weights' with dtype='fp32': .*accepted: any "
                                        r"dtype but fp32"):
        problem({**TINY_PLAN, "workload": {"eager": "16bit-weights", "dtype": "fp32"}}, settings)
    with pytest.raises(SpecError, match=r"workload\.eager: Input should be 'autocast' or '16bit-weights'"):
        problem({**TINY_PLAN, "workload": {"eager": True}}, settings)


def test_inline_graph_and_cluster(settings: Settings) -> None:
    op = {"name": "mm", "kind": "matmul", "flops": 1e9, "bytes_read": 1e6, "bytes_written": 1e6, "param_bytes": 1e6}
    graph = {"seq_len": 16, "blocks": {"b": {"kind": "mlp", "ops": [op]}}, "layers": [{"block": "b", "repeat": 4}]}
    cluster = {"name": "lab", "node_groups": [{"preset": "p3.8xlarge", "nodes": 2}]}
    built = problem({**TINY_PLAN, "model": graph, "cluster": cluster}, settings)
    assert len(built.model.layers) == 4 and built.cluster.num_devices == 8 and built.workload.seq_len == 16
    with pytest.raises(SpecError, match="seq_len"):
        problem({**TINY_PLAN, "model": graph, "workload": {"seq_len": 32}}, settings)


def test_the_worker_checks_the_limits_again(settings: Settings) -> None:
    strict = Settings(database_url=settings.database_url, home=settings.home, max_devices=2)
    with pytest.raises(LimitError, match="TAGPLAN_MAX_DEVICES"):
        run_job(JobKind.PLAN, TINY_PLAN, strict, lambda _f, _m: None)


def test_the_result_says_which_export_formats_run_the_best_plan(settings: Settings) -> None:
    result = run_job(JobKind.PLAN, TINY_PLAN, settings, lambda fraction, message: None)
    assert set(result["exporters"]) == {"torch", "megatron", "deepspeed"}
    assert result["exporters"]["torch"] is None
    t5 = run_job(JobKind.PLAN, {**TINY_PLAN, "model": "t5?layers=1&hidden=64&heads=4&vocab=100"}, settings,
                 lambda fraction, message: None)
    assert "of family 't5'" in t5["exporters"]["torch"]  # the torch program builds no T5


def test_an_inline_graph_is_refused_by_the_torch_program_whatever_family_it_names(settings: Settings) -> None:
    from tagplan.frontends.model_spec import load_model

    dumped = load_model(TINY_PLAN["model"], seq_len=16).model_dump(mode="json")  # family "gpt", as a SPEC would give
    result = run_job(JobKind.PLAN, {**TINY_PLAN, "model": dumped}, settings, lambda fraction, message: None)
    assert "an inline graph has none" in result["exporters"]["torch"]
