"""The worker: claim a job, run it in a job process it supervises, complete or fail it; and `WorkerPool`.

Each job runs in a process of its own, forked from the worker (`_job_process`): the worker can
always stop it, whatever the job is doing. The job process sends its progress and, at the end,
its result or error through a pipe (the worker reads all the job sent, even after the job exited, before it
calls it dead); it dies with the worker (parent-death signal, and it checks
its parent), and its address space is capped (`RLIMIT_AS`, `TAGPLAN_JOB_MEMORY_BYTES` beyond what
it started with). The worker meanwhile
- renews the lease every `heartbeat_s` in a second thread (at most a third of the lease, so two
  missed beats do not lose it) and writes the progress the job reported;
- checks every `CANCEL_POLL_S` whether the job was cancelled, and kills the job process before it
  records the cancellation;
- kills it when it runs past `job_timeout_s` or its resident memory passes `job_memory_bytes`,
  failing the job with a message naming the limit (no retry: a retry would do the same);
- on SIGTERM kills it and hands the job back to the queue (not counted as an attempt);
- when its lease was lost, kills it and drops it without a word: another worker owns the job.

Between jobs, as it starts and every `purge_every_s`, a worker deletes the finished jobs past their
retention (`JobStore.purge`). Run one with `python -m tagplan.service.worker` (or `tagplan worker`);
`WorkerPool` keeps N of them alive for `tagplan serve`, and a worker exits when that parent dies.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from tagplan.errors import SpecError
from tagplan.service.db import make_engine
from tagplan.service.jobs import run_job
from tagplan.service.jobs.train import sweep_training_dirs
from tagplan.service.settings import Settings, private_files
from tagplan.service.store import JobStore, JobView, LeaseLost

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 4000  # what a failed job keeps of its error (the log has the rest)
POLL_S = 0.1  # how often the worker looks at its job process
CANCEL_POLL_S = 0.5  # how often it asks the database whether the job was cancelled
MAX_QUEUED_MESSAGES = 10_000  # progress messages read in one go before the worker's checks run again
PARENT_ENV = "TAGPLAN_PARENT_PID"  # set by WorkerPool: the worker exits when this process is gone
_PR_SET_PDEATHSIG = 1


@dataclass
class _Running:
    """What the supervising loop and the heartbeat thread share about one running job."""

    progress: float = 0.0
    message: str = "running"
    cancel: threading.Event = field(default_factory=threading.Event)
    lost: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class _Outcome:
    """How a job process ended: `ok` (with `result`), `spec` (a bad request), `limit` (a cap of the
    worker), `error` (retried), `cancelled`, or `released` (the worker is stopping)."""

    kind: str
    result: dict[str, Any] | None = None
    text: str = ""


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
    purge_at = time.monotonic()
    while not stop.is_set():
        if time.monotonic() >= purge_at:
            purge_at = time.monotonic() + settings.purge_every_s
            _purge(store, worker_id)
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
    store.engine.dispose()
    return ran


def _purge(store: JobStore, worker_id: str) -> None:
    """Delete the finished jobs the service no longer keeps (`JobStore.purge`; a database away is tried next time)
    and the folders killed training runs left (`sweep_training_dirs`)."""
    try:
        swept = sweep_training_dirs(store.settings)
    except OSError as err:  # the state folder unreadable for a moment: tried again next time
        log.warning("worker %s: sweeping training folders failed: %s", worker_id, err)
        swept = 0
    if swept:
        log.info("worker %s: removed %d folders killed training runs left", worker_id, swept)
    try:
        purged = store.purge()
    except SQLAlchemyError as err:
        log.warning("worker %s: purging finished jobs failed: %s", worker_id, err)
        return
    if purged:
        log.info("worker %s: deleted %d finished jobs past their retention", worker_id, purged)


def run_one(store: JobStore, job: JobView, worker_id: str, settings: Settings, stop: threading.Event) -> None:
    """Run a claimed job to its end: completed, failed (retried or not), cancelled, or handed back."""
    state = _Running()
    log.info("job %s (%s, attempt %d) started", job.id, job.kind, job.attempts)
    process, pipe = _start(job, settings)  # forked before the heartbeat thread exists
    beat = threading.Thread(target=_heartbeats, args=(store, job.id, worker_id, state, _beat_s(settings)),
                            name=f"heartbeat-{job.id[:8]}", daemon=True)
    beat.start()
    try:
        outcome = _supervise(store, job, settings, process, pipe, state, stop)
        if process.is_alive():  # SIGKILL before the database write, so a cancelled job's CPU is free at once;
            process.kill()  # its exit (freeing its memory) overlaps the write, and `_kill` reaps it below
        _record(store, job, worker_id, outcome, state)
    except LeaseLost:
        log.warning("job %s: lease lost to another worker; result dropped", job.id)
    except SQLAlchemyError as err:  # the lease runs out and another worker takes the job
        log.error("job %s: could not record its outcome: %s", job.id, err)
    finally:
        _kill(process)
        pipe.close()
        state.done.set()
        beat.join()


def _start(job: JobView, settings: Settings) -> tuple[Any, Connection]:
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_job_process, args=(send, job, settings, os.getpid()),
                              name=f"job-{job.id[:8]}", daemon=True)
    process.start()
    send.close()
    return process, receive


def _supervise(store: JobStore, job: JobView, settings: Settings, process: Any, pipe: Connection,
               state: _Running, stop: threading.Event) -> _Outcome:
    """Follow the job process until it reports its end, or stop it (cancel, caps, shutdown, lost lease)."""
    deadline = time.monotonic() + settings.job_timeout_s
    next_cancel_check = time.monotonic() + CANCEL_POLL_S
    while True:
        message = _receive(pipe)
        read = 0
        while message is not None and message[0] == "progress":  # all the progress queued, then the checks: a
            state.progress, state.message = float(message[1]), str(message[2])  # result behind it is read first,
            read += 1  # and a job that never stops sending progress is still checked
            message = _receive(pipe, 0.0) if read < MAX_QUEUED_MESSAGES else None
        if message is None and not process.is_alive():  # it may have sent its last word since the poll
            message = _last_word(pipe, state)
        if message is not None and message[0] != "eof":
            return _Outcome(kind=message[0], result=message[1] if message[0] == "ok" else None,
                            text="" if message[0] == "ok" else str(message[1]))
        if message is not None:  # gone without a word: killed, or crashed
            process.join(10)
            return _Outcome("error", text=f"the job process died (exit code {process.exitcode})")
        if state.lost.is_set():
            raise LeaseLost(job.id)
        if stop.is_set():
            return _Outcome("released")
        now = time.monotonic()
        if now >= next_cancel_check:
            next_cancel_check = now + CANCEL_POLL_S
            if _cancel_requested(store, job.id):
                state.cancel.set()
        if state.cancel.is_set():
            return _Outcome("cancelled")
        if now > deadline:
            return _Outcome("limit", text=f"the job ran longer than this service's limit of "
                                          f"{settings.job_timeout_s:g} s per job (TAGPLAN_JOB_TIMEOUT_S)")
        rss = _rss_bytes(process.pid)
        if rss > settings.job_memory_bytes:
            return _Outcome("limit", text=f"the job used more memory than this service's limit of "
                                          f"{settings.job_memory_bytes / 2**30:.2f} GiB per job "
                                          f"(TAGPLAN_JOB_MEMORY_BYTES)")


def _receive(pipe: Connection, wait_s: float = POLL_S) -> tuple[Any, ...] | None:
    """The job process's next message, None if it sent none for `wait_s`, ("eof",) once it is gone."""
    try:
        if pipe.poll(wait_s):
            return tuple(pipe.recv())
    except (EOFError, OSError):  # the job process closed its end: its exit code tells how it ended
        return ("eof",)
    return None


