"""Routes of measurements (`service/api/traces.py`): trace uploads and training runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tagplan.service.settings import Settings

FIXTURE_BUNDLE = Path(__file__).resolve().parents[2] / "fixtures" / "traces" / "cpu-quick"


def _bundle() -> dict[str, Any]:
    manifest = json.loads((FIXTURE_BUNDLE / "manifest.json").read_text())
    lines = (FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:5]
    return {"manifest": manifest, "records": [json.loads(line) for line in lines]}


def _stored_traces(settings: Settings) -> list[Path]:
    root = settings.home / "traces"
    return sorted(p for p in root.glob("*/*") if p.is_dir()) if root.exists() else []


def test_upload_a_json_bundle_and_train_on_it(make_settings: Any, client: TestClient, keys: Any, api: Any) -> None:
    from tagplan.service.db import make_engine
    from tagplan.service.store import JobStore

    created = client.post("/v1/traces", json=_bundle(), headers=api.auth(keys.a))
    assert created.status_code == 201, created.text
    assert created.json()["records"] == 5
    [stored] = _stored_traces(make_settings())
    assert (stored / "manifest.json").is_file() and len((stored / "records.jsonl").read_text().splitlines()) == 5
    run = client.post("/v1/training-runs", json={"traces": [created.json()["id"]]}, headers=api.auth(keys.a))
    assert run.status_code == 202, run.text
    assert run.json()["kind"] == "train" and run.json()["status"] == "queued"
    settings = make_settings()
    job = JobStore(make_engine(settings.database_url), settings)._get(run.json()["id"])
    assert job is not None and job.request == {"traces": [str(stored)]}  # a TrainRequest, read by the worker


def test_upload_records_jsonl(client: TestClient, keys: Any, api: Any) -> None:
    text = "\n".join((FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:3]) + "\n"
    for content_type in ("application/x-ndjson", "text/plain"):
        created = client.post("/v1/traces", params={"name": "bench box", "device": "cpu-amd-epyc"},
                              content=text.encode(), headers={**api.auth(keys.a), "Content-Type": content_type})
        assert created.status_code == 201, created.text
        assert created.json()["records"] == 3
    unsupported = client.post("/v1/traces", content=b"<xml/>",
                              headers={**api.auth(keys.a), "Content-Type": "text/xml"})
    assert unsupported.status_code == 415


def test_a_malformed_line_is_422_naming_it_and_nothing_is_stored(make_settings: Any, client: TestClient,
                                                                  keys: Any, api: Any) -> None:
    lines = (FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:2]
    bad = json.loads(lines[1]) | {"time_s": -1}
    text = "\n".join([lines[0], lines[1], json.dumps(bad), "{not json"]) + "\n"
    answer = client.post("/v1/traces", content=text.encode(),
                         headers={**api.auth(keys.a), "Content-Type": "application/x-ndjson"})
    assert answer.status_code == 422
    assert "line 3" in answer.json()["detail"] and "time_s" in answer.json()["detail"]
    bundle = _bundle()
    bundle["records"][1]["record"] = "opp"
    answer = client.post("/v1/traces", json=bundle, headers=api.auth(keys.a))
    assert answer.status_code == 422 and "records[1]" in answer.json()["detail"]
    bundle = _bundle() | {"manifest": {"source": "x"}}
    answer = client.post("/v1/traces", json=bundle, headers=api.auth(keys.a))
    assert answer.status_code == 422 and "manifest" in answer.json()["detail"]
    overflow = json.dumps(json.loads(lines[0]) | {"time_s": 12345.5}).replace("12345.5", "1e999")  # infinity
    text_headers = {**api.auth(keys.a), "Content-Type": "text/plain"}
    answer = client.post("/v1/traces", content=overflow.encode(), headers=text_headers)
    assert answer.status_code == 422 and "line 1: time_s" in answer.json()["detail"], answer.text
    assert _stored_traces(make_settings()) == []


def test_training_on_another_tenants_trace_is_404(client: TestClient, keys: Any, api: Any) -> None:
    theirs = client.post("/v1/traces", json=_bundle(), headers=api.auth(keys.b)).json()["id"]
    answer = client.post("/v1/training-runs", json={"traces": [theirs]}, headers=api.auth(keys.a))
    assert answer.status_code == 404 and theirs in answer.json()["detail"]
    assert client.post("/v1/training-runs", json={"traces": []}, headers=api.auth(keys.a)).status_code == 422
    mine = client.post("/v1/traces", json=_bundle(), headers=api.auth(keys.a)).json()["id"]
    for calibration in ({"nonsense": 1}, "/etc/calibration.json", "v0042"):  # no paths; no such version
        bad = client.post("/v1/training-runs", json={"traces": [mine], "calibration": calibration},
                          headers=api.auth(keys.a))
        assert bad.status_code == 422 and "calibration" in bad.json()["detail"], bad.text


def test_a_tenant_deletes_its_trace_once_no_training_run_reads_it(make_settings: Any, client: TestClient, keys: Any,
                                                                  api: Any) -> None:
    """Stored traces count against TAGPLAN_MAX_TRACES_PER_TENANT: without a delete a tenant at the limit was
    refused every later upload for good."""
    mine = client.post("/v1/traces", json=_bundle(), headers={**api.auth(keys.a), "Idempotency-Key": "k1"}).json()
    run = client.post("/v1/training-runs", json={"traces": [mine["id"]]}, headers=api.auth(keys.a)).json()
    busy = client.delete(f"/v1/traces/{mine['id']}", headers=api.auth(keys.a))
    assert busy.status_code == 409 and run["id"] in busy.json()["detail"]  # a queued run reads it
    assert client.delete(f"/v1/jobs/{run['id']}", headers=api.auth(keys.a)).status_code in (200, 202)
    assert client.delete(f"/v1/traces/{mine['id']}", headers=api.auth(keys.b)).status_code == 404  # not b's
    assert client.delete(f"/v1/traces/{mine['id']}", headers=api.auth(keys.a)).status_code == 204
    assert _stored_traces(make_settings()) == []  # the bundle is gone with it
    assert client.delete(f"/v1/traces/{mine['id']}", headers=api.auth(keys.a)).status_code == 404
    answer = client.delete("/v1/traces/not-an-id", headers=api.auth(keys.a))
    assert answer.status_code == 404 and "'not-an-id'" in answer.json()["detail"]  # refused before the store
    again = client.post("/v1/traces", json=_bundle(), headers={**api.auth(keys.a), "Idempotency-Key": "k1"})
    assert again.status_code == 201 and again.json()["id"] != mine["id"]  # the key no longer names the deleted one


def test_a_training_run_whose_trace_is_deleted_as_it_is_queued_is_refused_not_lost(client: TestClient, keys: Any,
                                                                                   api: Any, monkeypatch: Any) -> None:
    """The run reads its traces' paths, then is queued: a deletion landing in between (it sees no run yet) left a
    queued run on a deleted bundle. The run now checks its traces again once queued."""
    mine = client.post("/v1/traces", json=_bundle(), headers=api.auth(keys.a)).json()["id"]
    store = client.app.state.services.store  # type: ignore[attr-defined]
    looked_up = store.trace_records

    def then_deleted(tenant_id: int, ids: list[str]) -> Any:
        found = looked_up(tenant_id, ids)
        assert store.delete_trace(tenant_id, mine) is not None  # no run reads it yet
        return found

    monkeypatch.setattr(store, "trace_records", then_deleted)
    answer = client.post("/v1/training-runs", json={"traces": [mine]}, headers=api.auth(keys.a))
    assert answer.status_code == 404 and "were deleted as this training run was queued" in answer.json()["detail"]
    job_id = answer.json()["detail"].split("its job ")[1].split()[0]
    assert client.get(f"/v1/jobs/{job_id}", headers=api.auth(keys.a)).json()["status"] == "cancelled"


def test_a_retry_gets_its_training_run_back_after_its_trace_is_deleted(client: TestClient, keys: Any,
                                                                      api: Any) -> None:
    """The key belongs to the job it made: a retry is answered with it before the traces are looked up again."""
    mine = client.post("/v1/traces", json=_bundle(), headers=api.auth(keys.a)).json()["id"]
    headers = {**api.auth(keys.a), "Idempotency-Key": "run-1"}
    run = client.post("/v1/training-runs", json={"traces": [mine]}, headers=headers).json()
    assert client.delete(f"/v1/jobs/{run['id']}", headers=api.auth(keys.a)).status_code in (200, 202)
    assert client.delete(f"/v1/traces/{mine}", headers=api.auth(keys.a)).status_code == 204
    again = client.post("/v1/training-runs", json={"traces": [mine]}, headers=headers)
    assert again.status_code == 202 and again.json()["id"] == run["id"]
    assert again.headers["Idempotent-Replayed"] == "true"
    fresh = client.post("/v1/training-runs", json={"traces": [mine]}, headers=api.auth(keys.a))
    assert fresh.status_code == 404  # without the key it is a new request, on a trace that is gone


def test_a_training_run_over_the_records_limit_is_refused_before_it_is_queued(make_settings: Any, keys: Any,
                                                                             api: Any) -> None:
    client = api.client_for(make_settings(max_training_records=7))
    traces = [client.post("/v1/traces", json=_bundle(), headers=api.auth(keys.a)).json()["id"] for _ in range(2)]
    assert client.post("/v1/training-runs", json={"traces": traces[:1]}, headers=api.auth(keys.a)).status_code == 202
    answer = client.post("/v1/training-runs", json={"traces": traces}, headers=api.auth(keys.a))
    assert answer.status_code == 422
    assert "2 trace(s) of 10 records in all are over this service's limit of 7" in answer.json()["detail"]
    assert "TAGPLAN_MAX_TRAINING_RECORDS" in answer.json()["detail"]


def test_uploads_are_read_off_the_event_loop(client: TestClient, keys: Any, api: Any, monkeypatch: Any) -> None:
    """Checking a 2 MB upload's records takes seconds; on the event loop it stalled every tenant's requests."""
    import asyncio

    from tagplan.service.api import traces

    on_loop: list[bool] = []
    checked = traces._record

    def record(*args: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return checked(*args)

    monkeypatch.setattr(traces, "_record", record)
    text = "\n".join((FIXTURE_BUNDLE / "records.jsonl").read_text().splitlines()[:3]) + "\n"
    created = client.post("/v1/traces", params={"device": "cpu-amd-epyc"}, content=text.encode(),
                          headers={**api.auth(keys.a), "Content-Type": "application/x-ndjson"})
    assert created.status_code == 201 and client.post("/v1/traces", json=_bundle(),
                                                      headers=api.auth(keys.a)).status_code == 201
    assert on_loop == [False] * 8


# -- what no upload may turn into a 500 ------------------------------------------------------------

_ITERATION = {"record": "iteration", "model": "gpt?layers=2&hidden=64&heads=2&vocab=100", "cluster": "p3.8xlarge",
              "workload": {"global_batch": 8, "seq_len": 128}, "plan": {}, "measured_s": 0.1}


def _upload_lines(client: TestClient, key: str, api: Any, text: str) -> Any:
    return client.post("/v1/traces", params={"device": "v100"}, content=text.encode(),
                       headers={**api.auth(key), "Content-Type": "application/x-ndjson"})


def test_a_line_nested_too_deep_to_parse_is_422_naming_it(client: TestClient, keys: Any, api: Any) -> None:
    answer = _upload_lines(client, keys.a, api, '{"a":' * 1000 + "1" + "}" * 1000 + "\n")
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == "line 1: not readable JSON: nested too deeply (a record nests a few levels)"


def test_a_line_with_an_integer_of_5000_digits_is_422_naming_it(client: TestClient, keys: Any, api: Any) -> None:
    line = json.dumps(_ITERATION).replace('"measured_s": 0.1', '"repeats": ' + "9" * 5000)
    answer = _upload_lines(client, keys.a, api, line)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert detail.startswith("line 1: not readable JSON: ") and "4300 digits" in detail, detail


def test_an_iteration_beyond_the_workload_bounds_is_422_naming_the_field(client: TestClient, keys: Any,
                                                                        api: Any) -> None:
    huge_batch = {**_ITERATION, "workload": {"global_batch": 10**10, "seq_len": 128}}
    answer = _upload_lines(client, keys.a, api, json.dumps(huge_batch))
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"].startswith("line 1: workload: global_batch: "), answer.text
    assert "10000000000" in answer.json()["detail"]
    huge_sequence = {**_ITERATION, "workload": {"global_batch": 8, "seq_len": 10**12}}
    answer = client.post("/v1/traces", json={**_bundle(), "records": [huge_sequence]}, headers=api.auth(keys.a))
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"].startswith("records[0]: workload: seq_len: "), answer.text


def test_cluster_yaml_with_a_5000_digit_node_count_is_422_naming_the_line(client: TestClient, keys: Any,
                                                                          api: Any) -> None:
    cluster = "node_groups:\n- preset: p3.8xlarge\n  nodes: " + "9" * 5000 + "\n"
    answer = _upload_lines(client, keys.a, api, json.dumps({**_ITERATION, "cluster": cluster}))
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert detail.startswith("line 1: not valid cluster-file YAML: Exceeds the limit (4300 digits)"), detail
    assert "4300 digits" in detail and "9" * 81 not in detail


def test_a_record_field_nested_deeper_than_the_limit_is_422_and_nothing_is_stored(
        make_settings: Any, client: TestClient, keys: Any, api: Any) -> None:
    # 300 levels parse, but could not be written back (pydantic serialises at most 255 levels)
    deep: dict[str, Any] = {}
    for _ in range(300):
        deep = {"a": deep}
    answer = _upload_lines(client, keys.a, api, json.dumps({**_ITERATION, "plan": deep}))
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == "line 1: plan: nested deeper than 32 levels; at most 32 are accepted"
    assert _stored_traces(make_settings()) == []
