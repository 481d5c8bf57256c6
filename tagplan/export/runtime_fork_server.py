"""The rank server of `runtime_fork`: imports the runtime once, then forks one rank per connection.

`python -m tagplan.export.runtime_fork_server SOCKET PARENT_PID [MODULE...]` imports the modules,
listens on SOCKET (the path appears only once it listens) and serves until SIGTERM or until the
process PARENT_PID has exited; then it kills the ranks still running and removes its socket.

One connection carries one rank: the client sends a `RankRequest` line; the server answers
{"pid": ...} once forked, or {"error": ..., "refused": ...} without forking (a malformed request, a
failed fork, or an environment whose `START_SETTINGS` differ from the server's own: those were read
when the server started, and the rank would run with the server's); a {"kill": true} line from the
client kills the rank while it is still the server's unreaped child, and a client that hangs up
takes its rank with it. When the rank exits the server sends {"code": ...}: the exit code, negative
for the signal that stopped it, as subprocess reports it.

The server is one thread that never runs a tensor operation, so a fork inherits no thread pool. The
child closes every descriptor of the server's, becomes the request's process (folder, environment,
argv, sys.path[0], output files, fresh `random` and numpy seeds, default SIGINT/SIGTERM), runs the
program with `runpy`, and ends as an interpreter would: the program's non-daemon threads joined,
atexit handlers run, an uncaught exception printed (from the program's own frames) with exit code 1,
an uncaught KeyboardInterrupt as SIGINT. It differs in `sys.orig_argv` (the server's) and in that
files the program never closed are not flushed at the end.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import NoReturn

from tagplan.export.runtime_fork import FOLDER_PREFIX, POLL_S, RankRequest, server_files, start_settings

REQUEST_TIMEOUT_S = 10.0  # a client sends its request at once
MAX_REQUEST_BYTES = 1 << 24  # an environment and a command line, not data


class _Ranks:
    """The server's running ranks: pid -> the connection of the client that asked for it."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self.conns: dict[int, socket.socket] = {}

    def add(self, pid: int, conn: socket.socket) -> None:
        self.conns[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def kill(self, pid: int) -> None:
        if pid in self.conns:  # still an unreaped child: its pid cannot belong to another process
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def reap(self) -> None:
        """Report every rank that has exited to its client."""
        while self.conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conns.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(KeyError, ValueError):  # unregistered already if its client hung up
                    self.selector.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                conn.close()


def serve(socket_path: Path, parent_pid: int, preload: tuple[str, ...] = ()) -> None:
    """Import `preload`, listen on `socket_path`, fork a rank per connection and report its exit; return
    when the process with `parent_pid` has exited (this process is reparented) or on SIGTERM."""
    for name in preload:
        importlib.import_module(name)
    settings = start_settings(dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = socket_path.with_suffix(".binding")
    listener.bind(str(partial))
    listener.listen(64)
    os.replace(partial, socket_path)  # the socket appears only once it listens
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    ranks = _Ranks(selector)
    try:
        while not stopping and os.getppid() == parent_pid:
            for key, _ in selector.select(timeout=POLL_S):
                if key.data is None:
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        continue
                    _fork(conn, listener, ranks, settings)
                else:
                    _client_said(key.fileobj, key.data, ranks)  # type: ignore[arg-type]
            ranks.reap()
    finally:
        for pid in list(ranks.conns):
            ranks.kill(pid)
        listener.close()
        socket_path.unlink(missing_ok=True)
        for conn in ranks.conns.values():
            conn.close()


def _client_said(conn: socket.socket, pid: int, ranks: _Ranks) -> None:
    """A kill request, or the client hung up (its launcher is gone): either way the rank is killed."""
    try:
        data = conn.recv(4096)
    except OSError:
        data = b""
    if not data or b"kill" in data:
        ranks.kill(pid)
    if not data:
        ranks.selector.unregister(conn)  # reap() still finds the rank; its exit code has nowhere to go


def _fork(conn: socket.socket, listener: socket.socket, ranks: _Ranks, settings: dict[str, str]) -> None:
    try:
        request = _read_request(conn)
        differ = sorted(k for k in settings.keys() | start_settings(request.env).keys()
                        if settings.get(k) != request.env.get(k))
        if differ:
            _refuse(conn, f"the environment differs from the server's start in {', '.join(differ)}", refused=True)
            return
        pid = os.fork()
    except Exception as e:  # a malformed request (even one nested past the recursion limit), a failed fork
        _refuse(conn, f"{type(e).__name__}: {e}", refused=False)
        return
    if pid == 0:
        try:  # the child never returns into the server's loop, whatever happens here
            ranks.selector.close()
            for sock in (listener, conn, *ranks.conns.values()):
                sock.close()
            _run_rank(request)
        finally:
            os._exit(1)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # the client is gone: so is its rank
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ranks.add(pid, conn)


def _refuse(conn: socket.socket, why: str, *, refused: bool) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"error": why, "refused": refused}).encode() + b"\n")
    conn.close()


