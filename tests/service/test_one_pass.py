"""One `POST /v1/plans`, through the real app and a worker: the request is understood one way,
the model and the cluster are built once, in the worker and never in the API process, and the
best plan's timeline is simulated once (by the planner; the service draws it from `PlanResult`).

The worker runs in this process after the API answered, so every call is counted in the phase
that made it (the job process the worker forks inherits the counting wrappers and appends its
calls to the same file). The builders are counted where every path must pass whatever a module imported:
the `gpt` family's builder in `FAMILIES` and `cluster_spec._from_presets` (both looked up at
call time), `model_spec.build_model`, `cluster_spec.build_cluster` (which the worker calls
through their modules) and `Simulator.run` with task times recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tagplan.cost.simulator import Simulator
from tagplan.frontends import cluster_spec, model_spec, parametric
from tagplan.service.vocabulary import JobStatus
from tagplan.service.worker import run_worker

PLAN = {"model": "gpt?layers=2&hidden=64&heads=4&vocab=100", "cluster": "p3.8xlarge:nodes=2",
        "workload": {"global_batch": 8, "seq_len": 16}, "max_evaluations": 10, "budget_s": 20}


class Phases:
    """Calls counted by (phase, what): `api` while the request is answered, `worker` while the job runs
    (in a file, so that calls in a forked job process count too)."""

    def __init__(self, path: Path) -> None:
        self.now = "api"
        self.path = path

    def add(self, what: str) -> None:
        with self.path.open("a") as out:
            out.write(f"{self.now}\t{what}\n")

    def counting(self, what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.add(what)
            return fn(*args, **kwargs)

        return counted

    def of(self, phase: str) -> dict[str, int]:
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        calls = Counter(tuple(line.split("\t", 1)) for line in lines)
        return {what: n for (p, what), n in calls.items() if p == phase}


@pytest.fixture
def phases(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Phases:
    counted = Phases(tmp_path / "calls.tsv")
    monkeypatch.setitem(parametric.FAMILIES, "gpt", counted.counting("gpt graph built", parametric.FAMILIES["gpt"]))
    monkeypatch.setattr(model_spec, "build_model", counted.counting("build_model", model_spec.build_model))
    monkeypatch.setattr(cluster_spec, "build_cluster", counted.counting("build_cluster", cluster_spec.build_cluster))
    monkeypatch.setattr(cluster_spec, "_from_presets", counted.counting("preset nodes built",
                                                                        cluster_spec._from_presets))
    monkeypatch.setattr(Simulator, "__init__", counted.counting("Simulator()", Simulator.__init__))
    run = Simulator.run

    def recorded_run(self: Simulator, plan: Any, *, record_tasks: bool = True) -> Any:
        if record_tasks:  # `simulate` (the search's) records no task times; a timeline needs them
            counted.add("timeline simulated")
        return run(self, plan, record_tasks=record_tasks)

    monkeypatch.setattr(Simulator, "run", recorded_run)
    return counted


def test_one_post_builds_once_in_the_worker_and_simulates_the_timeline_once(
        phases: Phases, make_settings: Any, keys: Any, api: Any) -> None:
    settings = make_settings()
    with api.client_for(settings) as client:
        job = api.submit(client, keys.a, PLAN)
        assert phases.of("api") == {}, "the API process built or simulated something"
        phases.now = "worker"
        assert run_worker(settings, once=True, poll_s=0.05) == 1
        phases.now = "api"
        done = client.get(f"/v1/jobs/{job['id']}", headers=api.auth(keys.a)).json()
        assert done["status"] == JobStatus.SUCCEEDED, done
        result = client.get(f"/v1/jobs/{job['id']}/result", headers=api.auth(keys.a)).json()
    assert phases.of("api") == {}
    worker = phases.of("worker")
    once = ("gpt graph built", "build_model", "preset nodes built", "build_cluster", "timeline simulated")
    assert {k: worker.get(k) for k in once} == dict.fromkeys(once, 1), worker
    assert worker["Simulator()"] >= 1  # the planner's (a GNN prior may make its own for features)
    assert result["timeline"]["traceEvents"] and result["cluster"]["devices"]
    assert result["request"]["model"] == PLAN["model"] and result["request"]["cluster"] == PLAN["cluster"]


def test_a_refused_request_builds_nothing(phases: Phases, make_settings: Any, keys: Any, api: Any) -> None:
    with api.client_for(make_settings(max_devices=4, max_layers=1)) as client:
        for change in ({"cluster": "p3.8xlarge:nodes=999999999"}, {"model": "gpt3-175b"}, {"model": "nonesuch"},
                       {"model": "hf:LlamaConfig?num_hidden_layers=4"}):
            answer = client.post("/v1/plans", json={**PLAN, **change}, headers=api.auth(keys.a))
            assert answer.status_code == 422, answer.text
    assert phases.of("api") == {}
