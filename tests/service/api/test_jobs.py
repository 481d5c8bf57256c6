"""Routes of plans and jobs (`service/api/jobs.py`), in-process (`TestClient`) on a fresh database per test.

The `database_url` fixture (tests/service/conftest.py) gives a SQLite file, and with
`TAGPLAN_TEST_DATABASE_URL` set (e.g. `postgresql+psycopg://user@host/db`) a fresh PostgreSQL
schema as well, so every test here runs on both.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tagplan.service.worker import run_worker

# -- auth ------------------------------------------------------------------------------------------


def test_missing_or_bad_key_is_401(client: TestClient, keys: Any, api: Any) -> None:
    missing = client.get("/v1/jobs")
    assert missing.status_code == 401
    assert "Authorization: Bearer" in missing.json()["detail"]
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    bad = client.get("/v1/jobs", headers=api.auth("tp_not-a-key"))
    assert bad.status_code == 401 and "invalid" in bad.json()["detail"]
    assert client.get("/v1/jobs", headers={"X-API-Key": keys.a}).status_code == 200
    assert client.post("/v1/plans", json=api.TINY).status_code == 401


# -- jobs ------------------------------------------------------------------------------------------


def test_submit_list_get_cancel(client: TestClient, keys: Any, api: Any) -> None:
    jobs = [api.submit(client, keys.a) for _ in range(3)]
    first = jobs[0]
    assert first["status"] == "queued" and first["kind"] == "plan" and first["progress"] == 0.0
    assert set(first) == {"id", "kind", "status", "progress", "message", "error", "attempts", "created_at",
                          "started_at", "finished_at", "eta_s"}
    page = client.get("/v1/jobs", params={"limit": 2}, headers=api.auth(keys.a)).json()
    assert (page["total"], page["offset"], page["limit"], len(page["jobs"])) == (3, 0, 2, 2)
    rest = client.get("/v1/jobs", params={"offset": 2, "limit": 2}, headers=api.auth(keys.a)).json()
    assert [j["id"] for j in page["jobs"] + rest["jobs"]] == [j["id"] for j in reversed(jobs)]  # newest first
    assert client.get(f"/v1/jobs/{first['id']}", headers=api.auth(keys.a)).json()["id"] == first["id"]
    early = client.get(f"/v1/jobs/{first['id']}/result", headers=api.auth(keys.a))
    assert early.status_code == 409 and "job is queued" in early.json()["detail"]
    cancelled = client.delete(f"/v1/jobs/{first['id']}", headers=api.auth(keys.a))
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    gone = client.get(f"/v1/jobs/{first['id']}/result", headers=api.auth(keys.a))
    assert "job is cancelled" in gone.json()["detail"]
    assert client.get("/v1/jobs", params={"limit": 1000}, headers=api.auth(keys.a)).status_code == 422


def test_plan_alias(client: TestClient, keys: Any, api: Any) -> None:
    assert api.submit(client, keys.a, path="/plan")["kind"] == "plan"


def test_the_stored_request_is_what_the_body_said(client: TestClient, keys: Any, api: Any,
                                                  make_settings: Any) -> None:
    from tagplan.service.db import make_engine
    from tagplan.service.store import JobStore

    body = {**api.TINY, "cluster": "name: lab\nnode_groups:\n  - {preset: p3.8xlarge, nodes: 1}\n",
            "objective": "memory"}
    job = api.submit(client, keys.a, body)
    settings = make_settings()
    stored = JobStore(make_engine(settings.database_url), settings)._get(job["id"])
    assert stored is not None
    assert stored.request == {**api.TINY, "objective": "memory",  # YAML text is read once, into an object
                              "cluster": {"name": "lab", "node_groups": [{"preset": "p3.8xlarge", "nodes": 1}]}}


def test_worker_runs_the_job_and_the_result_is_served(client: TestClient, keys: Any, api: Any,
                                                      finished: dict[str, Any]) -> None:
    assert finished["progress"] == 1.0 and finished["finished_at"] is not None
    result = client.get(f"/v1/jobs/{finished['id']}/result", headers=api.auth(keys.a))
    assert result.status_code == 200, result.text
    body = result.json()
    assert {"best", "timeline", "request", "cluster"} <= set(body)
    assert body["best"]["plan"]["stages"]
    assert body["request"]["budget_s"] == 20.0 and body["request"]["objective"] == "time"


def test_events_end_with_done(client: TestClient, keys: Any, api: Any, finished: dict[str, Any]) -> None:
    with client.stream("GET", f"/v1/jobs/{finished['id']}/events", headers=api.auth(keys.a)) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        text = "".join(stream.iter_text())
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    assert [e[0] for e in events] == ["event: progress", "event: done"]
    assert json.loads(events[-1][1].removeprefix("data: "))["status"] == "succeeded"


def test_an_open_event_stream_ends_when_its_key_is_revoked(client: TestClient, keys: Any, api: Any,
                                                           make_settings: Any, monkeypatch: Any) -> None:
    from tagplan.service.api import jobs
    from tagplan.service.db import make_engine
    from tagplan.service.keys import revoke_key

    monkeypatch.setattr(jobs, "KEY_RECHECK_S", 0.2)
    job = api.submit(client, keys.a)  # no worker: it stays queued, and its stream open
    engine = make_engine(make_settings().database_url)
    lines: list[str] = []
    with client.stream("GET", f"/v1/jobs/{job['id']}/events", headers=api.auth(keys.a)) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            lines.append(line)
            if line == "event: progress":  # the stream is open: now revoke the key it was opened with
                assert revoke_key(engine, keys.a)
            assert len(lines) < 50, lines  # a stream that outlived its key would only send pings
    engine.dispose()
    events = [line for line in lines if line.startswith("event: ")]
    assert events == ["event: progress", "event: error"]
    assert json.loads(lines[-1 if lines[-1] else -2].removeprefix("data: "))["detail"] == "invalid or revoked API key"


def test_wait_answers_with_the_result(make_settings: Any, client: TestClient, keys: Any, api: Any) -> None:
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(make_settings(),), kwargs={"stop": stop, "poll_s": 0.05})
    worker.start()
    try:
        answer = client.post("/v1/plans", params={"wait": 60}, json=api.TINY, headers=api.auth(keys.a))
    finally:
        stop.set()
        worker.join(timeout=60)
    assert answer.status_code == 200, answer.text
    assert "best" in answer.json()
    queued = client.post("/v1/plans", params={"wait": 0.2}, json=api.TINY, headers=api.auth(keys.a))
    assert queued.status_code == 202 and queued.json()["status"] == "queued"


def test_tenants_do_not_see_each_others_jobs(client: TestClient, keys: Any, api: Any,
                                             finished: dict[str, Any]) -> None:
    job_id = finished["id"]
    for method, path in [("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/result"),
                         ("GET", f"/v1/jobs/{job_id}/events"), ("DELETE", f"/v1/jobs/{job_id}")]:
        answer = client.request(method, path, headers=api.auth(keys.b))
        assert answer.status_code == 404, (method, path, answer.text)
    assert client.get("/v1/jobs", headers=api.auth(keys.b)).json()["total"] == 0
    assert client.get(f"/v1/jobs/{job_id}", headers=api.auth(keys.a)).status_code == 200


def test_unknown_job_is_404(client: TestClient, keys: Any, api: Any) -> None:
    for job_id in (uuid.uuid4().hex, "not-an-id", "%00"):
        assert client.get(f"/v1/jobs/{job_id}", headers=api.auth(keys.a)).status_code == 404


# -- validation and limits -------------------------------------------------------------------------


def test_bad_bodies_are_422_naming_the_field(client: TestClient, keys: Any, api: Any) -> None:
    negative = client.post("/v1/plans", json={**api.TINY, "budget_s": -1}, headers=api.auth(keys.a))
    assert negative.status_code == 422 and "body.budget_s" in negative.json()["detail"]
    typo = client.post("/v1/plans", json={**api.TINY, "max_evals": 3}, headers=api.auth(keys.a))
    assert typo.status_code == 422 and "max_evals" in typo.json()["detail"]
    json_headers = {**api.auth(keys.a), "Content-Type": "application/json"}
    broken = client.post("/v1/plans", content=b'{"model": ', headers=json_headers)
    assert broken.status_code == 422 and "JSON" in broken.json()["detail"]
    assert client.post("/v1/plans", json=[1, 2], headers=api.auth(keys.a)).status_code == 422


@pytest.mark.parametrize(("change", "field"), [
    ({"max_evaluations": 2.5}, "body.max_evaluations"),
    ({"max_evaluations": True}, "body.max_evaluations"),
    ({"budget_s": "30"}, "body.budget_s"),
    ({"workload": {"global_batch": 8.0}}, "body.workload.global_batch"),
    ({"seed": -1}, "body.seed"),
    ({"objective": "fastest"}, "body.objective"),
])
def test_numbers_are_strict(client: TestClient, keys: Any, api: Any, change: dict[str, Any], field: str) -> None:
    answer = client.post("/v1/plans", json={**api.TINY, **change}, headers=api.auth(keys.a))
    assert answer.status_code == 422 and field in answer.json()["detail"], answer.text


def test_unknown_model_is_422_naming_it(client: TestClient, keys: Any, api: Any) -> None:
    answer = client.post("/v1/plans", json={**api.TINY, "model": "gpt-17-nonesuch"}, headers=api.auth(keys.a))
    assert answer.status_code == 422
    assert "body.model" in answer.json()["detail"] and "gpt-17-nonesuch" in answer.json()["detail"]
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 0  # never became a job


@pytest.mark.parametrize(("change", "said"), [
    ({"model": {"seq_len": 16, "blocks": {}, "layers": []}}, "model"),
    ({"cluster": {"name": "lab", "node_groups": []}}, "node_groups"),
])
def test_an_inline_graph_or_cluster_that_does_not_parse_is_422_and_never_a_job(
        client: TestClient, keys: Any, api: Any, change: dict[str, Any], said: str) -> None:
    answer = client.post("/v1/plans", json={**api.TINY, **change}, headers=api.auth(keys.a))
    assert answer.status_code == 422 and said in answer.json()["detail"], answer.text
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 0


@pytest.mark.parametrize(("change", "field"), [
    ({"model": "/etc/passwd"}, "body.model"),
    ({"model": "graph.json"}, "body.model"),
    ({"model": "os:system"}, "body.model"),
    ({"cluster": "../cluster.yaml"}, "body.cluster"),
    ({"cluster": "p3.8xlarge:gpu=/tmp/gpu.yaml"}, "body.cluster"),
    ({"calibration": "/etc/calibration.json"}, "calibration"),
])
def test_files_are_refused(client: TestClient, keys: Any, api: Any, change: dict[str, Any], field: str) -> None:
    answer = client.post("/v1/plans", json={**api.TINY, **change}, headers=api.auth(keys.a))
    assert answer.status_code == 422 and field in answer.json()["detail"], answer.text
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 0


def test_errors_quote_at_most_80_characters_of_input(client: TestClient, keys: Any, api: Any) -> None:
    for change in ({"model": "gpt5-" + "x" * 1000}, {"cluster": "p3.8xlarge:nodes=" + "9" * 1000},
                   {"model": "hf:" + "A" * 1000 + "?num_hidden_layers=x"}, {"calibration": "v" * 150}):
        answer = client.post("/v1/plans", json={**api.TINY, **change}, headers=api.auth(keys.a))
        assert answer.status_code == 422, answer.text
        detail = answer.json()["detail"]
        assert "x" * 81 not in detail and "9" * 81 not in detail and "A" * 81 not in detail, detail
        assert "v" * 81 not in detail, detail


def test_errors_quote_at_most_80_characters_of_a_key_and_1000_in_all(client: TestClient, keys: Any,
                                                                      api: Any) -> None:
    answer = client.post("/v1/plans", json={**api.TINY, "workload": {"y" * 1_000_000: 1}}, headers=api.auth(keys.a))
    assert answer.status_code == 422 and len(answer.content) < 2000, len(answer.content)
    assert "body.workload." + "y" * 80 + "..." in answer.json()["detail"], answer.text
    many = {**api.TINY, **{f"k{i}" + "x" * 50_000: 1 for i in range(30)}}
    answer = client.post("/v1/plans", json=many, headers=api.auth(keys.a))
    assert answer.status_code == 422 and len(answer.content) < 2500, len(answer.content)
    assert len(answer.json()["detail"]) <= 1000 and "and 25 more" in answer.json()["detail"]
    cluster = {"name": "lab", "node_groups": [{"preset": "p3.8xlarge", "nodes": 10**4000}]}
    answer = client.post("/v1/plans", json={**api.TINY, "cluster": cluster}, headers=api.auth(keys.a))
    assert answer.status_code == 422, answer.text
    assert "0" * 81 not in answer.text and "4001 digits" in answer.json()["detail"], answer.text


@pytest.mark.parametrize("path", ["/v1/plans", "/v1/training-runs"])
def test_a_body_too_deep_to_parse_is_422_saying_so(client: TestClient, keys: Any, api: Any, path: str) -> None:
    deep = b'{"model": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    answer = client.post(path, content=deep, headers={**api.auth(keys.a), "Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"].startswith("body: not readable JSON: nested too deeply"), answer.text
    assert "at most 32 levels" in answer.json()["detail"]


def test_limits_are_422_naming_the_limit(make_settings: Any, keys: Any, api: Any) -> None:
    with api.client_for(make_settings(max_devices=4, max_layers=6)) as client:
        devices = client.post("/v1/plans", json={**api.TINY, "cluster": "p3.8xlarge:nodes=2"},
                              headers=api.auth(keys.a))
        assert devices.status_code == 422, devices.text
        assert "4" in devices.json()["detail"] and "devices" in devices.json()["detail"]
        evaluations = client.post("/v1/plans", json={**api.TINY, "max_evaluations": 10**6}, headers=api.auth(keys.a))
        assert evaluations.status_code == 422
        assert "5000" in evaluations.json()["detail"]
        layers = client.post("/v1/plans", json={**api.TINY, "model": "gpt?layers=7&hidden=64&heads=4&vocab=100"},
                             headers=api.auth(keys.a))
        assert layers.status_code == 422 and "layers" in layers.json()["detail"]
        hf = client.post("/v1/plans", json={**api.TINY, "model": "hf:LlamaConfig?num_hidden_layers=100000"},
                         headers=api.auth(keys.a))
        assert hf.status_code == 422 and "6" in hf.json()["detail"]
        assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 0


def test_the_job_list_shows_model_cluster_objective_and_predicted_time(client: TestClient, keys: Any, api: Any,
                                                                        finished: dict[str, Any]) -> None:
    inline = api.submit(client, keys.a, {**api.TINY, "objective": "memory",
                                         "cluster": {"name": "lab", "node_groups": [{"preset": "p3.8xlarge"}]}})
    page = client.get("/v1/jobs", headers=api.auth(keys.a)).json()
    rows = {j["id"]: j for j in page["jobs"]}
    done, queued = rows[finished["id"]], rows[inline["id"]]
    result = client.get(f"/v1/jobs/{finished['id']}/result", headers=api.auth(keys.a)).json()
    assert done["model"] == api.TINY["model"] and done["cluster"] == api.TINY["cluster"]
    assert done["objective"] == "time"  # the default when the request names none
    assert done["iteration_time_s"] == pytest.approx(result["best"]["report"]["iteration_time_s"])
    assert (queued["cluster"], queued["objective"], queued["iteration_time_s"]) == ("lab", "memory", None)
    op = {"name": "mm", "kind": "matmul", "flops": 1e6, "bytes_read": 1e3, "bytes_written": 1e3, "param_bytes": 1e3}
    graph = {"format": "tagplan-graph/1", "seq_len": 16, "dtype": "bf16",
             "blocks": {"b": {"kind": "block", "ops": [op]}}, "layers": [{"name": "l", "block": "b", "repeat": 2}]}
    named = api.submit(client, keys.a, {**api.TINY, "model": {**graph, "name": "wide"}})
    unnamed = api.submit(client, keys.a, {**api.TINY, "model": graph})
    rows = {j["id"]: j for j in client.get("/v1/jobs", headers=api.auth(keys.a)).json()["jobs"]}
    assert (rows[named["id"]]["model"], rows[unnamed["id"]]["model"]) == ("wide", "inline")  # read in the database
    # the list adds fields; every field of the job JSON is still there, with the same values
    single = client.get(f"/v1/jobs/{finished['id']}", headers=api.auth(keys.a)).json()
    assert {k: done[k] for k in single if k != "eta_s"} == {k: v for k, v in single.items() if k != "eta_s"}
    assert set(single) == {"id", "kind", "status", "progress", "message", "error", "attempts", "created_at",
                           "started_at", "finished_at", "eta_s"}


def test_a_plan_body_is_read_off_the_event_loop(client: TestClient, keys: Any, api: Any, monkeypatch: Any) -> None:
    """A 2 MB cluster YAML takes seconds to parse: on the event loop it stalled every tenant's requests (a hostile
    tenant's, 27 s per request). The body is validated in a worker thread, with the same 422s."""
    import asyncio

    from tagplan.service import requests

    on_loop: list[bool] = []
    parse = requests._cluster_yaml

    def cluster_yaml(text: str) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return parse(text)

    monkeypatch.setattr(requests, "_cluster_yaml", cluster_yaml)
    body = {**api.TINY, "cluster": "name: lab\nnode_groups:\n  - {preset: p3.8xlarge, nodes: 1}\n"}
    assert client.post("/v1/plans", json=body, headers=api.auth(keys.a)).status_code == 202
    assert on_loop == [False]
    bad = client.post("/v1/plans", json={**body, "budget_s": "soon"}, headers=api.auth(keys.a))
    assert bad.status_code == 422 and bad.json()["errors"][0]["loc"] == ["body", "budget_s"]


def test_a_zoo_model_past_its_learned_positions_is_refused_before_it_is_queued(client: TestClient, keys: Any,
                                                                              api: Any) -> None:
    body = {**api.TINY, "model": "gpt3-125m", "workload": {"global_batch": 8, "seq_len": 4096}}
    answer = client.post("/v1/plans", json=body, headers=api.auth(keys.a))
    assert answer.status_code == 422
    assert "workload.seq_len: gpt3-125m: seq_len=4096 exceeds its 2048 learned positions" in answer.json()["detail"]
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 0