def _read_request(conn: socket.socket) -> RankRequest:
    """One request line, within `REQUEST_TIMEOUT_S` in all and `MAX_REQUEST_BYTES` (the server serves one
    connection at a time meanwhile)."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    data = b""
    while not data.endswith(b"\n"):
        left_s = deadline - time.monotonic()
        if left_s <= 0 or len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"no whole request within {REQUEST_TIMEOUT_S:.0f} s and {MAX_REQUEST_BYTES} bytes")
        conn.settimeout(left_s)
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("the connection closed before a whole request")
        data += chunk
    conn.settimeout(None)
    return RankRequest.from_line(data)


def _run_rank(request: RankRequest) -> NoReturn:
    """In the forked child: become `python *argv` in `cwd` with `env`, run the program, exit as it would."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path in ((1, request.stdout), (2, request.stderr)):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        program = request.argv[0]
        sys.argv = list(request.argv)
        sys.path[0] = str(Path(program).resolve().parent)  # as `python train.py` puts the program's folder first
        _reseed()
        code = _run(program)
    except BaseException:  # the rank could not become the program (its output files, its folder): say why
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)  # the status an interpreter exits with: sys.exit(-2) is 254, sys.exit(256) is 0


def _run(program: str) -> int:
    """Run the program as `__main__`; its exit code (after its threads and exit handlers, as an interpreter's)."""
    interrupted = False
    try:
        runpy.run_path(program, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = _exit_code(e)
    except KeyboardInterrupt as e:
        _print_exception(e, program)
        code, interrupted = 1, True
    except BaseException as e:  # reported as the interpreter reports it, exit code 1
        _print_exception(e, program)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own wait for non-daemon threads
    atexit._run_exitfuncs()
    if interrupted:  # an interpreter ends an uncaught KeyboardInterrupt by SIGINT itself
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _reseed() -> None:
    """Fresh seeds where an interpreter's start draws them: `random`, and numpy's global state if loaded."""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _print_exception(e: BaseException, program: str) -> None:
    """The traceback from the program's own frames on (not the server's or runpy's), through sys.excepthook."""
    tb: TracebackType | None = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != program:
        tb = tb.tb_next
    if tb is not None:
        e = e.with_traceback(tb)  # the hook prints the exception's own traceback
    sys.excepthook(type(e), e, e.__traceback__)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    sys.stderr.write(f"{e.code}\n")
    return 1


def _main() -> NoReturn:
    socket_path, parent_pid = Path(sys.argv[1]), int(sys.argv[2])
    code = 1
    try:
        serve(socket_path, parent_pid, tuple(sys.argv[3:]))
        code = 0
        if os.getppid() != parent_pid:  # the starter is gone and cannot remove the server's files: do it here
            for path in server_files(socket_path):
                path.unlink(missing_ok=True)
            if socket_path.parent.name.startswith(FOLDER_PREFIX):
                with contextlib.suppress(OSError):
                    socket_path.parent.rmdir()  # only if nothing else is in it
    except BaseException:  # e.g. a module it cannot import: its starter quotes this log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # no interpreter teardown of torch's modules: seconds, and nothing to flush


if __name__ == "__main__":
    _main()
