"""Start the ranks of an exported program by forking one interpreter that has already imported torch.

Each rank of an exported program spends seconds importing torch, torch.distributed and tagplan's
runtime before its first step (4-6 s of CPU per rank on a 2-core machine). A rank server imports
them once and forks every rank from there. The rank then runs the program file itself (`runpy`, as
`__main__`, with its own argv, working folder, environment and log files) in a process of its own,
and joins gloo (or NCCL) like any other process: only the import is shared.

`launch` (`runtime_launch`) uses the server whose Unix socket `TAGPLAN_RANK_SERVER` names, and
starts plain `python train.py` processes when that is unset. Start one with `RankServer`:

    with RankServer() as server:
        os.environ[RANK_SERVER_ENV] = str(server.socket_path)

The server is one thread that never runs a tensor operation, so a fork inherits no thread pool. It
is started with the settings `launch` gives every rank and that the interpreter reads only at start
(one OpenMP thread, warnings ignored); it stops when the process that started it exits. One
connection carries one rank: the request (a JSON line: argv, cwd, env, stdout and stderr paths),
then the server's answers, {"pid": ...} once forked and {"code": ...} when the rank has exited
(the exit code, negative for the signal that stopped it, as subprocess reports it). A rank's
`os.environ` is exactly the request's env: what an interpreter's start adds to its own (LC_CTYPE
under the C locale, PEP 538) it has in its locale, not in `os.environ`.
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
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

RANK_SERVER_ENV = "TAGPLAN_RANK_SERVER"
PRELOAD = ("tagplan.export.runtime_train",)  # the program's imports: torch, torch.distributed, the runtime
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # read once, at the interpreter's start
START_TIMEOUT_S = 120.0
POLL_S = 0.05


class RankServerError(RuntimeError):
    """The rank server did not start, or stopped while a rank was running."""


class ForkedRank:
    """A rank forked by the server, with the part of `subprocess.Popen` that `launch` uses."""

    def __init__(self, conn: socket.socket, pid: int, received: bytes = b"") -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = received  # what the server sent after the pid (its exit code, if it was that quick)

    def poll(self) -> int | None:
        """The exit code once the rank has exited, else None (never blocks)."""
        if self.returncode is None:
            self._read(block=False)
        return self.returncode

    def wait(self, timeout_s: float | None = None) -> int:
        """Block until the rank has exited; its exit code."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout_s or 0.0)
            self._read(block=True)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the rank (the server reaps it and reports the signal)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def _read(self, *, block: bool) -> None:
        self._conn.settimeout(POLL_S if block else 0.0)
        try:
            data = self._conn.recv(4096)
        except (BlockingIOError, TimeoutError):
            return
        if not data:
            self._conn.close()
            self.kill()
            raise RankServerError(f"the rank server stopped while rank pid {self.pid} ran")
        self._buffer += data
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "code" in message:
                self.returncode = int(message["code"])
                self._conn.close()


class RankServer:
    """A rank server in a process of its own, listening on `socket_path` until `close`."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = preload  # modules the server imports before it listens
        self._folder = Path(tempfile.mkdtemp(prefix="tagplan-ranks-"))
        self.socket_path = self._folder / "ranks.sock"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server process's pid once started."""
        return None if self._proc is None else self._proc.pid

    def __enter__(self) -> RankServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until it listens (it has imported the runtime by then)."""
        env = {**os.environ, **SERVER_ENV}
        env.pop(RANK_SERVER_ENV, None)
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(self.socket_path), str(os.getpid()),
                                       *self.preload],
                                      env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self.socket_path.exists():
            if self._proc.poll() is not None:
                raise RankServerError(f"the rank server exited with code {self._proc.returncode} before listening")
            if time.monotonic() > deadline:
                self.close()
                raise RankServerError(f"the rank server did not listen within {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the server (ranks still running are left to their launcher) and remove its socket."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self.socket_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._folder.rmdir()


def start_rank(socket_path: str | Path, argv: list[str], *, cwd: Path, env: dict[str, str], stdout: Path,
               stderr: Path) -> ForkedRank:
    """Ask the server at `socket_path` to fork a rank running `python *argv` in `cwd` with exactly `env`,
    its output written to `stdout` and `stderr`."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(socket_path))
    except OSError as e:
        conn.close()
        raise RankServerError(f"no rank server listens at {RANK_SERVER_ENV}={socket_path}: {e}") from e
    request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
    conn.sendall(json.dumps(request).encode() + b"\n")
    conn.settimeout(START_TIMEOUT_S)
    answer = b""
    while not answer.endswith(b"\n"):
        data = conn.recv(4096)
        if not data:
            conn.close()
            raise RankServerError(f"the rank server at {socket_path} closed the connection before forking")
        answer += data
    first, _, rest = answer.partition(b"\n")
    message = json.loads(first)
    if "pid" not in message:
        conn.close()
        raise RankServerError(f"the rank server refused the rank: {message.get('error', message)}")
    return ForkedRank(conn, int(message["pid"]), rest)


def serve(socket_path: Path, parent_pid: int, preload: tuple[str, ...] = PRELOAD) -> None:
    """Import `preload`, listen on `socket_path`, fork a rank per connection and report its exit; return
    when the process with `parent_pid` has exited (this process is reparented) or on SIGTERM."""
    for name in preload:
        importlib.import_module(name)
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
    selector.register(listener, selectors.EVENT_READ)
    ranks: dict[int, socket.socket] = {}
    try:
        while not stopping and os.getppid() == parent_pid:
            if selector.select(timeout=POLL_S):
                conn, _ = listener.accept()
                _fork(conn, listener, ranks)
            _reap(ranks)
    finally:
        listener.close()
        socket_path.unlink(missing_ok=True)
        for conn in ranks.values():
            conn.close()


def _fork(conn: socket.socket, listener: socket.socket, ranks: dict[int, socket.socket]) -> None:
    conn.settimeout(10.0)
    try:
        request = _read_request(conn)
    except (OSError, ValueError) as e:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"error": str(e)}).encode() + b"\n")
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        for sock in (listener, conn, *ranks.values()):
            sock.close()
        _run_rank(request)
    ranks[pid] = conn
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _read_request(conn: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("the connection closed before a whole request")
        data += chunk
    request = json.loads(data)
    missing = [key for key in ("argv", "cwd", "env", "stdout", "stderr") if key not in request]
    if missing:
        raise ValueError(f"the request lacks {', '.join(missing)}")
    return dict(request)


def _reap(ranks: dict[int, socket.socket]) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def _run_rank(request: dict[str, Any]) -> NoReturn:
    """In the forked child: become `python *argv` in `cwd` with `env`, run the program, exit with its code."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = [str(a) for a in request["argv"]]
        sys.argv = argv
        sys.path[0] = str(Path(argv[0]).resolve().parent)  # as `python train.py` puts the program's folder first
        random.seed()  # a fresh interpreter's seed, not the server's
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:  # reported as the interpreter reports it, exit code 1
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()  # the exit handlers a normal interpreter exit runs
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(Path(sys.argv[1]), int(sys.argv[2]), tuple(sys.argv[3:]))
    os._exit(0)  # no interpreter teardown of torch's modules: seconds, and nothing to flush
