"""The service tried as a hostile tenant would (issue 17), against a real HTTP server on loopback,
real worker processes and a real database: one test per hole, written as the attack."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tagplan.cli import main
from tagplan.service.app import create_app
from tagplan.service.jobs import run_job
from tagplan.service.keys import authenticate, create_key, ensure_tenant
from tagplan.service.requests import PlanRequest, read_request
from tagplan.service.settings import Settings
from tagplan.service.store import JobStore
from tagplan.service.vocabulary import TERMINAL, JobKind, JobStatus

TINY = {"model": "gpt?layers=2&hidden=64&heads=4&vocab=100", "cluster": "p3.8xlarge",
        "workload": {"global_batch": 8, "seq_len": 16}, "max_evaluations": 20, "budget_s": 60.0, "seed": 1}
BUNDLE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "cpu-quick"
SECRET = "hunter2-do-not-leak"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Live:
    """The app served by uvicorn on loopback in a thread of this process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.url = f"http://127.0.0.1:{_free_port()}"
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=int(self.url.rsplit(":", 1)[1]),
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Live:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def post(self, path: str, key: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=30,
                          **kwargs)

    def get(self, path: str, key: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers=headers, timeout=30)

    def wait(self, key: str, job_id: str, until: Any = None, timeout_s: float = 180.0) -> dict[str, Any]:
        until = until or (lambda job: job["status"] in {s.value for s in TERMINAL})
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get(f"/v1/jobs/{job_id}", key).json()
            if until(job):
                return dict(job)
            assert time.monotonic() < deadline, f"job {job_id} still {job['status']}: {job}"
            time.sleep(0.05)


@pytest.fixture
def home(settings: Settings) -> Path:
    return settings.home


@pytest.fixture
def tenants(settings: Settings) -> dict[str, str]:
    from tagplan.service.db import make_engine

    engine = make_engine(settings.database_url)
    keys = {"a": create_key(engine, "mallory"), "b": create_key(engine, "bob"),
            "admin": create_key(engine, "ops", admin=True)}
    engine.dispose()
    return keys


# -- 1. files under the home through `calibration` -------------------------------------------------


def test_calibration_cannot_read_the_local_key(settings: Settings, tenants: dict[str, str]) -> None:
    (settings.home / "local.key").write_text(SECRET + "\n")
    with Live(settings) as live:
        for choice in (str(settings.home / "local.key"), "../local.key", "local.key", "/etc/passwd"):
            answer = live.post("/v1/plans", tenants["a"], json={**TINY, "calibration": choice})
            assert answer.status_code == 422, answer.text
            assert SECRET not in answer.text and "calibration" in answer.json()["detail"]


# -- 2. a trace naming a file ----------------------------------------------------------------------


def _iteration(**change: Any) -> dict[str, Any]:
    line = next(line for line in (BUNDLE / "records.jsonl").read_text().splitlines() if '"iteration"' in line)
    return {**json.loads(line), **change}


def test_a_trace_naming_a_file_is_refused_on_upload_and_by_the_worker(settings: Settings,
                                                                       tenants: dict[str, str]) -> None:
    secrets = settings.home / "secrets.yaml"
    secrets.write_text(f"db_password_key: {SECRET}\naws_secret_key_name: 1\n")
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    attacks = [{"model": str(secrets)}, {"cluster": str(secrets)}, {"model": "/root/.ssh/id_rsa"},
               {"cluster": "/root/.ssh/id_rsa"}, {"model": "evil.py:Net"}, {"model": "os:path"},
               {"cluster": "p3.8xlarge:gpu=" + str(secrets)}, {"model": "x" * 5000}]
    with Live(settings) as live:
        for change in attacks:
            bundle = {"manifest": manifest, "records": [_iteration(**change)]}
            answer = live.post("/v1/traces", tenants["a"], json=bundle)
            assert answer.status_code == 422, (change, answer.text)
            text = answer.text
            assert SECRET not in text and "db_password_key" not in text and "aws_secret" not in text, text
            assert "x" * 200 not in text and len(answer.json()["detail"]) < 1100
        assert live.post("/v1/traces", tenants["a"], json={"manifest": manifest,
                                                           "records": [_iteration()]}).status_code == 201
    assert len(list((settings.home / "traces").glob("*/*"))) == 1  # only the clean bundle was stored
    # A bundle written on disk before the check (an older service) is checked again by the worker.
    planted = settings.home / "traces" / "7" / "planted"
    planted.mkdir(parents=True)
    (planted / "manifest.json").write_text((BUNDLE / "manifest.json").read_text())
    (planted / "records.jsonl").write_text(json.dumps(_iteration(cluster=str(secrets))) + "\n")
    with pytest.raises(Exception, match="file") as refused:
        run_job(JobKind.TRAIN, {"traces": [str(planted)]}, settings, lambda _f, _m: None, tenant_id=7)
    assert SECRET not in str(refused.value) and "db_password_key" not in str(refused.value)