def _last_word(pipe: Connection, state: _Running) -> tuple[Any, ...]:
    """What an exited job process left in the pipe: its result or error message, else ("eof",)."""
    while (message := _receive(pipe, 0.0)) is not None and message[0] == "progress":
        state.progress, state.message = float(message[1]), str(message[2])
    return message if message is not None else ("eof",)


def _cancel_requested(store: JobStore, job_id: str) -> bool:
    try:
        return store.cancel_requested(job_id)
    except SQLAlchemyError as err:
        log.warning("job %s: cancel check failed: %s", job_id, err)
        return False


def _record(store: JobStore, job: JobView, worker_id: str, outcome: _Outcome, state: _Running) -> None:
    """Record how the job ended (LeaseLost propagates: nothing to record then)."""
    if outcome.kind == "ok" and outcome.result is not None and not state.cancel.is_set():
        store.complete(job.id, worker_id, outcome.result)
        log.info("job %s succeeded", job.id)
    elif outcome.kind in ("cancelled", "ok"):  # asked to stop after the job's last word: honour it
        store.mark_cancelled(job.id, worker_id)
        log.info("job %s cancelled", job.id)
    elif outcome.kind == "released":
        store.release(job.id, worker_id)
        log.info("job %s handed back: the worker is stopping", job.id)
    elif outcome.kind in ("spec", "limit"):
        store.fail(job.id, worker_id, outcome.text[:MAX_ERROR_CHARS], retry=False)
        log.info("job %s failed on its request: %s", job.id, outcome.text[:500])
    else:
        text = f"internal error on attempt {job.attempts}: {outcome.text}"
        store.fail(job.id, worker_id, text[:MAX_ERROR_CHARS], retry=True)
        log.warning("job %s: %s", job.id, text[:500])


