"""`search.background.Background`: work in a forked child, its result or its exception back here, and the same
work run here wherever no child answers."""

import multiprocessing
import os
import signal
import time

import pytest

from tagplan.errors import SpecError
from tagplan.search.background import Background

PARENT = os.getpid()


def _pid_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


def test_the_work_runs_in_a_child_and_its_result_comes_back() -> None:
    with Background(lambda: _pid_and_square(7)) as child:
        assert child.forked
        pid, value = child.result()
    assert value == 49 and pid != PARENT


def test_what_the_work_raises_is_raised_here() -> None:
    def bad() -> None:
        raise SpecError("field x: value 3 is not accepted")

    with pytest.raises(SpecError, match="field x"), Background(bad) as child:
        child.result()


def test_a_child_that_dies_without_a_word_leaves_its_work_to_this_process() -> None:
    def dies_in_a_child() -> tuple[int, int]:
        if os.getpid() != PARENT:  # the child is killed as by the kernel's OOM killer
            os.kill(os.getpid(), signal.SIGKILL)
        return _pid_and_square(5)

    child = Background(dies_in_a_child)
    assert child.forked
    pid, value = child.result()
    assert (pid, value) == (PARENT, 25)


def test_an_unpicklable_result_is_an_error_naming_it() -> None:
    with pytest.raises(RuntimeError, match="could not be sent back"), Background(lambda: (lambda: 1)) as child:
        child.result()


def test_cancel_stops_a_child_that_still_runs() -> None:
    child = Background(lambda: time.sleep(60))
    assert not child.ready()
    started = time.perf_counter()
    child.cancel()
    assert time.perf_counter() - started < 10  # killed, not waited for
    assert not multiprocessing.active_children()


def _forked_in(send: multiprocessing.connection.Connection) -> None:  # type: ignore[name-defined]
    child = Background(lambda: _pid_and_square(3))
    send.send((child.forked, child.result()))


def test_a_daemonic_process_which_may_not_fork_runs_the_work_itself() -> None:
    # the service's job processes are daemonic: multiprocessing refuses them children
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_forked_in, args=(send,), daemon=True)
    process.start()
    forked, (pid, value) = receive.recv()
    process.join()
    assert not forked and value == 9 and pid == process.pid


def test_a_child_silent_past_its_time_limit_is_stopped_and_the_fallback_runs_here() -> None:
    def slow_in_a_child() -> int:
        if os.getpid() != PARENT:
            time.sleep(60)
        return 1

    child = Background(slow_in_a_child, fallback=lambda: 2)
    started = time.perf_counter()
    assert child.result(timeout_s=0.5) == 2
    assert time.perf_counter() - started < 10 and not multiprocessing.active_children()
