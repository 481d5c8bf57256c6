"""Start the ranks of an exported program by forking one interpreter that has already imported torch.

Each rank of an exported program spends seconds importing torch, torch.distributed and tagplan's
runtime before its first step (4-6 s of CPU per rank on a 2-core machine). A rank server
(`runtime_fork_server`) imports them once and forks every rank from there. The rank then runs the
program file itself (`runpy`, as `__main__`, with its own argv, working folder, environment and log
files) in a process of its own, and joins gloo (or NCCL) like any other process: only the import is
shared.

`launch` (`runtime_launch`) uses the server whose Unix socket `TAGPLAN_RANK_SERVER` names, and
starts plain `python train.py` processes when that is unset or when the server refuses the ranks'
settings. Start one with `RankServer`:

    with RankServer() as server:
        os.environ[RANK_SERVER_ENV] = str(server.socket_path)

What a forked rank shares with the server and a fresh interpreter would not: what the interpreter
and torch read when they start (`START_SETTINGS`: a server refuses a request whose environment
differs there, and `launch` then starts plain processes) and the string-hash seed (as ranks started
with one PYTHONHASHSEED share theirs). `random` and numpy are reseeded in each rank.

This module is the client: `RankServer` starts and stops a server, `start_rank` asks it for a rank
and returns a `ForkedRank` (the part of `subprocess.Popen` that `launch` uses).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RANK_SERVER_ENV = "TAGPLAN_RANK_SERVER"
PRELOAD = ("tagplan.export.runtime_train",)  # the program's imports: torch, torch.distributed, the runtime
SERVER_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # the settings `launch` gives every rank
START_SETTINGS = ("PYTHON", "TORCH_", "OMP_", "MKL_", "KMP_", "CUDA_", "LD_")
"""Prefixes of the environment variables an interpreter, torch or its libraries read when they start."""
FOLDER_PREFIX = "tagplan-ranks-"  # a server's temporary folder: its socket and its log
START_TIMEOUT_S = 120.0
POLL_S = 0.05
SERVER_MODULE = "tagplan.export.runtime_fork_server"


class RankServerError(RuntimeError):
    """The rank server did not start, or stopped while a rank was running."""


class RankServerRefusedError(RankServerError):
    """The rank server refused a rank (its environment differs where the server's start fixed it)."""


@dataclass(frozen=True)
class RankRequest:
    """One rank to fork: `python *argv` in `cwd` with exactly `env`, its output into two files (absolute paths)."""

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    stdout: str
    stderr: str

    def to_line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> RankRequest:
        """The request of one JSON line; ValueError naming what is missing or of the wrong type."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"a request is a JSON object, not {type(data).__name__}")
        missing = [key for key in ("argv", "cwd", "env", "stdout", "stderr") if key not in data]
        if missing:
            raise ValueError(f"the request lacks {', '.join(missing)}")
        if not (isinstance(data["argv"], list) and data["argv"] and isinstance(data["env"], dict)):
            raise ValueError("argv must be a non-empty list and env an object")
        return cls(tuple(str(a) for a in data["argv"]), str(data["cwd"]),
                   {str(k): str(v) for k, v in data["env"].items()}, str(data["stdout"]), str(data["stderr"]))


def start_settings(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` that an interpreter and torch read once, when they start (`START_SETTINGS`)."""
    return {k: v for k, v in env.items() if k.startswith(START_SETTINGS)}


class ForkedRank:
    """A rank forked by the server, with the part of `subprocess.Popen` that `launch` uses."""

    def __init__(self, conn: socket.socket, pid: int, received: bytes = b"") -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = received  # what the server sent after the pid: its exit code, if it was that quick
        self._parse()

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
        """Ask the server to SIGKILL the rank (it does so only while the rank is its unreaped child, so a
        reused pid is never hit); its exit code then reports the signal."""
        if self.returncode is None:
            with contextlib.suppress(OSError):
                self._conn.sendall(b'{"kill": true}\n')

    def _read(self, *, block: bool) -> None:
        if self._conn.fileno() == -1:  # closed after the server was found gone
            raise RankServerError(f"the rank server stopped while rank pid {self.pid} ran")
        self._conn.settimeout(POLL_S if block else 0.0)
        try:
            data = self._conn.recv(4096)
        except (BlockingIOError, TimeoutError):
            return
        except OSError:
            data = b""
        if not data:
            self._conn.close()
            raise RankServerError(f"the rank server stopped while rank pid {self.pid} ran (the server kills its "
                                  "ranks when it stops)")
        self._buffer += data
        self._parse()

    def _parse(self) -> None:
        while b"\n" in self._buffer and self.returncode is None:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "code" in message:
                self.returncode = int(message["code"])
                self._conn.close()


class RankServer:
    """A rank server in a process of its own, listening on `socket_path` until `close`; its output is in
    `log_path`."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.preload = preload  # modules the server imports before it listens
        self._folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
        self.socket_path = self._folder / "ranks.sock"
        self.log_path = server_files(self.socket_path)[2]
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
        """Start the server and wait until it listens (it has imported `preload` by then)."""
        env = {**os.environ, **SERVER_ENV}
        env.pop(RANK_SERVER_ENV, None)
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen([sys.executable, "-m", SERVER_MODULE, str(self.socket_path),
                                           str(os.getpid()), *self.preload], env=env, stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.socket_path.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with code {self._proc.returncode}" if self._proc.poll() is not None
                       else f"did not listen within {timeout_s:.0f} s")
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.close()
                raise RankServerError(f"the rank server {why}; its output:\n{tail}")
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop the server (it kills the ranks still running) and remove its folder."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for path in server_files(self.socket_path):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self._folder.rmdir()


def server_files(socket_path: Path) -> tuple[Path, ...]:
    """The files a server at `socket_path` makes in its folder: the socket, the socket while it binds, its log."""
    return socket_path, socket_path.with_suffix(".binding"), socket_path.parent / "server.log"


def start_rank(socket_path: str | Path, argv: list[str], *, cwd: Path, env: dict[str, str], stdout: Path,
               stderr: Path) -> ForkedRank:
    """Ask the server at `socket_path` to fork a rank running `python *argv` in `cwd` with exactly `env`,
    its output written to `stdout` and `stderr` (relative paths are this process's, as for Popen).
    RankServerRefusedError where the server's start settings differ from `env`'s."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(socket_path))
    except OSError as e:
        conn.close()
        raise RankServerError(f"no rank server listens at {RANK_SERVER_ENV}={socket_path}: {e}") from e
    request = RankRequest(tuple(argv), str(Path(cwd).resolve()), env, str(Path(stdout).resolve()),
                          str(Path(stderr).resolve()))
    conn.sendall(request.to_line())
    conn.settimeout(START_TIMEOUT_S)
    answer = b""
    while b"\n" not in answer:
        data = conn.recv(4096)
        if not data:
            conn.close()
            raise RankServerError(f"the rank server at {socket_path} closed the connection before forking")
        answer += data
    first, _, rest = answer.partition(b"\n")
    message = json.loads(first)
    if "pid" not in message:
        conn.close()
        kind = RankServerRefusedError if message.get("refused") else RankServerError
        raise kind(f"the rank server refused the rank: {message.get('error', message)}")
    return ForkedRank(conn, int(message["pid"]), rest)
