"""The worker's watch over a job process (`worker._supervise`) against real forked processes that talk
over a real pipe: a result sent right after progress is kept, and a job that sends progress without a
pause is still stopped when cancelled."""

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
    return Settings.from_env(environ={}, home=tmp_path, database_url=f"sqlite:///{tmp_path / 'unused.db'}")


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


def _watch(target: Any, flags: _Flags, settings: Settings, *, exited: bool = False) -> tuple[Any, Any]:
    """`_supervise`'s outcome over a fork running `target`; with `exited`, once that process has ended (its
    messages wait in the pipe)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(send,), daemon=True)
    process.start()
    send.close()
    if exited:
        process.join(30)
    try:
        outcome = _supervise(flags, SimpleNamespace(id="job-1"), settings, process, receive, _Running(),
                             threading.Event())
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