# -- 3. a tenant's training run changing another tenant's plans -------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_tenant_s_training_run_changes_no_other_tenant_s_plan(settings: Settings, tenants: dict[str, str],
                                                                workers: Any) -> None:
    workers.start()
    manifest = json.loads((BUNDLE / "manifest.json").read_text())
    records = [json.loads(line) for line in (BUNDLE / "records.jsonl").read_text().splitlines()]
    with Live(settings) as live:
        before = live.post("/v1/plans", tenants["b"], json=TINY).json()
        assert live.wait(tenants["b"], before["id"])["status"] == JobStatus.SUCCEEDED, workers.logs()
        before_result = live.get(f"/v1/jobs/{before['id']}/result", tenants["b"]).json()
        trace = live.post("/v1/traces", tenants["a"], json={"manifest": manifest, "records": records})
        assert trace.status_code == 201, trace.text
        run = live.post("/v1/training-runs", tenants["a"], json={"traces": [trace.json()["id"]]}).json()
        trained = live.wait(tenants["a"], run["id"], timeout_s=600)
        assert trained["status"] == JobStatus.SUCCEEDED, (trained, workers.logs())
        card = live.get(f"/v1/jobs/{run['id']}/result", tenants["a"]).json()
        assert card["registry"].startswith("tenant ")
        models_b = live.get("/v1/models", tenants["b"]).json()
        assert models_b["active"] is None and models_b["versions"] == []  # the service-wide registry: untouched
        after = live.post("/v1/plans", tenants["b"], json=TINY).json()
        assert live.wait(tenants["b"], after["id"])["status"] == JobStatus.SUCCEEDED
        after_result = live.get(f"/v1/jobs/{after['id']}/result", tenants["b"]).json()
        assert before_result["gnn"] == after_result["gnn"] == "packaged"
        assert before_result["best"] == after_result["best"] and before_result["pareto"] == after_result["pareto"]
        mine = live.post("/v1/plans", tenants["a"], json=TINY).json()
        assert live.wait(tenants["a"], mine["id"])["status"] == JobStatus.SUCCEEDED
        expected = f"tenant:{card['version']}" if card.get("activated") else "packaged"
        assert live.get(f"/v1/jobs/{mine['id']}/result", tenants["a"]).json()["gnn"] == expected


# -- 4. one request holding a worker: bounds, cancel, wall clock, memory ---------------------------


def test_huge_workloads_are_refused_before_any_job(settings: Settings, tenants: dict[str, str]) -> None:
    with Live(settings) as live:
        for workload, variable in (({"global_batch": 10**9}, "TAGPLAN_MAX_GLOBAL_BATCH"),
                                   ({"global_batch": 999_999_999}, "TAGPLAN_MAX_GLOBAL_BATCH"),
                                   ({"seq_len": 10**8}, "TAGPLAN_MAX_SEQ_LEN")):
            answer = live.post("/v1/plans", tenants["a"], json={**TINY, "workload": workload})
            assert answer.status_code == 422 and variable in answer.json()["detail"], answer.text
        assert live.get("/v1/jobs", tenants["a"]).json()["total"] == 0


