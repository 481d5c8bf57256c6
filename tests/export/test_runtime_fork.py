"""Ranks forked from a rank server (tagplan.export.runtime_fork) run the program as `python` would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tagplan.export.runtime_fork import RANK_SERVER_ENV, RankServer, RankServerError, start_rank
from tagplan.export.runtime_launch import launch
from tagplan.export.verify import verify
from tagplan.ir.plan import Plan, Stage

SELF_REPORT = """\
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "env": os.environ.get("PROBE"), "server": os.environ.get("TAGPLAN_RANK_SERVER"),
                  "keys": sorted(os.environ)}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _env(**extra: str) -> dict[str, str]:
    """A small environment whose locale is not C: under C, an interpreter's start adds LC_CTYPE (PEP 538),
    which a forked rank inherits in its locale but not in `os.environ`."""
    return {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C.UTF-8", "PROBE": "p", **extra}


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
    assert json.loads((tmp_path / "out").read_text()) == json.loads(plain.stdout)  # argv, cwd, sys.path[0], env
    assert json.loads(plain.stdout)["path0"] == str(folder) and json.loads(plain.stdout)["name"] == "__main__"
    assert (tmp_path / "err").read_text() == plain.stderr == "to stderr\n"


@pytest.mark.parametrize(("source", "code", "stderr"), [
    ("raise ValueError('bad layer')", 1, "ValueError: bad layer"),
    ("import sys; sys.exit('refused: tp=3')", 1, "refused: tp=3"),
    ("import sys; sys.exit()", 0, ""),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
])
def test_a_forked_rank_exits_as_the_interpreter_would(tmp_path: Path, rank_server: Path, source: str, code: int,
                                                        stderr: str) -> None:
    program = tmp_path / "p.py"
    program.write_text(source + "\n")
    plain = subprocess.run([sys.executable, str(program)], env=_env(), capture_output=True, text=True)
    rank = start_rank(rank_server, [str(program)], cwd=tmp_path, env=_env(), stdout=tmp_path / "out",
                      stderr=tmp_path / "err")
    assert rank.wait() == plain.returncode == code
    assert stderr in (tmp_path / "err").read_text() and stderr in plain.stderr


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
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank.pid}").exists() and "zombie" not in Path(f"/proc/{rank.pid}/status").read_text():
        assert time.monotonic() < deadline, "the orphaned rank was not killed"
        time.sleep(0.05)


def test_the_server_stops_when_the_process_that_started_it_exits(tmp_path: Path) -> None:
    starter = ("import sys\nfrom tagplan.export.runtime_fork import RankServer\n"
               "s = RankServer(preload=()); s.start(); print(s.pid, s.socket_path, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, check=True, timeout=120)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
        assert time.monotonic() < deadline, "the rank server outlived the process that started it"
        time.sleep(0.05)
    with pytest.raises(RankServerError, match="no rank server listens"):
        start_rank(out.stdout.split()[1], ["x.py"], cwd=tmp_path, env={}, stdout=tmp_path / "o",
                   stderr=tmp_path / "e")
