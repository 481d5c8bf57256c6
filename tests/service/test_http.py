"""The service as deployed: a real uvicorn server and a real worker process over one SQLite file.

One plan goes through end to end, then schemathesis fuzzes every operation of the live server's
OpenAPI schema (a bounded number of examples each) and checks that no input produces a 5xx.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import sqlalchemy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tagplan.service.db import make_engine
from tagplan.service.keys import create_key

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = {"model": "gpt?layers=4&hidden=256&heads=4&vocab=100", "cluster": "p3.8xlarge",
        "workload": {"global_batch": 8, "seq_len": 64}, "max_evaluations": 20, "budget_s": 3}
START_TIMEOUT_S = 60.0
JOB_TIMEOUT_S = 120.0
MAX_EXAMPLES = 25  # per operation and mode (valid, invalid)
MAX_WAIT_S = 0.5

# POST /v1/traces documents records.jsonl as application/x-ndjson: text on the wire.
schemathesis.serializer.alias("application/x-ndjson", "text/plain")


@dataclass(frozen=True)
class Live:
    url: str
    key: str
    admin_key: str
    server_log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_until_up(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server did not start in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def _database(kind: str, home: Path) -> Iterator[str]:
    """A SQLite file in `home`, or a fresh schema of the PostgreSQL at `TAGPLAN_TEST_DATABASE_URL`."""
    if kind == "sqlite":
        yield f"sqlite:///{home / 'service.db'}"
        return
    base = os.environ.get("TAGPLAN_TEST_DATABASE_URL")
    if not base:
        pytest.skip("TAGPLAN_TEST_DATABASE_URL not set")
    schema = f"test_http_{uuid.uuid4().hex[:12]}"
    admin = sqlalchemy.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sqlalchemy.text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = sqlalchemy.make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sqlalchemy.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("service")
    with _database(request.param, home) as database_url:
        yield from _serve(home, database_url)


def _serve(home: Path, database_url: str) -> Iterator[Live]:
    """The API server and one worker on `database_url` while the caller iterates."""
    engine = make_engine(database_url)
    key, admin_key = create_key(engine, "acme"), create_key(engine, "ops", admin=True)
    engine.dispose()
    env = {**os.environ, "TAGPLAN_HOME": str(home), "TAGPLAN_DATABASE_URL": database_url,
           # The fuzzer submits far more than a tenant may, and every job it gets past validation must
           # be quick, or the worker would still be searching when the module ends.
           "TAGPLAN_RATE_PER_MINUTE": "100000", "TAGPLAN_MAX_BUDGET_S": "3", "TAGPLAN_MAX_EVALUATIONS": "50"}
    port = _free_port()
    server_log, worker_log = home / "server.log", home / "worker.log"
    with server_log.open("wb") as out_server, worker_log.open("wb") as out_worker:
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", "tagplan.service.app:create_app",
                                   "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                  env=env, cwd=REPO, stdout=out_server, stderr=subprocess.STDOUT)
        worker = subprocess.Popen([sys.executable, "-m", "tagplan.service.worker"], env=env, cwd=REPO,
                                  stdout=out_worker, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(url, server, server_log)
        yield Live(url=url, key=key, admin_key=admin_key, server_log=server_log)
    finally:
        _stop(worker)
        _stop(server)


def test_a_plan_through_the_real_server_and_worker(live: Live) -> None:
    with httpx.Client(base_url=live.url, headers=live.headers, timeout=30) as client:
        submitted = client.post("/v1/plans", json=TINY)
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"job still {job['status']} after {JOB_TIMEOUT_S:.0f} s"
            time.sleep(0.5)
        assert job["status"] == "succeeded", job
        result = client.get(f"/v1/jobs/{job_id}/result")
        assert result.status_code == 200
        assert {"best", "timeline"} <= set(result.json())
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as events:
            assert "event: done" in "".join(events.iter_text())
        assert "tagplan_jobs" not in client.get("/metrics").text  # job counts: for admins only
        admin = {"Authorization": f"Bearer {live.admin_key}"}
        assert 'tagplan_jobs{status="succeeded"} 1.0' in client.get("/metrics", headers=admin).text


def test_fifty_concurrent_http_submissions_give_fifty_results(live: Live) -> None:
    """Fifty clients at once: fifty distinct jobs, each finished once, none lost."""
    from concurrent.futures import ThreadPoolExecutor

    def submit(seed: int) -> str:
        with httpx.Client(base_url=live.url, headers=live.headers, timeout=60) as client:
            answer = client.post("/v1/plans", json={**TINY, "seed": seed})
            assert answer.status_code == 202, answer.text
            return str(answer.json()["id"])

    with ThreadPoolExecutor(max_workers=50) as pool:
        ids = list(pool.map(submit, range(50)))
    assert len(set(ids)) == 50
    deadline = time.monotonic() + 10 * JOB_TIMEOUT_S
    with httpx.Client(base_url=live.url, headers=live.headers, timeout=30) as client:
        for job_id in ids:
            while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] in ("queued", "running"):
                assert time.monotonic() < deadline, f"job {job_id} still {job['status']}"
                time.sleep(0.5)
            assert job["status"] == "succeeded" and job["attempts"] == 1, job
        listed = client.get("/v1/jobs", params={"limit": 100}).json()
        assert set(ids) <= {j["id"] for j in listed["jobs"]}


def test_a_retried_post_creates_one_job(live: Live) -> None:
    """A client that retries (here eight at once, racing) with one `Idempotency-Key` gets one job."""
    from concurrent.futures import ThreadPoolExecutor

    key = uuid.uuid4().hex
    body = {**TINY, "seed": 1234}

    def submit(_: int) -> tuple[int, str]:
        with httpx.Client(base_url=live.url, headers={**live.headers, "Idempotency-Key": key}, timeout=60) as client:
            answer = client.post("/v1/plans", json=body)
            return answer.status_code, str(answer.json().get("id"))

    with httpx.Client(base_url=live.url, headers=live.headers, timeout=30) as client:
        before = client.get("/v1/jobs").json()["total"]
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(submit, range(8)))
        assert {status for status, _ in answers} == {202} and len({job for _, job in answers}) == 1, answers
        assert client.get("/v1/jobs").json()["total"] == before + 1
        changed = client.post("/v1/plans", json={**body, "seed": 1235}, headers={"Idempotency-Key": key})
        assert changed.status_code == 422 and key in changed.json()["detail"]
        assert client.get("/v1/jobs").json()["total"] == before + 1


def _fuzz(schema: Any, operation: Any, headers: dict[str, str]) -> str | None:
    """About MAX_EXAMPLES valid and as many invalid requests to one operation (its documented
    examples among them); the failure, if any."""
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE, headers=headers),
                         operation.as_strategy(GenerationMode.NEGATIVE, headers=headers),
                         *schema.get_strategies_from_examples(operation, headers=headers))

    @given(case=strategy)
    @settings(max_examples=2 * MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case: Any) -> None:
        query = case.query if isinstance(case.query, dict) else {}
        if isinstance(query.get("wait"), int | float) and query["wait"] > MAX_WAIT_S:
            query["wait"] = MAX_WAIT_S  # ?wait= blocks by design: keep the fuzzer's waits short
        case.call_and_validate(headers=headers, checks=[not_a_server_error], timeout=70)

    try:
        run()
    except Exception as err:  # a failed check: report it with the others
        return f"{operation.method.upper()} {operation.path}: {err}"
    return None


def test_no_input_is_a_server_error(live: Live) -> None:
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 13
    admin = {"Authorization": f"Bearer {live.admin_key}"}  # reaches the admin-only routes too
    failures = [f for f in (_fuzz(schema, op, admin) for op in operations) if f]
    assert not failures, "\n\n".join(failures)


def test_the_server_logged_no_traceback(live: Live) -> None:
    """Runs after the fuzzing (file order): a 4xx handled cleanly leaves no traceback behind."""
    assert "Traceback" not in live.server_log.read_text()