def _kill(process: Any) -> None:
    if process.is_alive():
        process.kill()
    process.join(10)


def _rss_bytes(pid: int) -> int:
    """Resident memory of process `pid` in bytes (0 where /proc cannot tell)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


# -- the job process -------------------------------------------------------------------------------


def _job_process(pipe: Connection, job: JobView, settings: Settings, parent_pid: int) -> None:
    """Run one job and send ("progress", f, message)* then ("ok", result) | ("spec" | "limit" | "error", text)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent(parent_pid)
    _cap_address_space(settings.job_memory_bytes)

    def progress(fraction: float, message: str) -> None:
        pipe.send(("progress", fraction, message))

    try:
        result = run_job(job.kind, job.request, settings, progress, tenant_id=job.tenant_id)
        pipe.send(("ok", result))
    except SpecError as err:
        pipe.send(("spec", redacted(str(err), settings)[:MAX_ERROR_CHARS]))
    except MemoryError:
        pipe.send(("limit", f"the job used more memory than this service's limit of "
                            f"{settings.job_memory_bytes / 2**30:.2f} GiB per job (TAGPLAN_JOB_MEMORY_BYTES)"))
    except Exception as err:
        log.exception("job %s: attempt %d raised", job.id, job.attempts)  # the traceback stays in the log
        pipe.send(("error", redacted(f"{type(err).__name__}: {err}", settings)[:MAX_ERROR_CHARS]))
    finally:
        pipe.close()


def redacted(text: str, settings: Settings) -> str:
    """`text` (an error a tenant reads) with the service's state folder written `$TAGPLAN_HOME`: where the server
    keeps its files is not the tenant's to know (the log keeps the whole message)."""
    for home in sorted({str(settings.home.resolve()), str(settings.home)}, key=len, reverse=True):
        text = text.replace(home, "$TAGPLAN_HOME")
    return text


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux), and exit now if
    `parent_pid` is already gone (it died before the request took effect)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent polling of `watch_parent` remains
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _cap_address_space(extra_bytes: int) -> None:
    """Limit this process's address space to what it has now plus `extra_bytes` (RLIMIT_AS)."""
    try:
        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * resource.getpagesize()
        _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        cap = size + extra_bytes
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (OSError, ValueError):  # no /proc or not permitted: the worker's watch on RSS remains
        pass


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
    # intra-op threads only contend (see tests/conftest.py). Imported here, once, so that every
    # job process forked from the worker has torch and the planner loaded already.
    try:
        import torch

        import tagplan.service.jobs.plan  # noqa: F401 (preloaded for the job processes)
    except ImportError:  # pragma: no cover - torch is a dependency; a worker still plans without it
        return
    torch.set_num_threads(1)


def watch_parent(parent_pid: int, stop: threading.Event, every_s: float = 1.0) -> threading.Thread:
    """A thread that sets `stop` once `parent_pid` is no longer this process's parent (it died)."""
    def watch() -> None:
        while not stop.wait(every_s):
            if os.getppid() != parent_pid:
                log.warning("parent process %d is gone: stopping", parent_pid)
                stop.set()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


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
        env = {**os.environ, **self.settings.to_env(), PARENT_ENV: str(os.getpid())}
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
    """`python -m tagplan.service.worker`: one worker with the environment's settings until SIGTERM,
    SIGINT or (under `WorkerPool`) the death of the process that started it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    private_files()
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping after handing back the current job", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        die_with_parent(int(parent), signal.SIGTERM)  # SIGTERM: the job is handed back on the way out
        watch_parent(int(parent), stop)
    run_worker(Settings.from_env(), stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