def _unbounded(settings: Settings, **limits: Any) -> Settings:
    """Settings that let a 1e9 global batch through to a worker (what the API refuses by default)."""
    return settings.model_copy(update={"max_global_batch": 10**9, "lease_s": 6.0, "heartbeat_s": 2.0, **limits})


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_global_batch_of_1e9_is_cancelled_within_2_s(settings: Settings, tenants: dict[str, str],
                                                       workers: Any) -> None:
    loose = _unbounded(settings)
    worker = workers.start(loose)
    with Live(loose) as live:
        job = live.post("/v1/plans", tenants["a"], json={**TINY, "workload": {"global_batch": 10**9}}).json()
        live.wait(tenants["a"], job["id"], lambda j: j["status"] == JobStatus.RUNNING)
        time.sleep(2.0)  # well inside the search's set-up by now
        (job_pid,) = _children(worker.pid)
        asked = time.monotonic()
        assert httpx.delete(f"{live.url}/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {tenants['a']}"},
                            timeout=30).status_code == 202
        done = live.wait(tenants["a"], job["id"], timeout_s=30)
        took_s = time.monotonic() - asked
    assert done["status"] == JobStatus.CANCELLED, (done, workers.logs())
    assert took_s < 2.0, (f"cancelling took {took_s:.2f} s", workers.logs())
    reaped_by = time.monotonic() + 10.0
    while Path(f"/proc/{job_pid}").exists() and time.monotonic() < reaped_by:
        time.sleep(0.05)
    assert not Path(f"/proc/{job_pid}").exists()  # the job process was stopped and reaped, not left running
    assert worker.poll() is None  # the worker lives on; only its job process was stopped


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_worker_caps_a_job_s_wall_clock_and_memory(settings: Settings, store: JobStore, workers: Any,
                                                        wait_for: Any) -> None:
    tenant = ensure_tenant(store.engine, "mallory")
    request = {**TINY, "workload": {"global_batch": 10**9}}
    timed = _unbounded(settings).model_copy(update={"job_timeout_s": 3.0})
    workers.start(timed)
    job = store.submit(tenant, JobKind.PLAN, request)
    view = wait_for(store, tenant, job.id, timeout_s=60)
    assert view is not None and view.status == JobStatus.FAILED and view.attempts == 1, workers.logs()
    assert view.error is not None and "TAGPLAN_JOB_TIMEOUT_S" in view.error
    workers.stop()
    small = _unbounded(settings).model_copy(update={"job_memory_bytes": 64 * 2**20})  # below any job's needs
    workers.start(small)
    job = store.submit(tenant, JobKind.PLAN, request)
    view = wait_for(store, tenant, job.id, timeout_s=60)
    assert view is not None and view.status == JobStatus.FAILED, workers.logs()
    assert view.error is not None and "TAGPLAN_JOB_MEMORY_BYTES" in view.error


# -- 5. heavy work in the API process --------------------------------------------------------------

ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(8))


def test_the_alias_bomb_and_oversized_specs_are_refused_quickly(settings: Settings, tenants: dict[str, str]) -> None:
    started = time.perf_counter()
    with pytest.raises(Exception, match="aliases"):
        read_request(PlanRequest, {**TINY, "cluster": ALIAS_BOMB}, "plan")
    assert time.perf_counter() - started < 0.1
    deep = "name: x\nnode_groups:\n" + "".join("  " * i + "- \n" for i in range(1, 60))
    attacks = [({"cluster": ALIAS_BOMB}, "aliases"), ({"cluster": deep}, "nested"),
               ({"cluster": "p3.8xlarge:nodes=5_0000"}, "nodes"),
               ({"cluster": {"name": "x", "node_groups": [{"gpu": "V100", "gpus_per_node": 10_000_000}]}},
                "TAGPLAN_MAX_DEVICES"),
               ({"model": "hf:LlamaConfig?num_hidden_layers=500_000"}, "num_hidden_layers"),
               ({"model": "hf:LlamaConfig?num_hidden_layers=500000"}, "TAGPLAN_MAX_LAYERS"),
               ({"model": "gpt3-1.3b" + "?" * 300}, ""), ({"cluster": "p3.8xlarge" + "a" * 20_000}, "characters")]
    with Live(settings) as live:
        for change, expected in attacks:
            started = time.perf_counter()
            answer = live.post("/v1/plans", tenants["a"], json={**TINY, **change})
            assert answer.status_code == 422 and expected in answer.json()["detail"], (change, answer.text)
            assert time.perf_counter() - started < 5.0
            assert "a" * 200 not in answer.text and "?" * 200 not in answer.text


