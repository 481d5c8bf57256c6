"""Work run in another process while this one goes on: the planner's baselines beside its search.

`Background(work)` forks a child that runs `work()` on a copy of this process's memory (nothing is pickled on
the way in: the simulator, its caches and the closures come as they are) and sends back its result, pickled,
through a pipe. `result()` waits for it and raises what `work` raised. Where no child was started (a platform
without `fork`, a daemonic process such as the service's job processes, which may not have children: `forked`
is False, and a caller can do the work its own way), or the child dies without a word (killed by a signal or
out of memory) or does not answer within `result`'s time limit (it is then killed), `result()` runs
`fallback()` here instead (`work` by default; a caller whose work reads a clock passes one that starts afresh).

The child runs nothing but `work` and leaves with `os._exit` (multiprocessing's fork start), so it flushes
none of this process's buffers and runs none of its exit handlers. `cancel()` (also on leaving a `with`)
stops a child whose result is no longer wanted; a wait interrupted by an exception stops it too.
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

    def __init__(self, work: Callable[[], T], *, fallback: Callable[[], T] | None = None) -> None:
        self._work = work
        self._fallback = fallback or work
        self._process: Any = None
        self._pipe: Connection | None = None
        try:
            context = multiprocessing.get_context("fork")
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(work, send), daemon=True)
            process.start()
        except (ValueError, AssertionError, OSError) as err:  # no fork here; a daemonic process; out of resources
            log.debug("no background process: %s", err)
            return
        send.close()  # the child holds the write end: its death reads as end of file here
        self._process, self._pipe = process, receive

    @property
    def forked(self) -> bool:
        return self._process is not None

    def ready(self) -> bool:
        """Whether `result()` would return at once: the child has answered or is gone (or none was started)."""
        return self._pipe is None or self._pipe.poll()

    def result(self, timeout_s: float | None = None) -> T:
        """The child's result, or what its `work()` raised; `fallback()` run here where no child answered within
        `timeout_s` seconds (None: no limit)."""
        if self._pipe is None:
            return self._fallback()
        message = None
        try:
            if self._pipe.poll(timeout_s):
                message = self._pipe.recv()
            else:
                log.warning("a background process gave no answer in %.0f s; it is stopped and its work runs here",
                            timeout_s)
        except (EOFError, OSError):  # the child died without a word
            log.warning("a background process died (exit code %s); its work runs here", self._process.exitcode)
        finally:  # a wait interrupted by anything else stops the child before joining it
            self.cancel()
        if message is None:
            return self._fallback()
        kind, value = message
        if kind == "error":
            raise value
        result: T = value
        return result

    def cancel(self) -> None:
        """Stop the child if it still runs (its result is not wanted) and release it."""
        if self._pipe is not None:
            if self._process.is_alive():
                self._process.kill()
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
