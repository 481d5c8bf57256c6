"""`--json` output of the commands tools script: it parses, and carries the keys they read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tagplan.cli import main

TINY = "gpt?layers=2&hidden=128&heads=2&vocab=2048"


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path / "home"))


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out)


def test_plan_json_timeline_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, timeline = tmp_path / "plan.json", tmp_path / "trace.json"
    args = ["plan", "--model", TINY, "--seq", "64", "--cluster", "p3.8xlarge", "--max-evaluations", "20",
            "--scorer", "simulator", "--out", str(out), "--timeline", str(timeline), "--json"]
    assert main(args) == 0
    result = _json(capsys)
    assert {"objective", "best", "pareto", "baselines", "search"} <= set(result)
    assert result["search"]["evaluations"] <= 20
    written = json.loads(out.read_text())
    assert written.pop("searched_for") == {"global_batch": 8, "seq_len": 64} and written == result["best"]["plan"]
    assert any(e.get("cat") == "forward" for e in json.loads(timeline.read_text())["traceEvents"])
    # the written plan simulates to the reported figures
    assert main(["simulate", "--model", TINY, "--seq", "64", "--cluster", "p3.8xlarge", "--plan", str(out),
                 "--json"]) == 0
    assert _json(capsys)["iteration_time_s"] == pytest.approx(result["best"]["report"]["iteration_time_s"])


def test_simulate_takes_the_cluster_options(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", TINY, "--seq", "64", "--cluster", "p3.8xlarge:nodes=2", "--plan", "dp", "--json"]
    assert main(args) == 0
    near = _json(capsys)["iteration_time_s"]
    assert main([*args, "--network-latency-us", "5000"]) == 0
    assert _json(capsys)["iteration_time_s"] > near


def test_models_and_dataset_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "list", "--json"]) == 0
    assert _json(capsys)["versions"] == []
    assert main(["models", "list"]) == 0
    assert "no GNN versions registered" in capsys.readouterr().out
    data = tmp_path / "data"
    assert main(["dataset", "generate", "--out", str(data), "--instances", "1", "--plans-per-instance", "2",
                 "--workers", "1", "--json"]) == 0
    written = _json(capsys)
    assert Path(written["train"], "samples.jsonl").exists() and Path(written["heldout_gpus"]).is_dir()


@pytest.mark.slow
def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", TINY, "--cluster", "p3.8xlarge", "--json"]) == 0
    shown = _json(capsys)
    assert shown["model"]["name"] == TINY and shown["cluster"]["num_devices"] == 4
    assert shown["plan"]["best"]["report"]["fits"]


def test_plan_and_simulate_with_a_topology_file_and_an_nccl_tests_log(capsys: pytest.CaptureFixture[str]) -> None:
    fixtures = Path(__file__).parents[1] / "frontends" / "fixtures"
    cluster = ["--cluster", str(fixtures / "topo_dgx_a100.txt"), "--gpu", "A100-SXM-80GB", "--nodes", "2",
               "--nic-gbps", "200"]
    base = ["--model", TINY, "--seq", "64", "--batch", "16", *cluster, "--json"]
    assert main(["plan", *base, "--max-evaluations", "20"]) == 0
    planned = _json(capsys)
    assert len(planned["best"]["plan"]["stages"][0]["devices"]) >= 1
    assert main(["simulate", *base, "--plan", "dp"]) == 0
    catalog = _json(capsys)["iteration_time_s"]
    assert main(["simulate", *base, "--plan", "dp", "--nccl-tests", str(fixtures / "nccl_tests_2nodes.log")]) == 0
    measured = _json(capsys)["iteration_time_s"]
    assert measured != catalog  # the measured inter-node bandwidth replaced the datasheet figure


def test_a_context_parallel_plan_simulates_with_a_timeline_and_exports_to_megatron(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-written Plan JSON with cp 2 runs through `simulate` (report and trace) and `export`: the report
    carries the mesh and whole samples per replica, Megatron's arguments the context-parallel size."""
    plan = {"micro_batches": 2, "stages": [{"layers": [0, 4], "devices": [0, 1, 2, 3], "dp": 1, "cp": 2, "tp": 2}]}
    path, trace, out = tmp_path / "cp.json", tmp_path / "trace.json", tmp_path / "run"
    path.write_text(json.dumps(plan))
    common = ["--model", TINY, "--seq", "64", "--batch", "4"]
    assert main(["simulate", *common, "--cluster", "p3.8xlarge", "--plan", str(path), "--timeline", str(trace),
                 "--json"]) == 0
    stage = _json(capsys)["stages"][0]
    assert (stage["dp"], stage["cp"], stage["tp"], stage["samples_per_micro_batch"]) == (1, 2, 2, 2)
    assert json.loads(trace.read_text())["traceEvents"]
    assert main(["export", *common, "--plan", str(path), "--format", "megatron", "--out", str(out)]) == 0
    capsys.readouterr()
    args = (out / "megatron_args.txt").read_text().split()
    assert args[args.index("--context-parallel-size") + 1] == "2"
    assert "--overlap-grad-reduce" in args  # the two context-parallel ranks reduce gradients
