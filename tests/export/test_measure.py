"""`export.measure`: what it asks the program for and how it reads the ranks' step lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest

from tagplan.export import measure as measuring
from tagplan.export.runtime_launch import RankRun, launch
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType

PLAN = Plan(micro_batches=1, stages=(Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,))))


def test_the_slowest_rank_times_each_step_and_the_largest_peak_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: dict[str, Any] = {}

    def program(spec: str, plan: Plan, out: Path, **kwargs: Any) -> Path:
        asked.update(kwargs)
        return out / "train.py"

    def ranks(program: Path, procs: int, args: list[str], *, timeout_s: float, device: str) -> list[RankRun]:
        asked["device"] = device
        lines = [[{"step": s, "time_s": t, "peak_memory_bytes": p} for s, t, p in rows] for rows in (
            [(0, 9.0, 1e9), (1, 1.0, 2e9), (2, 3.0, 2e9), (3, 2.0, 2e9)],
            [(0, 8.0, 3e9), (1, 2.0, 5e9), (2, 1.0, 5e9), (3, 4.0, 5e9)])]
        return [RankRun(r, 0, tuple(rows), "") for r, rows in enumerate(lines)]

    monkeypatch.setattr(measuring, "write_torch_program", program)
    monkeypatch.setattr(measuring, "launch", ranks)
    result = measuring.measure("gpt?layers=2&hidden=64&heads=2&vocab=128", PLAN, seq_len=16, global_batch=2,
                               steps=3, warmup=1, dtype=DType.BF16, device="cuda")
    assert asked["dtype"] is DType.BF16 and asked["steps"] == 4 and asked["device"] == "cuda"
    assert (result.median_s, result.min_s, result.max_s, result.steps) == (3.0, 2.0, 4.0, 3)  # max over ranks per step
    assert result.peak_memory_bytes == 5e9


def test_a_cpu_run_reports_no_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(measuring, "write_torch_program", lambda spec, plan, out, **kw: out / "train.py")
    monkeypatch.setattr(measuring, "launch", lambda program, procs, args, *, timeout_s, device: [
        RankRun(0, 0, ({"step": 0, "time_s": 1.0}, {"step": 1, "time_s": 2.0}), "")])
    result = measuring.measure("gpt?layers=2&hidden=64&heads=2&vocab=128", PLAN, seq_len=16, global_batch=2,
                               steps=1, warmup=1)
    assert result.median_s == 2.0 and result.peak_memory_bytes is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_launched_ranks_are_told_which_device_to_run_on(tmp_path: Path, device: Literal["cpu", "cuda"]) -> None:
    program = tmp_path / "train.py"  # the torch program reads TAGPLAN_DEVICE in runtime_train.setup
    program.write_text("import json, os\nprint(json.dumps({'device': os.environ['TAGPLAN_DEVICE'], "
                       "'rank': os.environ['RANK']}))\n")
    runs = launch(program, 2, [], timeout_s=60, device=device)
    assert [r.returncode for r in runs] == [0, 0]
    assert [r.lines for r in runs] == [({"device": device, "rank": "0"},), ({"device": device, "rank": "1"},)]


def test_ranks_still_running_at_the_time_limit_are_marked_timed_out_not_when_a_peer_failed_first(
        tmp_path: Path) -> None:
    program = tmp_path / "train.py"  # rank 0 finishes, rank 1 outlives the limit
    program.write_text("import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(30)\n")
    runs = launch(program, 2, [], timeout_s=3)
    assert [(r.returncode, r.timed_out) for r in runs] == [(0, False), (None, True)]
    failing = tmp_path / "fail.py"  # rank 0 fails at once: rank 1 is stopped for it, not for the time limit
    failing.write_text("import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(3)\ntime.sleep(30)\n")
    runs = launch(failing, 2, [], timeout_s=20)
    assert [(r.returncode, r.timed_out) for r in runs] == [(3, False), (None, False)]
