"""Work run in another process while this one goes on: the planner's baselines beside its search.

`Background(work)` forks a child that runs `work()` on a copy of this process's memory (nothing is pickled on
the way in: the simulator, its caches and the closures come as they are) and sends back its result, pickled,
through a pipe. `result()` waits for it and raises what `work` raised. Where no child runs or none answers
(a platform without `fork`, a daemonic process such as the service's job processes, which may not have
children, a child killed by a signal or out of memory), `result()` runs `work()` here instead: what the caller
gets never depends on whether the child ran, only when.

The child runs nothing but `work` and leaves with `os._exit` (multiprocessing's fork start), so it flushes
none of this process's buffers and runs none of its exit handlers. `cancel()` (also on leaving a `with`)
stops a child whose result is no longer wanted.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = ["Background", "usable_cores"]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform
        return os.cpu_count() or 1


class Background(Generic[T]):
    """`work()` in a forked child (module docstring); `forked` says whether a child was started."""

    def __init__(self, work: Callable[[], T]) -> None:
        self._work = work
        self._process: Any = None
        self._pipe: Connection | None = None
        try:
            context = multiprocessing.get_context("fork")
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(work, send), daemon=True)
            process.start()
        except (ValueError, AssertionError, OSError) as err:  # no fork here; a daemonic process; out of resources
            log.debug("background work runs in this process: %s", err)
            return
        send.close()  # the child holds the write end: its death reads as end of file here
        self._process, self._pipe = process, receive

    @property
    def forked(self) -> bool:
        return self._process is not None

    def ready(self) -> bool:
        """Whether `result()` would return at once: the child has answered or is gone (or none was started)."""
        return self._pipe is None or self._pipe.poll()

    def result(self) -> T:
        """The child's result, or what its `work()` raised; `work()` run here where no child answered."""
        if self._pipe is None:
            return self._work()
        try:
            message = self._pipe.recv()
        except (EOFError, OSError):  # the child died without a word
            message = None
        finally:
            self._close()
        if message is None:
            log.warning("a background process died (exit code %s); its work runs in this process",
                        self._process.exitcode)
            return self._work()
        kind, value = message
        if kind == "error":
            raise value
        result: T = value
        return result

    def cancel(self) -> None:
        """Stop the child if it still runs (its result is not wanted)."""
        if self._pipe is not None:
            self._process.kill()
            self._close()

    def _close(self) -> None:
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
            self._process.join()

    def __enter__(self) -> Background[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def _child(work: Callable[[], object], send: Connection) -> None:
    try:
        message: tuple[str, object] = ("ok", work())
    except BaseException as err:  # every failure goes back to the parent, which raises it
        message = ("error", err)
    try:
        send.send(message)
    except Exception as err:  # an unpicklable result or exception: say what it was
        send.send(("error", RuntimeError(f"a background computation's {message[0]} could not be sent back "
                                         f"({err}):\n{''.join(traceback.format_exception(message[1]))}"
                                         if isinstance(message[1], BaseException) else
                                         f"a background computation's result could not be sent back: {err}")))
    finally:
        send.close()
