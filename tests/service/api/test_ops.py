"""Routes for operators (`service/api/ops.py`, `service/api/metrics.py`) and what the app serves besides."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import sqlalchemy
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from tagplan.search.problem import Objective
from tagplan.service.api.metrics import JobMetrics, ServiceMetrics
from tagplan.service.vocabulary import JobKind, JobStatus


def test_health_readiness_and_metrics(client: TestClient, keys: Any, api: Any, finished: dict[str, Any]) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200
    api.submit(client, keys.a)
    anonymous, tenant = client.get("/metrics").text, client.get("/metrics", headers=api.auth(keys.a)).text
    for text in (anonymous, tenant):  # how busy the tenants are is for admins only
        assert "tagplan_jobs" not in text and "tagplan_queue_depth" not in text and "duration" not in text
        assert 'tagplan_http_requests_total{code="202",route="/v1/plans"}' in text
    text = client.get("/metrics", headers=api.auth(keys.admin)).text
    assert '# TYPE tagplan_jobs gauge' in text
    assert 'tagplan_jobs{status="succeeded"}' in text and 'tagplan_jobs{status="queued"}' in text
    assert "tagplan_queue_depth " in text
    assert 'tagplan_http_requests_total{code="202",route="/v1/plans"}' in text
    assert 'tagplan_http_requests_total{code="200",route="/v1/jobs/{job_id}"}' in text
    count = next(line for line in text.splitlines() if line.startswith("tagplan_job_duration_seconds_count"))
    assert float(count.split()[1]) >= 1


def test_metrics_label_every_status_of_the_vocabulary() -> None:
    registry = CollectorRegistry()
    registry.register(JobMetrics(lambda: {"queued": 2}, lambda: (0.0, 0)))
    text = generate_latest(registry).decode()
    for status in JobStatus:
        assert f'tagplan_jobs{{status="{status}"}}' in text
    assert "tagplan_queue_depth 2.0" in text


def test_each_app_counts_in_a_registry_of_its_own() -> None:
    first, second = ServiceMetrics(), ServiceMetrics()
    first.add("/v1/plans", 202)
    assert b'tagplan_http_requests_total{code="202",route="/v1/plans"} 1.0' in first.exposition(admin=False)
    assert b"/v1/plans" not in second.exposition(admin=True)
    assert b"tagplan_jobs" not in first.exposition(admin=True)  # no job source given


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
    components = schema["components"]["schemas"]
    for path in ("/v1/plans", "/plan"):  # validated off the event loop (`jobs.plan_body`), documented as the model
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/PlanRequest"}
    plan_request = components["PlanRequest"]
    assert plan_request["examples"][0]["model"] == "gpt3-1.3b"
    assert set(plan_request["required"]) == {"model", "cluster"}
    # One vocabulary: the wire's enums are the service's and the planner's.
    assert components["Objective"]["enum"] == [o.value for o in Objective]
    assert components["JobStatus"]["enum"] == [s.value for s in JobStatus]
    assert components["JobKind"]["enum"] == [k.value for k in JobKind]
