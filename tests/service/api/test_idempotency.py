"""`Idempotency-Key` on the POSTs that create something (`api/jobs.py`, `api/traces.py`, `store.py`):
a retry gets the first answer back; the key with another body is a 422; keys are per tenant."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tagplan.service.db import make_engine
from tagplan.service.store import Idempotency, IdempotencyConflictError, JobStore

FIXTURE_BUNDLE = Path(__file__).resolve().parents[2] / "fixtures" / "traces" / "cpu-quick"


def _with_key(api: Any, key: str, idempotency_key: str) -> dict[str, str]:
    return {**api.auth(key), "Idempotency-Key": idempotency_key}


def test_a_retried_plan_is_one_job(client: TestClient, keys: Any, api: Any) -> None:
    headers = _with_key(api, keys.a, "retry-1")
    first = client.post("/v1/plans", json=api.TINY, headers=headers)
    assert first.status_code == 202 and "idempotent-replayed" not in first.headers
    reordered = dict(reversed(list(api.TINY.items())))  # the same request, keys in another order
    again = client.post("/plan", json=reordered, headers=headers)
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 1

    other = client.post("/v1/plans", json={**api.TINY, "seed": 7}, headers=headers)
    assert other.status_code == 422 and "retry-1" in other.json()["detail"]
    assert "different body" in other.json()["detail"] and first.json()["id"] in other.json()["detail"]
    # keys are the tenant's own: tenant b's "retry-1" is a new job
    theirs = client.post("/v1/plans", json=api.TINY, headers=_with_key(api, keys.b, "retry-1"))
    assert theirs.status_code == 202 and theirs.json()["id"] != first.json()["id"]
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 1


def test_bad_keys_are_422(client: TestClient, keys: Any, api: Any) -> None:
    for bad in ("x" * 201, "with space", "tab\there"):
        answer = client.post("/v1/plans", json=api.TINY, headers=_with_key(api, keys.a, bad))
        assert answer.status_code == 422, (bad, answer.text)
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 0


def test_a_retried_upload_and_training_run(client: TestClient, keys: Any, api: Any) -> None:
    manifest = json.loads((FIXTURE_BUNDLE / "manifest.json").read_text())
    records = [json.loads(line) for line in (FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:3]]
    headers = _with_key(api, keys.a, "upload-1")
    first = client.post("/v1/traces", json={"manifest": manifest, "records": records}, headers=headers)
    again = client.post("/v1/traces", json={"manifest": manifest, "records": records}, headers=headers)
    assert first.status_code == again.status_code == 201 and first.json() == again.json()
    assert again.headers["idempotent-replayed"] == "true"
    other = client.post("/v1/traces", json={"manifest": manifest, "records": records[:2]}, headers=headers)
    assert other.status_code == 422 and "upload-1" in other.json()["detail"]
    # the key of an upload cannot be reused for a training run either
    body = {"traces": [first.json()["id"]]}
    assert client.post("/v1/training-runs", json=body, headers=headers).status_code == 422
    run_headers = _with_key(api, keys.a, "run-1")
    run = client.post("/v1/training-runs", json=body, headers=run_headers)
    rerun = client.post("/v1/training-runs", json=body, headers=run_headers)
    assert run.status_code == rerun.status_code == 202 and run.json()["id"] == rerun.json()["id"]
    assert client.get("/v1/jobs", headers=api.auth(keys.a)).json()["total"] == 1


def test_the_store_keeps_keys_across_store_instances(make_settings: Any) -> None:
    from tagplan.service.keys import ensure_tenant

    settings = make_settings()
    engine = make_engine(settings.database_url)
    tenant = ensure_tenant(engine, "acme")
    once = Idempotency.of("k", "POST /v1/plans", {"a": 1})
    job, replayed = JobStore(engine, settings).submit_once(tenant, "plan", {"a": 1}, once)  # type: ignore[arg-type]
    engine.dispose()
    other = make_engine(settings.database_url)  # another process, or the API restarted
    again, replayed_now = JobStore(other, settings).submit_once(tenant, "plan", {"a": 1}, once)  # type: ignore[arg-type]
    assert (again.id, replayed, replayed_now) == (job.id, False, True)
    try:
        JobStore(other, settings).submit_once(tenant, "plan", {"a": 2},  # type: ignore[arg-type]
                                              Idempotency.of("k", "POST /v1/plans", {"a": 2}))
    except IdempotencyConflictError as err:
        assert "'k'" in str(err)
    else:
        raise AssertionError("a reused key with another body was accepted")
    other.dispose()
