"""The worker's watch over a job process (`worker._supervise`) against real forked processes that talk
over a real pipe: a result sent right after progress is kept (read live, after the job exited, or arriving just
after a poll came back empty, or while the worker is stopping), and a job that sends progress without a pause is
still stopped when cancelled."""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tagplan.service.settings import Settings
from tagplan.service.worker import _Running, _supervise


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """The service's default limits (no database is opened here)."""
    # a fork's resident memory starts at this test process's: a cap no test process reaches
    return Settings.from_env(environ={}, home=tmp_path, database_url=f"sqlite:///{tmp_path / 'unused.db'}"
                             ).model_copy(update={"job_memory_bytes": 2**40})


class _Flags:
    """The one store call `_supervise` makes: whether the job was asked to stop."""

    def __init__(self) -> None:
        self.cancelled = False
        self.asked = 0

    def cancel_requested(self, job_id: str) -> bool:
        self.asked += 1
        return self.cancelled


def _progress_then_ok(pipe: Connection) -> None:
    for i in range(200):
        pipe.send(("progress", i / 200, "working"))
    pipe.send(("ok", {"answer": 42}))
    pipe.close()  # and exit at once: the result is still in the pipe behind the progress


def _chatter(pipe: Connection) -> None:
    ends = time.monotonic() + 10.0
    while time.monotonic() < ends:  # progress faster than the worker polls, never a pause
        pipe.send(("progress", 0.5, "busy"))
        time.sleep(0.001)
    # then gone without a result: a worker that never looked at the cancel flag reports a dead job


class _LatePipe:
    """A pipe whose first poll times out empty: the job's last message arrives just after the worker looked."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe, self.polls = pipe, 0

    def poll(self, timeout: float) -> bool:
        self.polls += 1
        return False if self.polls == 1 else self.pipe.poll(timeout)

    def recv(self) -> Any:
        return self.pipe.recv()


def _ok(pipe: Connection) -> None:
    pipe.send(("ok", {"answer": 7}))
    pipe.close()


def _watch(target: Any, flags: _Flags, settings: Settings, *, exited: bool = False,
           late: bool = False, stopping: bool = False) -> tuple[Any, Any]:
    """`_supervise`'s outcome over a fork running `target`; with `exited`, once that process has ended (its
    messages wait in the pipe); with `late`, the worker's first look at the pipe finds nothing; with `stopping`,
    the worker itself is asked to stop (SIGTERM)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(send,), daemon=True)
    process.start()
    send.close()
    if exited:
        process.join(30)
    try:
        pipe: Any = _LatePipe(receive) if late else receive
        stop = threading.Event()
        if stopping:
            stop.set()
        outcome = _supervise(flags, SimpleNamespace(id="job-1"), settings, process, pipe, _Running(), stop)
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)
        receive.close()
    return outcome, process


def test_a_result_sent_right_after_progress_is_kept(settings: Settings) -> None:
    for exited in (False, True):  # read as it comes, and after the job process is gone
        outcome, _ = _watch(_progress_then_ok, _Flags(), settings, exited=exited)
        assert outcome.kind == "ok" and outcome.result == {"answer": 42}, (exited, outcome)


def test_a_job_that_never_stops_sending_progress_is_still_cancelled(settings: Settings) -> None:
    flags = _Flags()
    flags.cancelled = True
    started = time.monotonic()
    outcome, _ = _watch(_chatter, flags, settings.model_copy(update={"job_timeout_s": 60.0}))
    assert outcome.kind == "cancelled" and flags.asked >= 1, outcome
    assert time.monotonic() - started < 10.0  # stopped by the cancel, not by the job's own end


def test_a_result_sent_between_the_worker_s_poll_and_the_job_s_exit_is_kept(settings: Settings) -> None:
    outcome, process = _watch(_ok, _Flags(), settings, exited=True, late=True)
    assert process.exitcode == 0
    assert outcome.kind == "ok" and outcome.result == {"answer": 7}, outcome  # not "the job process died"


def test_a_result_behind_queued_progress_is_kept_when_the_worker_is_stopping(settings: Settings) -> None:
    # the job finished before its worker was told to stop: its result is recorded, not handed back to run again
    outcome, _ = _watch(_progress_then_ok, _Flags(), settings, exited=True, stopping=True)
    assert outcome.kind == "ok" and outcome.result == {"answer": 42}, outcome
