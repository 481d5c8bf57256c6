"""Launch scripts per node and the start-up check (tagplan.export.node_launch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.export.node_launch import gpu_matches, launch_scripts, rank_table, startup_problems
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.ir.plan import Plan, Stage

TOUR = "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1"  # 12 V100 (devices 0-11), then 4 T4 (12-15)


def tour_plan() -> Plan:
    """The README tour's plan: dp2 x tp2 on the T4 node, then three dp4 stages on V100."""
    return Plan(micro_batches=4, stages=(
        Stage(layers=(0, 5), devices=(12, 13, 14, 15), dp=2, tp=2),
        Stage(layers=(5, 12), devices=(0, 1, 2, 3), dp=4),
        Stage(layers=(12, 19), devices=(4, 5, 6, 7), dp=4),
        Stage(layers=(19, 26), devices=(8, 9, 10, 11), dp=4)))


def test_the_node_of_stage_zero_is_launched_first() -> None:
    table = rank_table(tour_plan(), load_cluster(TOUR))
    assert [row["device"] for row in table] == [12, 13, 14, 15, *range(12)]
    assert [row["node_rank"] for row in table[:5]] == [0, 0, 0, 0, 1]
    assert table[0]["gpu"] == "T4" and table[0]["local_gpu"] == 0 and table[4]["gpu"].startswith("V100")
    scripts = launch_scripts(table)
    assert sorted(scripts) == [f"launch_node{k}.sh" for k in range(4)]
    first = scripts["launch_node0.sh"]
    assert "--nnodes 4 --node-rank 0 --nproc-per-node 4" in first and "4 x T4" in first
    assert "plan devices [12, 13, 14, 15]" in first and "world ranks 0..3" in first
    assert "world ranks 4..7" in scripts["launch_node1.sh"] and "V100" in scripts["launch_node1.sh"]


def test_without_a_cluster_the_plan_runs_on_one_host_in_its_own_order() -> None:
    plan = Plan(stages=(Stage(layers=(0, 2), devices=(3,)), Stage(layers=(2, 4), devices=(1,))))
    table = rank_table(plan, None)
    assert [(row["device"], row["node_rank"], row["local_gpu"], row["gpu"]) for row in table] == [
        (3, 0, 0, None), (1, 0, 1, None)]
    assert "--nnodes 1 --node-rank 0 --nproc-per-node 2" in launch_scripts(table)["launch_node0.sh"]


def test_startup_check_names_each_mismatch() -> None:
    table = rank_table(tour_plan(), load_cluster(TOUR))
    ok = startup_problems(table, rank=0, world=16, local_world=4, node_rank=0, gpu_name="Tesla T4", gpu_count=4)
    assert ok == []
    wrong_gpu = startup_problems(table, rank=0, world=16, local_world=4, node_rank=0,
                                 gpu_name="Tesla V100-SXM2-16GB", gpu_count=4)
    assert wrong_gpu == ["rank 0 (plan device 12 on node g4dn.12xlarge-0) was planned on a T4 but local GPU 0 is a "
                         "Tesla V100-SXM2-16GB"]
    swapped = startup_problems(table, rank=4, world=16, local_world=4, node_rank=0, gpu_name=None, gpu_count=None)
    assert "belongs to node rank 1 but was started as node rank 0" in swapped[0]
    assert "launch_node1.sh" in swapped[0]
    short = startup_problems(table, rank=0, world=8, local_world=4, node_rank=0, gpu_name=None, gpu_count=None)
    assert "the plan runs on 16 processes but WORLD_SIZE=8" in short[0]
    few = startup_problems(table, rank=3, world=16, local_world=2, node_rank=0, gpu_name=None, gpu_count=2)
    assert any("runs 4 processes but this node started 2" in p for p in few)
    assert any("needs local GPU 3 but this node has 2 GPUs" in p for p in few)


@pytest.mark.parametrize(("expected", "found", "match"), [
    ("V100-SXM2-32GB", "Tesla V100-SXM2-32GB", True), ("T4", "Tesla T4", True), ("L4", "NVIDIA L40S", False),
    ("RTX4090", "NVIDIA GeForce RTX 4090", True), ("A100-SXM-80GB", "NVIDIA H100 80GB HBM3", False),
    ("H100-SXM", "NVIDIA H100 80GB HBM3", True)])
def test_gpu_names_match_by_model(expected: str, found: str, match: bool) -> None:
    assert gpu_matches(expected, found) is match


def test_each_local_launch_meets_in_a_store_file_of_its_own(tmp_path: Path) -> None:
    from tagplan.export.runtime_launch import launch

    program = tmp_path / "show.py"  # a rank that prints where it was told to meet
    program.write_text("import json, os\nprint(json.dumps({'at': os.environ['TAGPLAN_RENDEZVOUS']}))\n")
    seen = []
    for _ in range(2):
        runs = launch(program, 2, [], timeout_s=60)
        urls = {run.lines[0]["at"] for run in runs}
        assert all(run.returncode == 0 for run in runs) and len(urls) == 1  # one store per launch
        seen.extend(urls)
    assert len(set(seen)) == 2 and all(url.startswith("file://") for url in seen)  # a new one each launch
    assert not list((tmp_path / "logs").glob("rendezvous-*"))  # and gone when the launch is done


def test_the_program_names_a_rendezvous_that_is_no_url(monkeypatch: pytest.MonkeyPatch) -> None:
    from tagplan.export.runtime_train import rendezvous

    monkeypatch.delenv("TAGPLAN_RENDEZVOUS", raising=False)
    assert rendezvous() is None  # torchrun's env://
    monkeypatch.setenv("TAGPLAN_RENDEZVOUS", "file:///tmp/store")
    assert rendezvous() == "file:///tmp/store"
    monkeypatch.setenv("TAGPLAN_RENDEZVOUS", "/tmp/store")
    with pytest.raises(SystemExit, match="TAGPLAN_RENDEZVOUS = '/tmp/store': the ranks meet at a file://"):
        rendezvous()