# -- 6. lifecycle: SIGTERM and kill -9 of `tagplan serve` ------------------------------------------


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_stopping_serve_leaves_no_worker_process(tmp_path: Path, how: str) -> None:
    port = _free_port()
    env = {**os.environ, "TAGPLAN_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TAGPLAN_DATABASE_URL", None)
    serve = subprocess.Popen([sys.executable, "-m", "tagplan.cli", "serve", "--workers", "2", "--port", str(port)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(workers := _children(serve.pid)) < 2:
            assert serve.poll() is None and time.monotonic() < deadline, "serve did not start its workers"
            time.sleep(0.2)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        os.kill(serve.pid, getattr(__import__("signal"), how))
        serve.wait(30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in workers):
            assert time.monotonic() < deadline, f"worker processes left after {how}: {workers}"
            time.sleep(0.2)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


# -- 8. database outage, metrics, revocation, file modes, numbers --------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_database_outage_answers_503_and_loses_nothing(settings: Settings, tenants: dict[str, str],
                                                         workers: Any) -> None:
    quick = settings.model_copy(update={"db_timeout_s": 0.5})
    accepted: list[str] = []
    with Live(quick) as live:
        for seed in range(3):
            accepted.append(live.post("/v1/plans", tenants["a"], json={**TINY, "seed": seed}).json()["id"])
        path = settings.database_url.removeprefix("sqlite:///")
        outage = sqlite3.connect(path, timeout=0.1, isolation_level=None)
        outage.execute("BEGIN EXCLUSIVE")  # the database takes no writes: as good as down for a submission
        try:
            refused = live.post("/v1/plans", tenants["a"], json={**TINY, "seed": 99})
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"].isdigit() and "retry" in refused.json()["detail"]
        finally:
            outage.execute("ROLLBACK")
            outage.close()
        retried = live.post("/v1/plans", tenants["a"], json={**TINY, "seed": 99})
        assert retried.status_code == 202
        accepted.append(retried.json()["id"])
        workers.start()
        for job_id in accepted:
            assert live.wait(tenants["a"], job_id)["status"] == JobStatus.SUCCEEDED, workers.logs()
        assert live.get("/v1/jobs", tenants["a"]).json()["total"] == 4


def test_a_revoked_key_is_refused(settings: Settings, tenants: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tagplan.service.db import make_engine

    monkeypatch.setenv("TAGPLAN_DATABASE_URL", settings.database_url)
    engine = make_engine(settings.database_url)
    assert authenticate(engine, tenants["b"]) is not None
    assert main(["admin", "revoke-key", "--key", tenants["b"]]) == 0
    assert main(["admin", "revoke-key", "--key", tenants["b"]]) == 2  # already revoked
    with Live(settings) as live:
        assert live.get("/v1/jobs", tenants["b"]).status_code == 401
        assert live.get("/v1/jobs", tenants["a"]).status_code == 200
    engine.dispose()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_database_file_is_private(settings: Settings, tenants: dict[str, str]) -> None:
    path = Path(settings.database_url.removeprefix("sqlite:///"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_numbers_are_strict_and_long_strings_are_not_echoed(settings: Settings, tenants: dict[str, str]) -> None:
    with Live(settings) as live:
        for change in ({"budget_s": True}, {"budget_s": "10"}, {"max_evaluations": "10"},
                       {"workload": {"global_batch": True}}, {"workload": {"global_batch": 8.0}}):
            answer = live.post("/v1/plans", tenants["a"], json={**TINY, **change})
            assert answer.status_code == 422, (change, answer.text)
        infinite = live.post("/v1/plans", tenants["a"], content=json.dumps({**TINY, "budget_s": 1e999}),
                             headers={"Content-Type": "application/json"})
        assert infinite.status_code == 422, infinite.text
        for change in ({"model": "m" * 300}, {"cluster": "c" * 300}, {"model": "/" + "d" * 300}):
            answer = live.post("/v1/plans", tenants["a"], json={**TINY, **change})
            assert answer.status_code == 422 and "File name too long" not in answer.text
            assert "d" * 100 not in answer.text and "m" * 100 not in answer.text and "c" * 100 not in answer.text


# -- 7. fair sharing -------------------------------------------------------------------------------


def test_the_queue_takes_tenants_in_turn_and_caps_each(settings: Settings) -> None:
    from tagplan.service.db import make_engine
    from tagplan.service.requests import LimitError

    store = JobStore(make_engine(settings.database_url), settings.model_copy(update={"max_queued_per_tenant": 4}))
    a, b = ensure_tenant(store.engine, "busy"), ensure_tenant(store.engine, "quiet")
    busy = [store.submit(a, JobKind.PLAN, {"n": i}).id for i in range(3)]
    quiet = store.submit(b, JobKind.PLAN, {"n": 0}).id
    claimed = [store.claim("w") for _ in range(4)]
    assert [j.id for j in claimed if j is not None] == [busy[0], quiet, busy[1], busy[2]]
    store.submit(a, JobKind.PLAN, {"n": 3})
    with pytest.raises(LimitError, match="TAGPLAN_MAX_QUEUED_PER_TENANT") as capped:
        store.submit(a, JobKind.PLAN, {"n": 4})
    assert capped.value.status == 429
    store.engine.dispose()
