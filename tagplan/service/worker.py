"""The worker: claim a job, run it with a heartbeat thread, complete or fail it; and `WorkerPool`.

A job runs in the worker's own thread; a second thread renews the lease every `heartbeat_s` (at
most a third of the lease, so two missed beats do not lose it) and writes the progress the job
reported. The job's progress callback is where it stops: it raises `Cancelled` once a heartbeat
saw the cancellation flag, or an internal error when the lease was lost or the worker is shutting
down. A worker that loses its lease drops its result without a word: another worker owns the job.

Run one with `python -m tagplan.service.worker` (or `tagplan worker`); `WorkerPool` keeps N of
them alive for `tagplan serve`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import FrameType

from sqlalchemy.exc import SQLAlchemyError

from tagplan.errors import SpecError
from tagplan.service.db import make_engine
from tagplan.service.jobs import Cancelled, Progress, run_job
from tagplan.service.settings import Settings
from tagplan.service.store import JobStore, JobView, LeaseLost

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000  # what a failed job keeps of its error (the log has the rest)


class _Abandon(Exception):  # noqa: N818 (control flow, never seen outside this module)
    """Raised into a running job when its worker must drop it: the lease was lost, or shutdown."""


@dataclass
class _Running:
    """What the job thread and the heartbeat thread share about one running job."""

    progress: float = 0.0
    message: str = "running"
    cancel: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def run_worker(settings: Settings, *, worker_id: str | None = None, stop: threading.Event | None = None,
               once: bool = False, poll_s: float = 0.5) -> int:
    """Claim and run jobs until `stop` is set (or, with `once`, at most one job); returns jobs run.

    A job still running when `stop` is set is handed back to the queue (not counted as an attempt).
    """
    _one_torch_thread()
    store = JobStore(make_engine(settings.database_url), settings)
    worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    stop = stop or threading.Event()
    ran = 0
    log.info("worker %s polling %s", worker_id, settings.database_url)
    while not stop.is_set():
        try:
            job = store.claim(worker_id)
        except SQLAlchemyError as err:  # the database is away for a moment: try again, do not die
            log.warning("worker %s: claim failed: %s", worker_id, err)
            job = None
        if job is None:
            if once:
                break
            stop.wait(poll_s)
            continue
        run_one(store, job, worker_id, settings, stop)
        ran += 1
        if once:
            break
    return ran


def run_one(store: JobStore, job: JobView, worker_id: str, settings: Settings, stop: threading.Event) -> None:
    """Run a claimed job to its end: completed, failed (retried or not), cancelled, or handed back."""
    state = _Running()
    beat = threading.Thread(target=_heartbeats, args=(store, job.id, worker_id, state, _beat_s(settings)),
                            name=f"heartbeat-{job.id[:8]}", daemon=True)
    beat.start()

    def progress(fraction: float, message: str) -> None:
        state.progress, state.message = fraction, message
        if state.lost.is_set() or stop.is_set():
            raise _Abandon(job.id)
        if state.cancel.is_set():
            raise Cancelled(job.id)

    log.info("job %s (%s, attempt %d) started", job.id, job.kind, job.attempts)
    try:
        _settle(store, job, worker_id, settings, progress, state)
    except LeaseLost:
        log.warning("job %s: lease lost to another worker; result dropped", job.id)
    except SQLAlchemyError as err:  # the lease runs out and another worker takes the job
        log.error("job %s: could not record its outcome: %s", job.id, err)
    finally:
        state.done.set()
        beat.join()


def _settle(store: JobStore, job: JobView, worker_id: str, settings: Settings,
            progress: Progress, state: _Running) -> None:
    """Run the job and record how it ended (LeaseLost propagates: nothing to record then)."""
    try:
        result = run_job(job.kind, job.request, settings, progress)
    except Cancelled:
        store.mark_cancelled(job.id, worker_id)
        log.info("job %s cancelled", job.id)
        return
    except _Abandon:
        if state.lost.is_set():
            raise LeaseLost(job.id) from None
        store.release(job.id, worker_id)
        log.info("job %s handed back: the worker is stopping", job.id)
        return
    except SpecError as err:
        store.fail(job.id, worker_id, str(err)[:MAX_ERROR_CHARS], retry=False)
        log.info("job %s failed on its request: %s", job.id, err)
        return
    except Exception as err:
        log.exception("job %s: attempt %d raised", job.id, job.attempts)  # the traceback stays in the log
        text = f"internal error on attempt {job.attempts}: {type(err).__name__}: {err}"
        store.fail(job.id, worker_id, text[:MAX_ERROR_CHARS], retry=True)
        return
    if state.cancel.is_set():  # asked to stop after the search's last check: honour it
        store.mark_cancelled(job.id, worker_id)
        return
    store.complete(job.id, worker_id, result)
    log.info("job %s succeeded", job.id)


def _beat_s(settings: Settings) -> float:
    return min(settings.heartbeat_s, settings.lease_s / 3.0)


def _heartbeats(store: JobStore, job_id: str, worker_id: str, state: _Running, every_s: float) -> None:
    """Renew the lease and write progress until the job is done; flag cancellation and lost leases."""
    while not state.done.wait(every_s):
        try:
            if store.heartbeat(job_id, worker_id, state.progress, state.message):
                state.cancel.set()
        except LeaseLost:
            state.lost.set()
            return
        except SQLAlchemyError as err:  # keep beating: the lease outlives a short outage
            log.warning("job %s: heartbeat failed: %s", job_id, err)


def _one_torch_thread() -> None:
    # Each worker is one process of a pool on a shared machine, and the GNN's graphs are small:
    # intra-op threads only contend (see tests/conftest.py).
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; a worker still plans without it
        return
    torch.set_num_threads(1)


class WorkerPool:
    """`processes` worker processes (`python -m tagplan.service.worker`), restarted when one dies."""

    CHECK_S = 1.0
    MAX_BACKOFF_S = 30.0

    def __init__(self, settings: Settings, processes: int) -> None:
        if processes < 0:
            raise SpecError(f"workers: {processes} is not accepted; expected 0 or more")
        self.settings, self.processes = settings, processes
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * processes
        self._started_at = [0.0] * processes
        self._backoff_s = [0.0] * processes
        self._died_at: list[float | None] = [None] * processes
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None

    def start(self) -> None:
        """Start the processes and the thread that restarts them."""
        with self._lock:
            for slot in range(self.processes):
                self._spawn(slot)
        self._monitor = threading.Thread(target=self._watch, name="worker-pool", daemon=True)
        self._monitor.start()

    def pids(self) -> list[int]:
        """The process ids of the live workers."""
        with self._lock:
            return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the workers: SIGTERM (they hand their jobs back), then kill those still alive."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join()
        with self._lock:
            procs = [p for p in self._procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in %.0f s; killing it", proc.pid, timeout_s)
                proc.kill()
                proc.wait()

    def _spawn(self, slot: int) -> None:
        env = {**os.environ, **self.settings.to_env()}
        proc = subprocess.Popen([sys.executable, "-m", "tagplan.service.worker"], env=env)
        self._procs[slot], self._started_at[slot] = proc, time.monotonic()
        log.info("worker process %d started (slot %d)", proc.pid, slot)

    def _watch(self) -> None:
        while not self._stop.wait(self.CHECK_S):
            with self._lock:
                for slot, proc in enumerate(self._procs):
                    if proc is not None and proc.poll() is not None:
                        self._restart(slot, proc)

    def _restart(self, slot: int, proc: subprocess.Popen[bytes]) -> None:
        """Restart a dead worker; one that keeps dying right after its start waits ever longer."""
        now = time.monotonic()
        died_at = self._died_at[slot]
        if died_at is None:
            died_at = self._died_at[slot] = now
            crashed_early = now - self._started_at[slot] < 10.0
            self._backoff_s[slot] = min(self.MAX_BACKOFF_S, max(1.0, 2 * self._backoff_s[slot])) if crashed_early \
                else 0.0
            log.warning("worker process %d exited with %s; restarting it in %.0f s", proc.pid, proc.returncode,
                        self._backoff_s[slot])
        if now - died_at >= self._backoff_s[slot]:
            self._died_at[slot] = None
            self._spawn(slot)


def main() -> int:
    """`python -m tagplan.service.worker`: one worker with the environment's settings until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after handing back the current job", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run_worker(Settings.from_env(), stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
