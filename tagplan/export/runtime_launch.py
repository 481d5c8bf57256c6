"""Run an exported program on N local processes, as `torchrun --nproc-per-node N` would: on CPUs
(gloo, the default), or one per GPU of this host over NCCL (`device="cuda"`).

Each rank is started directly with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), one torch thread per rank, which saves the launcher agent's own
interpreter start-up (seconds on a busy machine). When one rank fails the others are stopped
after a short grace period, instead of waiting out the collective timeout.

Where `TAGPLAN_RANK_SERVER` names a running rank server (`runtime_fork`), each rank is forked from
it instead: the same program file, argv, environment and log files, without importing torch again.

The ranks of one launch meet through a store file of their own (`TAGPLAN_RENDEZVOUS`, file://, which the
program reads before torchrun's env://): two launches on one host that picked the same free port at once would
otherwise meet in one TCP store, and one's ranks take the other's addresses (the likely cause of a rank crashing
before its first layer while tests ran side by side).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from tagplan.export.node_launch import RENDEZVOUS_ENV
from tagplan.export.runtime_fork import RANK_SERVER_ENV, RankServerRefusedError, start_rank

GRACE_S = 5.0


class Rank(Protocol):
    """A started rank: a `subprocess.Popen`, or a `runtime_fork.ForkedRank`."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self) -> int: ...


@dataclass(frozen=True)
class RankRun:
    """One rank's exit code, its JSON step lines and the tail of its stderr."""

    rank: int
    returncode: int | None  # None: killed (timed out or stopped after another rank failed)
    lines: tuple[dict[str, Any], ...]
    stderr_tail: str
    timed_out: bool = False
    """Killed because the run reached its time limit with no rank failed before it."""


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(program: Path, procs: int, args: list[str], *, timeout_s: float, attempts: int = 2,
           device: Literal["cpu", "cuda"] = "cpu") -> list[RankRun]:
    """Run `program` on `procs` ranks in its folder; return every rank's outcome (rank order). The
    ranks run on CPUs (gloo) unless `device` is "cuda": then each pins its GPU and joins over NCCL.

    The rendezvous port is picked free just before the start; if another process takes it in
    between, the run is repeated on a new port (up to `attempts` runs in all).
    """
    for _ in range(attempts - 1):
        runs = _launch_once(program, procs, args, timeout_s=timeout_s, device=device)
        if not any("EADDRINUSE" in r.stderr_tail or "address already in use" in r.stderr_tail.lower() for r in runs):
            return runs
    return _launch_once(program, procs, args, timeout_s=timeout_s, device=device)


def _launch_once(program: Path, procs: int, args: list[str], *, timeout_s: float,
                 device: Literal["cpu", "cuda"]) -> list[RankRun]:
    port = free_port()
    logs = program.parent / "logs"
    logs.mkdir(exist_ok=True)
    store = logs / f"rendezvous-{os.getpid()}-{time.monotonic_ns()}"  # a fresh file per launch
    server = os.environ.get(RANK_SERVER_ENV)
    running: list[Rank] = []
    try:
        for rank in range(procs):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(procs),
                   "LOCAL_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "TAGPLAN_DEVICE": device, "PYTHONWARNINGS": "ignore",
                   RENDEZVOUS_ENV: store.resolve().as_uri()}
            env.pop(RANK_SERVER_ENV, None)
            out, err = logs / f"rank{rank}.out", logs / f"rank{rank}.err"
            if server:
                try:
                    running.append(start_rank(server, [str(program), *args], cwd=program.parent, env=env,
                                              stdout=out, stderr=err))
                    continue
                except RankServerRefusedError:  # its start settings are not these ranks': start them plainly
                    if running:
                        raise
                    server = None
            with out.open("w") as out_file, err.open("w") as err_file:
                running.append(subprocess.Popen([sys.executable, str(program), *args], cwd=program.parent,
                                                env=env, stdout=out_file, stderr=err_file))
        codes, timed_out = _wait(running, timeout_s)
    except BaseException:
        _stop(running)
        raise
    finally:
        store.unlink(missing_ok=True)
    return [_collect(logs, rank, code, timed_out=timed_out and code is None) for rank, code in enumerate(codes)]


def _stop(ranks: list[Rank]) -> None:
    """Kill every rank, then wait for each (a rank whose server is gone cannot be waited for: its server
    killed it when it stopped)."""
    for rank in ranks:
        with contextlib.suppress(Exception):
            rank.kill()
    for rank in ranks:
        with contextlib.suppress(Exception):
            rank.wait()


def _wait(procs: list[Rank], timeout_s: float) -> tuple[list[int | None], bool]:
    """Poll until all exit; after the first failure (or the timeout) kill the rest after GRACE_S. Also whether
    the run reached `timeout_s` before any rank failed (the ranks still running are then killed for time)."""
    deadline = time.monotonic() + timeout_s
    failed = False
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            failed = True
            deadline = min(deadline, time.monotonic() + GRACE_S)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    codes: list[int | None] = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    return codes, not failed and None in codes


def _collect(logs: Path, rank: int, code: int | None, *, timed_out: bool = False) -> RankRun:
    lines = []
    for text in (logs / f"rank{rank}.out").read_text().splitlines():
        if text.startswith("{"):
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                continue
    stderr = (logs / f"rank{rank}.err").read_text()
    return RankRun(rank, code, tuple(lines), stderr[-3000:], timed_out)
