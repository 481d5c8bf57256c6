"""Ranks forked from a rank server (tagplan.export.runtime_fork) run the program as `python` would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tagplan.export import runtime_launch
from tagplan.export.runtime_fork import (
    RANK_SERVER_ENV,
    SERVER_ENV,
    ForkedRank,
    RankServer,
    RankServerError,
    start_rank,
    start_settings,
)
from tagplan.export.runtime_launch import launch
from tagplan.export.verify import verify
from tagplan.ir.plan import Plan, Stage

SELF_REPORT = """\
import atexit, json, os, signal, sys, threading, time
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "env": os.environ.get("PROBE"), "keys": sorted(os.environ),
                  "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT))}))
print("to stderr", file=sys.stderr)
atexit.register(print, "exit handler ran")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
sys.exit(int(sys.argv[1]))
"""


def _env(**extra: str) -> dict[str, str]:
    """A small environment with the start settings of the servers here (`launch` passes this process's, which
    its server was started with) and a locale that is not C: under C, an interpreter's start adds LC_CTYPE
    (PEP 538), which a forked rank has in its locale but not in `os.environ`."""
    return {**start_settings({**os.environ, **SERVER_ENV}), "PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8",
            "PROBE": "p", **extra}


def test_a_forked_rank_runs_the_program_as_python_would(tmp_path: Path, rank_server: Path) -> None:
    folder = tmp_path / "prog"
    folder.mkdir()
    program = folder / "report.py"
    program.write_text(SELF_REPORT)
    plain = subprocess.run([sys.executable, str(program), "4", "x"], cwd=tmp_path, env=_env(), capture_output=True,
                           text=True)
    rank = start_rank(rank_server, [str(program), "4", "x"], cwd=tmp_path, env=_env(), stdout=tmp_path / "out",
                      stderr=tmp_path / "err")
    assert rank.wait() == plain.returncode == 4
    assert (tmp_path / "out").read_text() == plain.stdout  # argv, cwd, sys.path[0], env, signals, thread, atexit
    report = json.loads(plain.stdout.splitlines()[0])
    assert report["path0"] == str(folder) and report["name"] == "__main__"
    assert plain.stdout.splitlines()[1:] == ["thread finished", "exit handler ran"]
    assert (tmp_path / "err").read_text() == plain.stderr == "to stderr\n"


def test_forked_ranks_draw_their_own_random_numbers(tmp_path: Path, rank_server: Path) -> None:
    program = tmp_path / "draw.py"
    program.write_text("import random\nprint(random.random())\n")
    draws = []
    for k in range(2):
        rank = start_rank(rank_server, [str(program)], cwd=tmp_path, env=_env(), stdout=tmp_path / f"o{k}",
                          stderr=tmp_path / f"e{k}")
        assert rank.wait() == 0
        draws.append((tmp_path / f"o{k}").read_text())
    assert draws[0] != draws[1]


def test_relative_paths_are_the_launcher_s(tmp_path: Path, rank_server: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("work").mkdir()
    Path("work/p.py").write_text("import os\nprint(os.getcwd())\n")
    rank = start_rank(rank_server, ["p.py"], cwd=Path("work"), env=_env(), stdout=Path("out.txt"),
                      stderr=Path("err.txt"))
    assert rank.wait() == 0
    assert (tmp_path / "out.txt").read_text() == f"{tmp_path / 'work'}\n"


def test_an_exit_code_that_came_with_the_pid_is_kept_when_the_connection_closes() -> None:
    """A rank that exits before its client read the pid: the code arrives in the same read as the pid."""
    ours, theirs = socket.socketpair()
    theirs.close()
    rank = ForkedRank(ours, 4321, b'{"code": 3}\n')
    assert rank.poll() == 3 and rank.wait() == 3


def test_a_server_refuses_ranks_whose_start_settings_differ_and_launch_starts_them_plainly(
        tmp_path: Path, rank_server: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = tmp_path / "p.py"
    program.write_text("import os\nprint(os.environ['TORCH_SHOW_CPP_STACKTRACES'])\n")
    with pytest.raises(RankServerError, match="TORCH_SHOW_CPP_STACKTRACES"):
        start_rank(rank_server, [str(program)], cwd=tmp_path, env=_env(TORCH_SHOW_CPP_STACKTRACES="1"),
                   stdout=tmp_path / "o", stderr=tmp_path / "e")
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")  # read by torch at import: the server's torch did not
    runs = launch(program, 2, [], timeout_s=60)
    assert [r.returncode for r in runs] == [0, 0]  # without the fallback, launch raises the refusal


@pytest.mark.parametrize(("source", "code"), [
    ("def f():\n    raise ValueError('bad layer')\nf()", 1),  # the traceback of the program's frames only
    ("import sys; sys.exit('refused: tp=3')", 1),
    ("import sys; sys.exit()", 0),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ("raise KeyboardInterrupt", -2),
    ("import sys; sys.exit(-2)", 254),  # a status, not SIGINT
    ("import sys; sys.exit(2 ** 40)", 0),  # an interpreter keeps the low byte; the child still exits
])
def test_a_forked_rank_exits_as_the_interpreter_would(tmp_path: Path, rank_server: Path, source: str,
                                                        code: int) -> None:
    program = tmp_path / "p.py"
    program.write_text(source + "\n")
    plain = subprocess.run([sys.executable, str(program)], env=_env(), capture_output=True, text=True)
    rank = start_rank(rank_server, [str(program)], cwd=tmp_path, env=_env(), stdout=tmp_path / "out",
                      stderr=tmp_path / "err")
    assert rank.wait() == plain.returncode == code
    assert (tmp_path / "err").read_text() == plain.stderr


@pytest.mark.parametrize("forked", [False, True])
def test_launch_stops_ranks_for_a_failed_peer_and_for_time_either_way(tmp_path: Path, rank_server: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       forked: bool) -> None:
    if not forked:
        monkeypatch.delenv(RANK_SERVER_ENV)
    program = tmp_path / "train.py"
    program.write_text("import json, os, sys, time\nprint(json.dumps({'rank': os.environ['RANK'], "
                       "'server': os.environ.get('TAGPLAN_RANK_SERVER')}))\nsys.stdout.flush()\n"
                       "if os.environ['RANK'] == '0':\n    sys.exit(3)\ntime.sleep(30)\n")
    started = time.monotonic()
    runs = launch(program, 2, [], timeout_s=20)
    assert [(r.returncode, r.timed_out) for r in runs] == [(3, False), (None, False)]
    assert [r.lines for r in runs] == [({"rank": "0", "server": None},), ({"rank": "1", "server": None},)]
    assert time.monotonic() - started < 15  # the peer was stopped after the grace period, not the 30 s sleep


@pytest.mark.slow
def test_a_plan_verified_on_forked_ranks_gives_the_gradients_of_plain_processes(monkeypatch: pytest.MonkeyPatch,
                                                                                rank_server: Path) -> None:
    """The same two-stage pipeline on gloo, forked and plain: bit-identical gradient errors and loss."""
    spec = "gpt?layers=2&hidden=64&heads=4&vocab=128&max_positions=2048"
    plan = Plan(stages=(Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,))), micro_batches=2)
    forked = verify(spec, plan)
    monkeypatch.delenv(RANK_SERVER_ENV)
    plain = verify(spec, plan)
    assert forked.passed and plain.passed
    assert (forked.loss, forked.max_abs_error, forked.max_rel_error) == (plain.loss, plain.max_abs_error,
                                                                        plain.max_rel_error)


def test_a_request_without_its_fields_is_refused_and_the_server_serves_on(tmp_path: Path, rank_server: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(rank_server))
        conn.sendall(json.dumps({"argv": ["x.py"]}).encode() + b"\n")
        conn.settimeout(10)
        answer = json.loads(conn.recv(4096))
    assert "cwd" in answer["error"] and "pid" not in answer
    program = tmp_path / "ok.py"
    program.write_text("print('ok')\n")
    rank = start_rank(rank_server, [str(program)], cwd=tmp_path, env=_env(), stdout=tmp_path / "o",
                      stderr=tmp_path / "e")
    assert rank.wait() == 0 and (tmp_path / "o").read_text() == "ok\n"


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" in status.read_text()
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], what: str) -> None:
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


SLEEPER = ("import os, pathlib, time\npathlib.Path(f\"pid{os.environ['RANK']}\").write_text(str(os.getpid()))\n"
           "time.sleep(60)\n")


def test_launch_kills_the_ranks_it_started_when_a_later_one_cannot_start(tmp_path: Path, rank_server: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    program = tmp_path / "train.py"
    program.write_text(SLEEPER)
    real = runtime_launch.start_rank
    started: list[ForkedRank] = []

    def second_fails(*args: object, **kwargs: object) -> ForkedRank:
        if started:
            raise RankServerError("no room for rank 1")
        started.append(real(*args, **kwargs))  # type: ignore[arg-type]
        return started[-1]

    monkeypatch.setattr(runtime_launch, "start_rank", second_fails)
    with pytest.raises(RankServerError, match="no room"):
        launch(program, 2, [], timeout_s=60)
    assert started[0].returncode == -9  # killed, and its exit reported before launch raised
    _wait_gone([started[0].pid], "rank 0 outlived the failed launch")


def test_launch_stops_every_rank_when_their_server_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    program = tmp_path / "train.py"
    program.write_text(SLEEPER)
    with RankServer(preload=()) as server:
        monkeypatch.setenv(RANK_SERVER_ENV, str(server.socket_path))
        closer = threading.Timer(3.0, server.close)
        closer.start()
        with pytest.raises(RankServerError, match="stopped while rank"):
            launch(program, 2, [], timeout_s=60)
        closer.join()
    _wait_gone([int((tmp_path / f"pid{r}").read_text()) for r in range(2)], "a rank outlived its server")


def test_a_rank_whose_server_stops_is_reported_and_killed(tmp_path: Path) -> None:
    program = tmp_path / "sleep.py"
    program.write_text("import time\ntime.sleep(60)\n")
    server = RankServer(preload=())  # what it imports does not matter here
    server.start()
    rank = start_rank(server.socket_path, [str(program)], cwd=tmp_path, env=_env(), stdout=tmp_path / "o",
                      stderr=tmp_path / "e")
    assert rank.poll() is None
    server.close()
    with pytest.raises(RankServerError, match="stopped while rank"):
        rank.wait(timeout_s=10)
    _wait_gone([rank.pid], "the server left its rank running")
    assert not server.socket_path.parent.exists()


def test_the_server_stops_when_the_process_that_started_it_exits(tmp_path: Path) -> None:
    starter = ("import sys\nfrom tagplan.export.runtime_fork import RankServer\n"
               "s = RankServer(preload=()); s.start(); print(s.pid, s.socket_path, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, check=True, timeout=120)
    _wait_gone([int(out.stdout.split()[0])], "the rank server outlived the process that started it")
    assert not Path(out.stdout.split()[1]).parent.exists()  # it removed its folder
    with pytest.raises(RankServerError, match="no rank server listens"):
        start_rank(out.stdout.split()[1], ["x.py"], cwd=tmp_path, env={}, stdout=tmp_path / "o",
                   stderr=tmp_path / "e")


def test_a_server_whose_starter_is_gone_removes_only_its_own_files(tmp_path: Path) -> None:
    """Its socket's folder may hold other files: those stay (the server's own go, and the folder only if it is
    one of the servers' temporary folders)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "important.txt").write_text("keep")
    (folder / "server.log").write_text("the server's")
    done = subprocess.run([sys.executable, "-m", "tagplan.export.runtime_fork_server", str(folder / "x.sock"), "1"],
                          capture_output=True, text=True, timeout=60)  # pid 1 is not its parent: it stops at once
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["important.txt"]


def test_a_server_that_cannot_start_says_why_and_leaves_no_folder() -> None:
    server = RankServer(preload=("tagplan.no_such_module",))
    with pytest.raises(RankServerError, match="exited with code 1") as failed:
        server.start(timeout_s=60)
    assert "ModuleNotFoundError" in str(failed.value) and "tagplan.no_such_module" in str(failed.value)
    assert not server.socket_path.parent.exists()


def test_an_endless_request_is_refused_and_the_server_serves_on(tmp_path: Path) -> None:
    """A request with no end of line is cut off past 16 MiB (the server reads one request at a time)."""
    with RankServer(preload=()) as server, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(server.socket_path))
        conn.settimeout(30)
        chunk = b"x" * (1 << 20)
        try:
            for _ in range(20):
                conn.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused mid-way: the answer is already waiting
        answer = json.loads(conn.recv(4096))
        assert "no whole request" in answer["error"] and answer["refused"] is False
        program = tmp_path / "ok.py"
        program.write_text("print('ok')\n")
        rank = start_rank(server.socket_path, [str(program)], cwd=tmp_path, env=_env(), stdout=tmp_path / "o",
                          stderr=tmp_path / "e")
        assert rank.wait() == 0
