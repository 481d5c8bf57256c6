"""The HTTP API in-process (`TestClient`) on a fresh database per test.

The `database_url` fixture (tests/service/conftest.py) gives a SQLite file, and with
`TAGPLAN_TEST_DATABASE_URL` set (e.g. `postgresql+psycopg://user@host/db`) a fresh PostgreSQL
schema as well, so every test here runs on both.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy
from fastapi.testclient import TestClient

from tagplan.service.app import create_app
from tagplan.service.db import make_engine
from tagplan.service.keys import create_key
from tagplan.service.settings import Settings
from tagplan.service.worker import run_worker

TINY = {"model": "gpt?layers=4&hidden=256&heads=4&vocab=100", "cluster": "p3.8xlarge",
        "workload": {"global_batch": 8, "seq_len": 64}, "max_evaluations": 20, "budget_s": 20}
FIXTURE_BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "cpu-quick"


@pytest.fixture
def make_settings(tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))

    def make(**overrides: Any) -> Settings:
        return Settings(database_url=database_url, home=tmp_path, **overrides)

    return make


@dataclass
class Keys:
    a: str
    b: str
    admin: str
    tenant_a: str


@pytest.fixture
def keys(make_settings: Any) -> Iterator[Keys]:
    engine = make_engine(make_settings().database_url)
    suffix = uuid.uuid4().hex[:8]
    yield Keys(a=create_key(engine, f"acme-{suffix}"), b=create_key(engine, f"globex-{suffix}"),
               admin=create_key(engine, f"ops-{suffix}", admin=True), tenant_a=f"acme-{suffix}")
    engine.dispose()


def client_for(settings: Settings) -> TestClient:
    return TestClient(create_app(settings))


@pytest.fixture
def client(make_settings: Any) -> Iterator[TestClient]:
    with client_for(make_settings()) as c:
        yield c


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def submit(client: TestClient, key: str, body: dict[str, Any] | None = None, path: str = "/v1/plans") -> Any:
    answer = client.post(path, json=body or TINY, headers=auth(key))
    assert answer.status_code == 202, answer.text
    return answer.json()


def run_until_finished(settings: Settings, job_id: str, client: TestClient, key: str) -> dict[str, Any]:
    """Run queued jobs in this process until `job_id` has finished (on a shared database, jobs
    left queued by earlier tests may come first)."""
    while True:
        job = client.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return dict(job)
        assert run_worker(settings, once=True, poll_s=0.05) == 1, f"no job to run, yet {job_id} is {job['status']}"


@pytest.fixture
def finished(make_settings: Any, client: TestClient, keys: Keys) -> dict[str, Any]:
    job = submit(client, keys.a)
    done = run_until_finished(make_settings(), job["id"], client, keys.a)
    assert done["status"] == "succeeded", done
    return done


# -- auth ------------------------------------------------------------------------------------------

def test_missing_or_bad_key_is_401(client: TestClient, keys: Keys) -> None:
    missing = client.get("/v1/jobs")
    assert missing.status_code == 401
    assert "Authorization: Bearer" in missing.json()["detail"]
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    bad = client.get("/v1/jobs", headers=auth("tp_not-a-key"))
    assert bad.status_code == 401 and "invalid" in bad.json()["detail"]
    assert client.get("/v1/jobs", headers={"X-API-Key": keys.a}).status_code == 200
    assert client.post("/v1/plans", json=TINY).status_code == 401


# -- jobs ------------------------------------------------------------------------------------------

def test_submit_list_get_cancel(client: TestClient, keys: Keys) -> None:
    jobs = [submit(client, keys.a) for _ in range(3)]
    first = jobs[0]
    assert first["status"] == "queued" and first["kind"] == "plan" and first["progress"] == 0.0
    assert set(first) == {"id", "kind", "status", "progress", "message", "error", "attempts", "created_at",
                          "started_at", "finished_at", "eta_s"}
    page = client.get("/v1/jobs", params={"limit": 2}, headers=auth(keys.a)).json()
    assert (page["total"], page["offset"], page["limit"], len(page["jobs"])) == (3, 0, 2, 2)
    rest = client.get("/v1/jobs", params={"offset": 2, "limit": 2}, headers=auth(keys.a)).json()
    assert [j["id"] for j in page["jobs"] + rest["jobs"]] == [j["id"] for j in reversed(jobs)]  # newest first
    assert client.get(f"/v1/jobs/{first['id']}", headers=auth(keys.a)).json()["id"] == first["id"]
    early = client.get(f"/v1/jobs/{first['id']}/result", headers=auth(keys.a))
    assert early.status_code == 409 and "job is queued" in early.json()["detail"]
    cancelled = client.delete(f"/v1/jobs/{first['id']}", headers=auth(keys.a))
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert "job is cancelled" in client.get(f"/v1/jobs/{first['id']}/result", headers=auth(keys.a)).json()["detail"]
    assert client.get("/v1/jobs", params={"limit": 1000}, headers=auth(keys.a)).status_code == 422


def test_plan_alias(client: TestClient, keys: Keys) -> None:
    assert submit(client, keys.a, path="/plan")["kind"] == "plan"


def test_worker_runs_the_job_and_the_result_is_served(client: TestClient, keys: Keys,
                                                      finished: dict[str, Any]) -> None:
    assert finished["progress"] == 1.0 and finished["finished_at"] is not None
    result = client.get(f"/v1/jobs/{finished['id']}/result", headers=auth(keys.a))
    assert result.status_code == 200, result.text
    body = result.json()
    assert {"best", "timeline"} <= set(body)
    assert body["best"]["plan"]["stages"]


def test_events_end_with_done(client: TestClient, keys: Keys, finished: dict[str, Any]) -> None:
    with client.stream("GET", f"/v1/jobs/{finished['id']}/events", headers=auth(keys.a)) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        text = "".join(stream.iter_text())
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    assert [e[0] for e in events] == ["event: progress", "event: done"]
    assert json.loads(events[-1][1].removeprefix("data: "))["status"] == "succeeded"


def test_wait_answers_with_the_result(make_settings: Any, client: TestClient, keys: Keys) -> None:
    stop = threading.Event()
    worker = threading.Thread(target=run_worker, args=(make_settings(),), kwargs={"stop": stop, "poll_s": 0.05})
    worker.start()
    try:
        answer = client.post("/v1/plans", params={"wait": 60}, json=TINY, headers=auth(keys.a))
    finally:
        stop.set()
        worker.join(timeout=60)
    assert answer.status_code == 200, answer.text
    assert "best" in answer.json()
    queued = client.post("/v1/plans", params={"wait": 0.2}, json=TINY, headers=auth(keys.a))
    assert queued.status_code == 202 and queued.json()["status"] == "queued"


def test_tenants_do_not_see_each_others_jobs(client: TestClient, keys: Keys, finished: dict[str, Any]) -> None:
    job_id = finished["id"]
    for method, path in [("GET", f"/v1/jobs/{job_id}"), ("GET", f"/v1/jobs/{job_id}/result"),
                         ("GET", f"/v1/jobs/{job_id}/events"), ("DELETE", f"/v1/jobs/{job_id}")]:
        answer = client.request(method, path, headers=auth(keys.b))
        assert answer.status_code == 404, (method, path, answer.text)
    assert client.get("/v1/jobs", headers=auth(keys.b)).json()["total"] == 0
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(keys.a)).status_code == 200


def test_unknown_job_is_404(client: TestClient, keys: Keys) -> None:
    for job_id in (uuid.uuid4().hex, "not-an-id", "%00"):
        assert client.get(f"/v1/jobs/{job_id}", headers=auth(keys.a)).status_code == 404


# -- validation and limits -------------------------------------------------------------------------

def test_bad_bodies_are_422_naming_the_field(client: TestClient, keys: Keys) -> None:
    negative = client.post("/v1/plans", json={**TINY, "budget_s": -1}, headers=auth(keys.a))
    assert negative.status_code == 422 and "body.budget_s" in negative.json()["detail"]
    typo = client.post("/v1/plans", json={**TINY, "max_evals": 3}, headers=auth(keys.a))
    assert typo.status_code == 422 and "max_evals" in typo.json()["detail"]
    json_headers = {**auth(keys.a), "Content-Type": "application/json"}
    broken = client.post("/v1/plans", content=b'{"model": ', headers=json_headers)
    assert broken.status_code == 422 and "JSON" in broken.json()["detail"]
    assert client.post("/v1/plans", json=[1, 2], headers=auth(keys.a)).status_code == 422


def test_unknown_model_is_422_naming_it(client: TestClient, keys: Keys) -> None:
    answer = client.post("/v1/plans", json={**TINY, "model": "gpt-17-nonesuch"}, headers=auth(keys.a))
    assert answer.status_code == 422
    assert "gpt-17-nonesuch" in answer.json()["detail"]
    assert client.get("/v1/jobs", headers=auth(keys.a)).json()["total"] == 0  # never became a job


def test_limits_are_422_naming_the_limit(make_settings: Any, keys: Keys) -> None:
    with client_for(make_settings(max_devices=4)) as client:
        devices = client.post("/v1/plans", json={**TINY, "cluster": "p3.8xlarge:nodes=2"}, headers=auth(keys.a))
        assert devices.status_code == 422, devices.text
        assert "4" in devices.json()["detail"] and "devices" in devices.json()["detail"]
        evaluations = client.post("/v1/plans", json={**TINY, "max_evaluations": 10**6}, headers=auth(keys.a))
        assert evaluations.status_code == 422
        assert "5000" in evaluations.json()["detail"]


def test_oversized_body_is_413(make_settings: Any, keys: Keys) -> None:
    with client_for(make_settings(max_body_bytes=1000)) as client:
        big = {**TINY, "model": "x" * 2000}
        answer = client.post("/v1/plans", json=big, headers=auth(keys.a))
        assert answer.status_code == 413 and "1000 bytes" in answer.json()["detail"]
        streamed = client.post("/v1/traces", content=iter([b"x" * 600, b"y" * 600]),
                               headers={**auth(keys.a), "Content-Type": "text/plain"})
        assert streamed.status_code == 413
        assert client.post("/v1/plans", json=TINY, headers=auth(keys.a)).status_code == 202


def test_rate_limit_is_429_with_retry_after(make_settings: Any, keys: Keys) -> None:
    with client_for(make_settings(rate_per_minute=3)) as client:
        for _ in range(3):
            submit(client, keys.a)
        limited = client.post("/v1/plans", json=TINY, headers=auth(keys.a))
        assert limited.status_code == 429
        assert int(limited.headers["Retry-After"]) >= 1
        assert "3 submissions per minute" in limited.json()["detail"]
        submit(client, keys.b)  # another tenant has its own bucket


# -- traces and training runs ----------------------------------------------------------------------

def _bundle() -> dict[str, Any]:
    manifest = json.loads((FIXTURE_BUNDLE / "manifest.json").read_text())
    lines = (FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:5]
    return {"manifest": manifest, "records": [json.loads(line) for line in lines]}


def _stored_traces(settings: Settings) -> list[Path]:
    root = settings.home / "traces"
    return sorted(p for p in root.glob("*/*") if p.is_dir()) if root.exists() else []


def test_upload_a_json_bundle_and_train_on_it(make_settings: Any, client: TestClient, keys: Keys) -> None:
    created = client.post("/v1/traces", json=_bundle(), headers=auth(keys.a))
    assert created.status_code == 201, created.text
    assert created.json()["records"] == 5
    [stored] = _stored_traces(make_settings())
    assert (stored / "manifest.json").is_file() and len((stored / "records.jsonl").read_text().splitlines()) == 5
    run = client.post("/v1/training-runs", json={"traces": [created.json()["id"]]}, headers=auth(keys.a))
    assert run.status_code == 202, run.text
    assert run.json()["kind"] == "train" and run.json()["status"] == "queued"


def test_upload_records_jsonl(client: TestClient, keys: Keys) -> None:
    text = "\n".join((FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:3]) + "\n"
    for content_type in ("application/x-ndjson", "text/plain"):
        created = client.post("/v1/traces", params={"name": "bench box", "device": "cpu-amd-epyc"},
                              content=text.encode(), headers={**auth(keys.a), "Content-Type": content_type})
        assert created.status_code == 201, created.text
        assert created.json()["records"] == 3
    unsupported = client.post("/v1/traces", content=b"<xml/>", headers={**auth(keys.a), "Content-Type": "text/xml"})
    assert unsupported.status_code == 415


def test_a_malformed_line_is_422_naming_it_and_nothing_is_stored(make_settings: Any, client: TestClient,
                                                                  keys: Keys) -> None:
    lines = (FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:2]
    bad = json.loads(lines[1]) | {"time_s": -1}
    text = "\n".join([lines[0], lines[1], json.dumps(bad), "{not json"]) + "\n"
    answer = client.post("/v1/traces", content=text.encode(), headers={**auth(keys.a), "Content-Type":
                                                                       "application/x-ndjson"})
    assert answer.status_code == 422
    assert "line 3" in answer.json()["detail"] and "time_s" in answer.json()["detail"]
    bundle = _bundle()
    bundle["records"][1]["record"] = "opp"
    answer = client.post("/v1/traces", json=bundle, headers=auth(keys.a))
    assert answer.status_code == 422 and "records[1]" in answer.json()["detail"]
    bundle = _bundle() | {"manifest": {"source": "x"}}
    answer = client.post("/v1/traces", json=bundle, headers=auth(keys.a))
    assert answer.status_code == 422 and "manifest" in answer.json()["detail"]
    overflow = json.dumps(json.loads(lines[0]) | {"time_s": 12345.5}).replace("12345.5", "1e999")  # infinity
    text_headers = {**auth(keys.a), "Content-Type": "text/plain"}
    answer = client.post("/v1/traces", content=overflow.encode(), headers=text_headers)
    assert answer.status_code == 422 and "line 1: time_s" in answer.json()["detail"], answer.text
    assert _stored_traces(make_settings()) == []


def test_training_on_another_tenants_trace_is_404(client: TestClient, keys: Keys) -> None:
    theirs = client.post("/v1/traces", json=_bundle(), headers=auth(keys.b)).json()["id"]
    answer = client.post("/v1/training-runs", json={"traces": [theirs]}, headers=auth(keys.a))
    assert answer.status_code == 404 and theirs in answer.json()["detail"]
    assert client.post("/v1/training-runs", json={"traces": []}, headers=auth(keys.a)).status_code == 422
    mine = client.post("/v1/traces", json=_bundle(), headers=auth(keys.a)).json()["id"]
    bad = client.post("/v1/training-runs", json={"traces": [mine], "calibration": {"nonsense": 1}},
                      headers=auth(keys.a))
    assert bad.status_code == 422 and "calibration" in bad.json()["detail"]


# -- models ----------------------------------------------------------------------------------------

def test_models_list_and_admin_only_activate(make_settings: Any, client: TestClient, keys: Keys,
                                             tmp_path: Path) -> None:
    from tagplan.training.registry import Registry

    listing = client.get("/v1/models", headers=auth(keys.a)).json()
    assert listing["active"] is None and listing["versions"] == []
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"weights")
    registry = Registry(make_settings().home / "registry")
    registry.register(checkpoint, {"metrics": {"mape": 0.1}})
    registry.register(checkpoint, {"metrics": {"mape": 0.05}})
    forbidden = client.post("/v1/models/v0002/activate", headers=auth(keys.a))
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["detail"]
    activated = client.post("/v1/models/v0002/activate", headers=auth(keys.admin))
    assert activated.status_code == 200, activated.text
    assert activated.json()["active"] == "v0002"
    versions = client.get("/v1/models", headers=auth(keys.a)).json()["versions"]
    assert [(v["version"], v["active"], v["card"]["metrics"]["mape"]) for v in versions] == [
        ("v0001", False, 0.1), ("v0002", True, 0.05)]
    assert client.post("/v1/models/v0099/activate", headers=auth(keys.admin)).status_code == 404


# -- operations and the web view -------------------------------------------------------------------

def test_health_readiness_and_metrics(client: TestClient, keys: Keys, finished: dict[str, Any]) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    submit(client, keys.a)
    text = client.get("/metrics").text
    assert '# TYPE tagplan_jobs gauge' in text
    assert 'tagplan_jobs{status="succeeded"}' in text and 'tagplan_jobs{status="queued"}' in text
    assert "tagplan_queue_depth " in text
    assert 'tagplan_http_requests_total{route="/v1/plans",code="202"}' in text
    assert 'tagplan_http_requests_total{route="/v1/jobs/{job_id}",code="200"}' in text
    count = next(line for line in text.splitlines() if line.startswith("tagplan_job_duration_seconds_count"))
    assert int(count.split()[1]) >= 1


def test_readiness_fails_without_a_database(client: TestClient, tmp_path: Path) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    unreachable = sqlalchemy.create_engine(f"sqlite:///{tmp_path / 'missing' / 'service.db'}")
    client.app.state.services = dataclasses.replace(services, engine=unreachable)  # type: ignore[attr-defined]
    answer = client.get("/readyz")
    assert answer.status_code == 503 and "database" in answer.json()["detail"]
    assert client.get("/healthz").status_code == 200


def test_web_view_and_openapi(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    schema = client.get("/openapi.json").json()
    assert {"/v1/plans", "/plan", "/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/result",
            "/v1/jobs/{job_id}/events", "/v1/traces", "/v1/training-runs", "/v1/models",
            "/v1/models/{version}/activate", "/healthz", "/readyz", "/metrics"} <= set(schema["paths"])
    plan_request = schema["components"]["schemas"]["PlanRequest"]
    assert plan_request["examples"][0]["model"] == "gpt3-1.3b"
