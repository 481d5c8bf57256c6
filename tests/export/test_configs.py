"""Megatron-LM arguments, DeepSpeed configs and the export dispatcher (tagplan.export.megatron,
tagplan.export.deepspeed, tagplan.export.dispatch)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tagplan.errors import SpecError
from tagplan.export import ExportError, export
from tagplan.export.deepspeed import deepspeed_config, deepspeed_partition
from tagplan.export.dispatch import tp_comm_settings
from tagplan.export.megatron import grad_reduce as megatron_grad_reduce
from tagplan.export.megatron import megatron_arguments, model_config_from_spec
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model, parse_model_spec
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.ir.workload import DType


@pytest.fixture(scope="module")
def gpt3() -> ModelGraph:
    return load_model("gpt3-175b")  # embedding, 96 blocks, head


@pytest.fixture(scope="module")
def llama70b() -> ModelGraph:
    return load_model("llama2-70b", seq_len=4096)  # embedding, 80 blocks, head


def pipeline(blocks: list[int], *, tp: int, dp: int = 1, micro_batches: int = 64, schedule: str = "1f1b",
             groups: int | None = None, **stage_fields: Any) -> Plan:
    """Stages holding `blocks[i]` transformer blocks, the embedding on the first, the head on the last,
    on consecutive device groups of dp * tp (reused round-robin over `groups` for interleaving)."""
    n = dp * tp
    groups = groups or len(blocks)
    bounds = [0, *(1 + sum(blocks[: i + 1]) for i in range(len(blocks)))]
    bounds[-1] += 1  # the head
    first = [n * (i % groups) for i in range(len(blocks))]  # first device of each stage's group
    stages = tuple(Stage(layers=(bounds[i], bounds[i + 1]), devices=tuple(range(first[i], first[i] + n)),
                         dp=dp, tp=tp, **stage_fields) for i in range(len(blocks)))
    return Plan(micro_batches=micro_batches, schedule=Schedule(schedule), stages=stages)


def all_stages(plan: Plan, **update: Any) -> Plan:
    """`plan` with every stage changed."""
    return plan.model_copy(update={"stages": tuple(s.model_copy(update=update) for s in plan.stages)})


def swap_devices(plan: Plan, a: int, b: int) -> Plan:
    """`plan` with the device groups of stages `a` and `b` exchanged."""
    stages = list(plan.stages)
    stages[a], stages[b] = (stages[a].model_copy(update={"devices": stages[b].devices}),
                            stages[b].model_copy(update={"devices": stages[a].devices}))
    return plan.model_copy(update={"stages": tuple(stages)})


def with_stage(plan: Plan, index: int, **update: Any) -> Plan:
    """`plan` with stage `index` changed (re-validated)."""
    stages = list(plan.stages)
    stages[index] = Stage.model_validate({**stages[index].model_dump(), **update})
    return Plan(micro_batches=plan.micro_batches, schedule=plan.schedule, stages=tuple(stages))


# --- Megatron-LM --------------------------------------------------------------------------------


def test_gpt3_175b_tp8_pp8_is_exactly_megatrons_published_layout(gpt3: ModelGraph) -> None:
    plan = pipeline([12] * 8, tp=8, recompute=True)
    args = megatron_arguments(gpt3, plan, global_batch=1536, seq_len=2048)
    assert args == [
        "--tensor-model-parallel-size", "8",
        "--pipeline-model-parallel-size", "8",
        "--sequence-parallel",
        "--num-layers", "96",
        "--hidden-size", "12288",
        "--ffn-hidden-size", "49152",
        "--num-attention-heads", "96",
        "--seq-length", "2048",
        "--max-position-embeddings", "2048",
        "--vocab-size", "50257",
        "--micro-batch-size", "24",
        "--global-batch-size", "1536",
        "--recompute-granularity", "full",
        "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
        "--bf16",
    ]


def test_data_parallel_and_zero1_add_the_distributed_optimizer_and_overlap(gpt3: ModelGraph) -> None:
    plan = pipeline([24] * 4, tp=8, dp=2, micro_batches=32, zero=1)
    args = megatron_arguments(gpt3, plan, global_batch=512, seq_len=2048)
    assert args[-4:] == ["--overlap-grad-reduce", "--use-distributed-optimizer", "--overlap-param-gather", "--bf16"]
    assert args[args.index("--micro-batch-size") + 1] == "8"  # 512 / (32 micro-batches * dp 2)
    assert "--recompute-granularity" not in args


def test_llama_interleaved_uses_virtual_stages_and_llama_switches(llama70b: ModelGraph) -> None:
    plan = pipeline([10] * 8, tp=8, groups=4, schedule="interleaved_1f1b", micro_batches=16)
    args = megatron_arguments(llama70b, plan, global_batch=16, seq_len=4096)
    text = " ".join(args)
    assert "--pipeline-model-parallel-size 4" in text
    assert "--num-layers-per-virtual-pipeline-stage 10" in text
    assert ("--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
            "--group-query-attention --num-query-groups 8 --untie-embeddings-and-output-weights") in text
    assert "--ffn-hidden-size 28672" in text and "--max-position-embeddings 4096" in text


def test_uneven_first_and_last_stages_use_the_decoder_flags(gpt3: ModelGraph) -> None:
    args = megatron_arguments(gpt3, pipeline([9, 13, 13, 13, 13, 13, 13, 9], tp=8), global_batch=64, seq_len=2048)
    assert args[4:8] == ["--decoder-first-pipeline-num-layers", "9", "--decoder-last-pipeline-num-layers", "9"]
    only_first = megatron_arguments(gpt3, pipeline([5, 13, 13, 13, 13, 13, 13, 13], tp=8), global_batch=64,
                                    seq_len=2048)
    assert only_first[4:6] == ["--decoder-first-pipeline-num-layers", "5"]
    assert "--decoder-last-pipeline-num-layers" not in only_first


def test_model_config_comes_from_the_spec() -> None:
    config = model_config_from_spec("llama?layers=4&hidden=256&heads=8&kv_heads=2")
    assert (config["family"], config["layers"], config["hidden"], config["kv_heads"]) == ("llama", 4, 256, 2)
    assert model_config_from_spec("gpt3-175b")["heads"] == 96
    assert model_config_from_spec(parse_model_spec("gpt3-175b")) == model_config_from_spec("gpt3-175b")
    with pytest.raises(ExportError, match=r"'graphs/model\.json' is not a zoo name"):
        model_config_from_spec("graphs/model.json")  # a graph file: its shape is not in the SPEC


@pytest.mark.parametrize(("change", "match"), [
    (lambda p: p.model_copy(update={"schedule": Schedule.GPIPE}), r"schedule 'gpipe' has no Megatron-LM equivalent"),
    (lambda p: all_stages(p, zero=3), r"zero=3 with pipeline-model-parallel-size 8: .*Megatron FSDP"),
    (lambda p: with_stage(p, 2, zero=1), r"stages use ZeRO stages \[0, 1\]"),
    (lambda p: with_stage(p, 3, tp=4, dp=2), r"stages\[3\]\.tp = 4 but stages\[0\]\.tp = 8"),
    (lambda p: with_stage(p, 1, recompute=True), r"stages \[1\] recompute but stages \[0, 2, .*same count on every"),
    (lambda p: swap_devices(p, 0, 1), r"pipeline rank 0 runs on devices \[8, .*ranks 0\.\.7"),
    (lambda p: with_stage(p, 4, sharding={"attn.q": "row"}), r"stages\[4\]\.sharding\['attn\.q'\] = row but .* column"),
])
def test_megatron_refuses_what_it_cannot_express(gpt3: ModelGraph, change: Any, match: str) -> None:
    plan = change(pipeline([12] * 8, tp=8))
    with pytest.raises(ExportError, match=match):
        megatron_arguments(gpt3, plan, global_batch=64, seq_len=2048)


@pytest.mark.parametrize(("zero", "strategy"), [(2, "optim_grads"), (3, "optim_grads_params")])
def test_megatron_runs_zero_2_and_3_on_one_stage_under_megatron_fsdp(gpt3: ModelGraph, tmp_path: Path, zero: int,
                                                                     strategy: str) -> None:
    plan = pipeline([96], tp=8, dp=4, micro_batches=4, zero=zero)
    args = megatron_arguments(gpt3, plan, global_batch=64, seq_len=2048)
    text = " ".join(args)
    assert f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}" in text
    for flag in ("--no-gradient-accumulation-fusion", "--use-distributed-optimizer", "--ckpt-format fsdp_dtensor",
                 "--overlap-grad-reduce", "--overlap-param-gather"):
        assert flag in text
    zero1 = " ".join(megatron_arguments(gpt3, all_stages(plan, zero=1), global_batch=64, seq_len=2048))
    assert "--use-megatron-fsdp" not in zero1 and "--ckpt-format" not in zero1
    launch = export("gpt3-175b", plan, tmp_path, fmt="megatron", seq_len=None, global_batch=64,
                    cluster=load_cluster("dgx-a100-80gb:nodes=4"))[1].read_text()
    # Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS != 1 under FSDP; the ZeRO-1 launcher sets it to 1
    assert "unset CUDA_DEVICE_MAX_CONNECTIONS" in launch and "CUDA_DEVICE_MAX_CONNECTIONS=1" not in launch


def test_megatron_refuses_uneven_shares_and_writes_any_split_as_a_layout(gpt3: ModelGraph) -> None:
    shares = with_stage(pipeline([24] * 4, tp=4, dp=2), 2, batch_shares=(0.6, 0.4))
    with pytest.raises(ExportError, match=r"stages\[2\]\.batch_shares = \[0\.6, 0\.4\] are uneven"):
        megatron_arguments(gpt3, shares, global_batch=128, seq_len=2048)
    middle = megatron_arguments(gpt3, pipeline([12, 11, 13, 12, 12, 12, 12, 12], tp=8), global_batch=64, seq_len=2048)
    layout = middle[middle.index("--pipeline-model-parallel-layout") + 1]
    assert layout == "Et*12|t*11|t*13|t*12|t*12|t*12|t*12|t*12L"
    assert "--decoder-first-pipeline-num-layers" not in middle
    empty_first = megatron_arguments(gpt3, pipeline([0, 16, 16, 16, 16, 16, 16], tp=8), global_batch=64,
                                     seq_len=2048)
    assert empty_first[empty_first.index("--pipeline-model-parallel-layout") + 1].startswith("E|t*16|")
    chunks = pipeline([11, 13, 12, 12, 12, 12, 12, 12], tp=8, groups=4, schedule="interleaved_1f1b")
    args = megatron_arguments(gpt3, chunks, global_batch=64, seq_len=2048)
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == "Et*11|t*13|t*12|t*12|t*12|t*12|t*12|t*12L"
    assert "--num-layers-per-virtual-pipeline-stage" not in args
    first_last = megatron_arguments(gpt3, pipeline([10, 12, 12, 12, 12, 12, 12, 14], tp=8), global_batch=64,
                                    seq_len=2048)
    assert " ".join(first_last).count("--decoder-first-pipeline-num-layers 10 --decoder-last-pipeline-num-layers 14")


def test_moe_adds_experts_and_a_single_stage_has_no_pipeline_flags() -> None:
    moe = load_model("moe?layers=4&hidden=256&heads=8&kv_heads=2&ffn=512&experts=4&top_k=1", seq_len=128)
    plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 6), devices=(0, 1, 2, 3), dp=2, tp=2),))
    args = megatron_arguments(moe, plan, global_batch=8, seq_len=128)
    assert args[:5] == ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
                        "--sequence-parallel"]
    text = " ".join(args)
    assert "--num-experts 4 --moe-router-topk 1" in text and "--num-query-groups 2" in text
    assert "--micro-batch-size 2" in text and "--overlap-grad-reduce" in text


def test_megatron_refuses_non_decoder_families() -> None:
    bert = load_model("bert-large")
    plan = Plan(stages=(Stage(layers=(0, len(bert.layers)), devices=(0,)),))
    with pytest.raises(ExportError, match=r"family 'bert' is not exported"):
        megatron_arguments(bert, plan, global_batch=8, seq_len=512)


# --- DeepSpeed ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_small() -> ModelGraph:
    return load_model("gpt3-125m")  # 14 layers: embedding, 12 blocks, head


def ds_plan(**stage_fields: Any) -> Plan:
    """PP=4, DP=2 over 8 devices, uneven boundaries [0, 4, 7, 11, 14], 8 micro-batches."""
    bounds = [0, 4, 7, 11, 14]
    stages = tuple(Stage(layers=(bounds[i], bounds[i + 1]), devices=(2 * i, 2 * i + 1), dp=2, **stage_fields)
                   for i in range(4))
    return Plan(micro_batches=8, schedule=Schedule.ONE_F_ONE_B, stages=stages)


def test_deepspeed_batch_arithmetic_and_partition(gpt_small: ModelGraph) -> None:
    plan = ds_plan(zero=1, recompute=True)
    config = deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 8
    assert config["train_batch_size"] == 64 == 4 * 8 * 2  # micro-batch * grad accumulation * dp
    assert config["zero_optimization"] == {"stage": 1, "overlap_comm": True}
    assert config["bf16"] == {"enabled": True}
    assert config["pipeline"] == {"stages": 4, "seed_layers": False, "activation_checkpoint_interval": 1}
    partition = deepspeed_partition(gpt_small, plan)
    assert partition["parts"] == [0, 4, 7, 11, 14]
    assert partition["layers"][0] == "embed" and partition["layers"][-1] == "head"
    assert partition["activation_checkpoint_interval"] == [1, 1, 1, 1]


@pytest.mark.parametrize(("plan", "match"), [
    (all_stages(ds_plan(), dp=1, tp=2), r"stages\[0\]\.tp = 2: .*needs Megatron-DeepSpeed"),
    (ds_plan(zero=2), r"zero=2 with 4 pipeline stages"),
    (ds_plan().model_copy(update={"schedule": Schedule.GPIPE}), r"gpipe"),
    (with_stage(ds_plan(), 1, batch_shares=(0.75, 0.25)), r"stages\[1\]\.batch_shares"),
    (with_stage(ds_plan(), 1, devices=(2, 3, 8, 9), dp=4), r"stages\[1\]\.dp = 4 but stages\[0\]\.dp = 2"),
])
def test_deepspeed_refuses_what_it_cannot_express(gpt_small: ModelGraph, plan: Plan, match: str) -> None:
    with pytest.raises(ExportError, match=match):
        deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)


def test_deepspeed_refuses_interleaving(gpt_small: ModelGraph) -> None:
    bounds = [0, 4, 7, 11, 14]
    stages = tuple(Stage(layers=(bounds[i], bounds[i + 1]), devices=(2 * (i % 2), 2 * (i % 2) + 1), dp=2)
                   for i in range(4))
    plan = Plan(micro_batches=8, schedule=Schedule.INTERLEAVED_1F1B, stages=stages)
    with pytest.raises(ExportError, match=r"interleaved_1f1b"):
        deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)


def test_single_stage_deepspeed_allows_zero3(gpt_small: ModelGraph) -> None:
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 14), devices=tuple(range(8)), dp=8, zero=3),))
    config = deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)
    assert config["zero_optimization"]["stage"] == 3 and "pipeline" not in config
    assert config["train_batch_size"] == 64 == 2 * 4 * 8


# --- the dispatcher -----------------------------------------------------------------------------


def test_export_megatron_writes_the_arguments_and_a_launcher(tmp_path: Path) -> None:
    plan = pipeline([12] * 8, tp=8, recompute=True)
    paths = export("gpt3-175b", plan, tmp_path / "out", fmt="megatron", seq_len=None, global_batch=1536)
    assert [p.name for p in paths] == ["megatron_args.txt", "launch.sh"]
    lines = paths[0].read_text().splitlines()
    assert lines[:3] == ["--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 8", "--sequence-parallel"]
    assert "--recompute-num-layers 1" in lines
    launch = paths[1].read_text()
    assert "pretrain_gpt.py" in launch and "$(cat \"$HERE/megatron_args.txt\")" in launch
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in launch
    assert os.access(paths[1], os.X_OK)


MIXED = "dgx-h100:nodes=2+dgx-a100-80gb:nodes=2"  # H100 devices 0-15, A100 16-31


def test_megatron_launches_the_nodes_in_the_plans_rank_order_on_a_cluster(tmp_path: Path) -> None:
    """Pipeline rank 0 on the last A100 node: without the cluster Megatron-LM (rank d = device d) would
    run it on device 0; with it, that node is launched as node rank 0 and the H100 nodes after."""
    plan = swap_devices(pipeline([24] * 4, tp=8), 0, 3)
    assert plan.stages[0].devices == tuple(range(24, 32))
    with pytest.raises(ExportError, match=r"pipeline rank 0 runs on devices \[24, .*--cluster"):
        megatron_arguments(load_model("gpt3-175b"), plan, global_batch=64, seq_len=2048)
    paths = export("gpt3-175b", plan, tmp_path, fmt="megatron", seq_len=None, global_batch=64,
                   cluster=load_cluster(MIXED))
    assert [p.name for p in paths] == ["megatron_args.txt", *(f"launch_node{k}.sh" for k in range(4)), "ranks.json"]
    table = json.loads(paths[-1].read_text())
    assert [row["device"] for row in table] == [*range(24, 32), *range(8, 24), *range(8)]
    assert [table[8 * k]["node"] for k in range(4)] == ["dgx-a100-80gb-1", "dgx-h100-1", "dgx-a100-80gb-0",
                                                       "dgx-h100-0"]
    first = paths[1].read_text()
    assert "--nnodes 4 --node-rank 0 --nproc-per-node 8" in first and "8 x A100-SXM-80GB" in first
    assert "pretrain_gpt.py" in first and "$(cat megatron_args.txt)" in first
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in first and "export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in first
    assert "world ranks 24..31" in paths[4].read_text() and "H100" in paths[4].read_text()
    assert os.access(paths[1], os.X_OK)
    for script in paths[1:5]:  # valid bash
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_a_new_export_leaves_no_launch_file_of_an_earlier_plan(tmp_path: Path) -> None:
    """A 4-node plan's launch_node3.sh left beside a 1-node plan's launch script would start a rank it lacks."""
    (tmp_path / "hostfile").write_text("mine slots=8\n")  # a user's own: no export wrote it
    four = swap_devices(pipeline([24] * 4, tp=8), 0, 3)
    export("gpt3-175b", four, tmp_path, fmt="megatron", seq_len=None, global_batch=64, cluster=load_cluster(MIXED))
    export("gpt3-175b", pipeline([12] * 8, tp=8, recompute=True), tmp_path, fmt="megatron", seq_len=None,
           global_batch=1536)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tagplan-launch", "hostfile", "launch.sh",
                                                         "megatron_args.txt"]
    assert (tmp_path / "hostfile").read_text() == "mine slots=8\n"
    planted = tmp_path / "elsewhere"
    (tmp_path / ".tagplan-launch").unlink()
    (tmp_path / ".tagplan-launch").symlink_to(planted)  # a link to a file that does not exist yet
    export("gpt3-175b", pipeline([12] * 8, tp=8, recompute=True), tmp_path, fmt="megatron", seq_len=None,
           global_batch=1536)
    assert not planted.exists() and not (tmp_path / ".tagplan-launch").is_symlink()  # never written through


def test_heads_that_do_not_divide_the_hidden_size_write_their_width() -> None:
    """gpt3-1.3b: 24 heads of 2048 // 24 = 85; Megatron-LM asserts hidden % heads == 0 unless --kv-channels."""
    args = megatron_arguments(load_model("gpt3-1.3b"), pipeline([24], tp=1), global_batch=64, seq_len=2048)
    assert args[args.index("--kv-channels") + 1] == "85"
    even = megatron_arguments(load_model("gpt3-2.7b"), pipeline([32], tp=1), global_batch=64, seq_len=2048)
    assert "--kv-channels" not in even
    family = megatron_arguments(load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16),
                                pipeline([2], tp=1, micro_batches=1), global_batch=8, seq_len=16)
    assert "--kv-channels" not in family  # head_dim unset: derived as hidden // heads, as Megatron-LM derives it


def test_an_interleaved_plan_launches_its_first_chunks_node_first_on_a_cluster(tmp_path: Path) -> None:
    """Interleaved 1F1B on the mixed cluster with pipeline rank 0 on the last A100 node: every chunk of
    a rank stays on its rank's node, so the launch order is that of the first chunks' groups."""
    plan = pipeline([10] * 8, tp=8, groups=4, schedule="interleaved_1f1b", micro_batches=16)
    order = (3, 1, 2, 0)  # pipeline rank p runs on node order[p] (8 GPUs each)
    plan = plan.model_copy(update={"stages": tuple(
        s.model_copy(update={"devices": tuple(range(8 * order[i % 4], 8 * order[i % 4] + 8))})
        for i, s in enumerate(plan.stages))})
    paths = export("llama2-70b", plan, tmp_path, fmt="megatron", seq_len=4096, global_batch=16,
                   cluster=load_cluster(MIXED))
    args = paths[0].read_text()
    assert "--num-layers-per-virtual-pipeline-stage 10" in args and "--pipeline-model-parallel-size 4" in args
    table = json.loads(paths[-1].read_text())
    assert [row["device"] for row in table] == [d for k in order for d in range(8 * k, 8 * k + 8)]
    assert [table[8 * p]["node"] for p in range(4)] == ["dgx-a100-80gb-1", "dgx-h100-1", "dgx-a100-80gb-0",
                                                       "dgx-h100-0"]
    # the launch relies on every chunk of a rank sharing its group: a plan that does not is no plan
    with pytest.raises(ValueError, match="round-robin"):
        with_stage(plan, 4, devices=tuple(range(8)))


def test_megatron_pins_a_part_node_plans_gpus_and_refuses_a_node_split_across_ranks(tmp_path: Path) -> None:
    # two stages of tp 4 on the upper halves of two nodes: local ranks 0-3 run GPUs 4-7
    halves = Plan(micro_batches=8, stages=(
        Stage(layers=(0, 50), devices=(12, 13, 14, 15), tp=4), Stage(layers=(50, 98), devices=(4, 5, 6, 7), tp=4)))
    paths = export("gpt3-175b", halves, tmp_path, fmt="megatron", seq_len=None, global_batch=64,
                   cluster=load_cluster("dgx-a100-80gb:nodes=2"))
    assert "export CUDA_VISIBLE_DEVICES=4,5,6,7" in paths[1].read_text()
    assert "--nnodes 2 --node-rank 0 --nproc-per-node 4" in paths[1].read_text()
    # node 0's devices would hold world ranks 0-3 and 8-11 with node 1's between them
    split = Plan(micro_batches=8, stages=(
        Stage(layers=(0, 33), devices=(0, 1, 2, 3), tp=4), Stage(layers=(33, 66), devices=(8, 9, 10, 11), tp=4),
        Stage(layers=(66, 98), devices=(4, 5, 6, 7), tp=4)))
    with pytest.raises(ExportError, match=r"world ranks 0 \(device 0\) and 8 \(device 4\) on node 'dgx-a100-80gb-0'"):
        megatron_arguments(load_model("gpt3-175b"), split, global_batch=64, seq_len=2048,
                           cluster=load_cluster("dgx-a100-80gb:nodes=2"))


def test_deepspeed_writes_a_hostfile_in_the_plans_rank_order(tmp_path: Path) -> None:
    cluster = load_cluster("p3.8xlarge:nodes=2")  # two nodes of 4 V100
    plan = Plan(micro_batches=8, stages=(Stage(layers=(0, 7), devices=(4, 5, 6, 7), dp=4),
                                         Stage(layers=(7, 14), devices=(0, 1, 2, 3), dp=4)))
    with pytest.raises(ExportError, match=r"pipeline rank 0 runs on devices \[4, 5, 6, 7\]"):
        export("gpt3-125m", plan, tmp_path / "no", fmt="deepspeed", seq_len=None, global_batch=64)
    paths = export("gpt3-125m", plan, tmp_path, fmt="deepspeed", seq_len=None, global_batch=64, cluster=cluster)
    assert [p.name for p in paths] == ["ds_config.json", "partition.json", "hostfile"]
    assert paths[2].read_text() == "p3.8xlarge-1 slots=4\np3.8xlarge-0 slots=4\n"
    launch = json.loads(paths[1].read_text())["launch"]
    assert launch["include"] == "p3.8xlarge-1:0,1,2,3@p3.8xlarge-0:0,1,2,3"
    assert [row["device"] for row in launch["ranks"]] == [4, 5, 6, 7, 0, 1, 2, 3]
    # on part of a node the hostfile still gives the node's GPU count: --include picks among its slots
    half = Plan(micro_batches=8, stages=(Stage(layers=(0, 7), devices=(6, 7), dp=2),
                                         Stage(layers=(7, 14), devices=(2, 3), dp=2)))
    part = export("gpt3-125m", half, tmp_path / "half", fmt="deepspeed", seq_len=None, global_batch=64,
                  cluster=cluster)
    assert part[2].read_text() == "p3.8xlarge-1 slots=4\np3.8xlarge-0 slots=4\n"
    assert json.loads(part[1].read_text())["launch"]["include"] == "p3.8xlarge-1:2,3@p3.8xlarge-0:2,3"
    # DeepSpeed's launcher hands a node's ranks to its GPUs in ascending order
    backwards = plan.model_copy(update={"stages": (plan.stages[0].model_copy(update={"devices": (7, 6, 5, 4)}),
                                                   plan.stages[1])})
    with pytest.raises(ExportError, match=r"node 'p3.8xlarge-1' runs devices \[7, 6, 5, 4\]"):
        export("gpt3-125m", backwards, tmp_path / "b", fmt="deepspeed", seq_len=None, global_batch=64,
               cluster=cluster)


def test_export_deepspeed_writes_config_and_partition(tmp_path: Path) -> None:
    paths = export("gpt3-125m", ds_plan(), tmp_path, fmt="deepspeed", seq_len=None, global_batch=64)
    assert [p.name for p in paths] == ["ds_config.json", "partition.json"]
    assert json.loads(paths[0].read_text())["train_batch_size"] == 64
    assert json.loads(paths[1].read_text())["parts"] == [0, 4, 7, 11, 14]


def test_export_refusals_are_spec_errors_and_write_nothing(tmp_path: Path) -> None:
    plan = pipeline([12] * 8, tp=8).model_copy(update={"schedule": Schedule.GPIPE})
    with pytest.raises(SpecError, match=r"^megatron: schedule 'gpipe'"):
        export("gpt3-175b", plan, tmp_path / "out", fmt="megatron", seq_len=None, global_batch=64)
    assert not (tmp_path / "out").exists()


def test_export_checks_the_plan_against_the_model(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"plan covers layers \[0, 98\) but model 'gpt3-125m' has 14 layers"):
        export("gpt3-125m", pipeline([12] * 8, tp=8), tmp_path, fmt="megatron", seq_len=None, global_batch=64)
    with pytest.raises(SpecError, match=r"unknown export format 'onnx'"):
        export("gpt3-125m", ds_plan(), tmp_path, fmt="onnx", seq_len=None, global_batch=64)  # type: ignore[arg-type]


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, tagplan.export; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_refusals_are_one_class_and_the_checks_import_no_other_export_module() -> None:
    from tagplan.export import checks, torch_program

    assert torch_program.ExportError is checks.ExportError is ExportError and issubclass(ExportError, SpecError)
    tree = ast.parse(Path(checks.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("tagplan.export")], imported


def test_megatron_fsdp_zero3_always_overlaps_its_gathers(gpt3: ModelGraph) -> None:
    """The simulator costs ZeRO-3's per-layer gathers prefetched under compute whatever the reduction
    overlap says, so the export overlaps them too (as DeepSpeed's overlap_comm); ZeRO-2 follows the setting."""
    plan = pipeline([96], tp=8, dp=4, micro_batches=4, zero=3)
    args = megatron_arguments(gpt3, plan, global_batch=64, seq_len=2048, grad_reduce_overlap=False)
    assert "--overlap-param-gather" in args and "--overlap-grad-reduce" in args
    zero2 = megatron_arguments(gpt3, all_stages(plan, zero=2), global_batch=64, seq_len=2048,
                               grad_reduce_overlap=False)
    assert "--overlap-param-gather" not in zero2 and "--overlap-grad-reduce" not in zero2
    said = megatron_grad_reduce(plan, DType.BF16, grad_reduce_overlap=False)
    assert said.overlap is True and "faster than predicted" in said.notes[0]  # the run differs from the costing
    assert megatron_grad_reduce(all_stages(plan, zero=2), DType.BF16, grad_reduce_dtype=DType.FP32,
                                grad_reduce_overlap=False).notes == ()
    default = megatron_grad_reduce(all_stages(plan, zero=2), DType.BF16, grad_reduce_overlap=False)
    assert default.dtype is DType.FP32 and default.notes == (  # plan and simulate cost the default in bf16
        "the plan was costed with gradients reduced in bf16 (the default: the training dtype); megatron reduces "
        "them in fp32, 2x the bytes: slower than predicted where the reduction is exposed. Export with "
        "--grad-reduce-dtype bf16 to write the flag that reduces in the training dtype, or cost the plan with "
        "--grad-reduce-dtype fp32",)
    in_bf16 = megatron_grad_reduce(all_stages(plan, zero=2), DType.BF16, grad_reduce_dtype=DType.BF16,
                                   grad_reduce_overlap=False)
    assert in_bf16.notes == () and "--grad-reduce-in-bf16" in in_bf16.written


def test_tp_comm_overlap_is_written_for_megatron_where_tp_splits_the_model(gpt3: ModelGraph) -> None:
    plan = pipeline([12] * 8, tp=8)
    args = megatron_arguments(gpt3, plan, global_batch=1536, seq_len=2048, tp_comm_overlap=True)
    assert args[:4] == ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8"]
    assert args.index("--tp-comm-overlap") == args.index("--sequence-parallel") + 1  # Megatron needs both
    assert "--tp-comm-overlap" not in megatron_arguments(gpt3, plan, global_batch=1536, seq_len=2048)
    one = pipeline([12] * 8, tp=1)  # no TP collectives: nothing to overlap, nothing written
    assert "--tp-comm-overlap" not in megatron_arguments(gpt3, one, global_batch=1536, seq_len=2048,
                                                         tp_comm_overlap=True)


def test_tp_comm_overlap_exports_everywhere_and_notes_the_runtimes_that_run_it_exposed(tmp_path: Path) -> None:
    tp2 = pipeline([12], tp=2, dp=1, micro_batches=4)  # gpt3-125m: 12 blocks on one stage of tp 2
    paths = export("gpt3-125m", tp2, tmp_path / "m", fmt="megatron", seq_len=None, global_batch=64,
                   tp_comm_overlap=True)
    assert "--tp-comm-overlap" in paths[0].read_text().splitlines()
    assert tp_comm_settings(tp2, fmt="megatron", tp_comm_overlap=True) == {"overlapped": True, "notes": []}
    # the torch program runs TP collectives exposed: it exports (as gradient reductions it cannot
    # overlap), and the note says the run will be slower than predicted
    export("gpt3-125m", tp2, tmp_path / "t", fmt="torch", seq_len=None, global_batch=64, tp_comm_overlap=True)
    torch_run = tp_comm_settings(tp2, fmt="torch", tp_comm_overlap=True)
    note, = torch_run["notes"]
    assert torch_run["overlapped"] is False
    assert "torch runtime runs them exposed" in note and "slower than predicted" in note
    assert tp_comm_settings(tp2, fmt="torch", tp_comm_overlap=False) == {"overlapped": False, "notes": []}
    assert tp_comm_settings(tp2, fmt="megatron", tp_comm_overlap=False) == {"overlapped": False, "notes": []}
    no_tp = {"overlapped": False, "notes": []}  # without TP nothing is written and nothing differs
    assert tp_comm_settings(ds_plan(), fmt="deepspeed", tp_comm_overlap=True) == no_tp


def test_tp_comm_overlap_is_refused_where_transformer_engines_userbuffers_cannot_run() -> None:
    """Userbuffers need each TP group inside one NVLink/NVSwitch node of sm80+ GPUs; `exportable` asks it
    for plans costed with the overlap (what `plan --exportable megatron --tp-comm-overlap` searches)."""
    from tagplan.export import exportable
    from tagplan.export.megatron import tp_overlap_refusal

    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    inside = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), tp=4),))
    across = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(6, 7, 8, 9), tp=4),))
    assert tp_overlap_refusal(inside, load_cluster("dgx-a100-80gb:nodes=2")) is None
    assert "spans nodes" in (tp_overlap_refusal(across, load_cluster("dgx-a100-80gb:nodes=2")) or "")
    assert "over pcie" in (tp_overlap_refusal(inside, load_cluster("rtx4090x4")) or "")
    assert "older than sm80" in (tp_overlap_refusal(inside, load_cluster("p3.8xlarge")) or "")
    v100 = load_cluster("p3.8xlarge")
    assert exportable(inside, "megatron", model, global_batch=8, cluster=v100) is None
    assert "older than sm80" in (exportable(inside, "megatron", model, global_batch=8, cluster=v100,
                                            tp_comm_overlap=True) or "")
    assert exportable(inside, "megatron", model, global_batch=8, cluster=load_cluster("dgx-h100"),
                      tp_comm_overlap=True) is None
    # the plan alone (no model) is checked too; a device the cluster lacks is named, not an IndexError
    assert "older than sm80" in (exportable(inside, "megatron", cluster=v100, tp_comm_overlap=True) or "")
    far = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 9), dp=2),))
    assert "devices [9] are not in cluster" in (exportable(far, "deepspeed", cluster=v100) or "")


def test_tp_comm_overlap_judges_each_pair_of_a_group_by_its_own_link() -> None:
    """A node's pair links override its fabric: NVLink-bridged GPUs of a PCIe node qualify, a pair the
    bridge does not join is named; a PCIe pair inside an NVLink node refuses the group that holds it."""
    from tagplan.export.megatron import tp_overlap_refusal
    from tagplan.ir.cluster import LinkKind, PairLink

    bridged = load_cluster("rtx4090x4")
    node = bridged.nodes[0]
    bridge = PairLink(a=0, b=1, kind=LinkKind.NVLINK, bandwidth_Bps=50e9, latency_s=2e-6)
    bridged = bridged.model_copy(update={"nodes": (node.model_copy(update={"pair_links": (bridge,)}),)})
    pair = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2),))
    other = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(1, 2), tp=2),))
    assert tp_overlap_refusal(pair, bridged) is None
    assert "GPUs 1 and 2 meet over pcie" in (tp_overlap_refusal(other, bridged) or "")
    assert "GPUs 0 and 1 meet over pcie" in (tp_overlap_refusal(pair, load_cluster("rtx4090x4")) or "")
    dgx = load_cluster("dgx-a100-80gb")
    slow = PairLink(a=2, b=3, kind=LinkKind.PCIE, bandwidth_Bps=16e9, latency_s=5e-6)
    holed = dgx.model_copy(update={"nodes": (dgx.nodes[0].model_copy(update={"pair_links": (slow,)}),)})
    four = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), tp=4),))
    assert tp_overlap_refusal(four, dgx) is None
    assert "GPUs 2 and 3 meet over pcie" in (tp_overlap_refusal(four, holed) or "")


# --- partial recomputation (Stage.recompute_layers) ----------------------------------------------------


def test_a_partial_recompute_is_megatrons_block_method(gpt3: ModelGraph) -> None:
    plan = pipeline([12] * 8, tp=8, recompute=True, recompute_layers=3)
    args = megatron_arguments(gpt3, plan, global_batch=1536, seq_len=2048)
    i = args.index("--recompute-granularity")
    assert args[i:i + 6] == ["--recompute-granularity", "full", "--recompute-method", "block",
                             "--recompute-num-layers", "3"]


def test_megatron_refuses_partial_counts_it_cannot_write(gpt3: ModelGraph) -> None:
    uneven = with_stage(pipeline([12] * 8, tp=8, recompute=True, recompute_layers=3), 2, recompute_layers=4)
    with pytest.raises(ExportError, match=r"stages recompute \[3, 4\] layers; .*same number of layers on every"):
        megatron_arguments(gpt3, uneven, global_batch=1536, seq_len=2048)
    full_beside = with_stage(pipeline([12] * 8, tp=8, recompute=True, recompute_layers=3), 2, recompute_layers=None)
    with pytest.raises(ExportError, match=r"stages\[2\] recomputes all its 12 layers but other stages 3"):
        megatron_arguments(gpt3, full_beside, global_batch=1536, seq_len=2048)
    # a stage holding no more than N blocks recomputes them all under --recompute-num-layers N: that one is written
    short = pipeline([14, 10], tp=8, micro_batches=8, recompute=True)
    short = with_stage(short, 0, recompute_layers=10)
    model = load_model("gpt?layers=24&hidden=1024&heads=16&vocab=1000", seq_len=128)
    args = megatron_arguments(model, short, global_batch=8, seq_len=128)
    assert args[args.index("--recompute-method") + 1:args.index("--recompute-method") + 4] == [
        "block", "--recompute-num-layers", "10"]


def test_deepspeed_refuses_a_partial_recompute(gpt_small: ModelGraph) -> None:
    plan = ds_plan(zero=1, recompute=True, recompute_layers=1)
    with pytest.raises(ExportError, match=r"stages \[0, 1, 2, 3\] recompute only some of their layers.*"
                                          r"activation_checkpoint_interval"):
        deepspeed_config(gpt_small, plan, global_batch=64, seq_len=2048)


def test_a_stage_naming_all_its_blocks_is_full_recompute_for_megatron() -> None:
    """Stages recomputing 6 of 20 and 4 of 4 blocks: --recompute-num-layers 6 recomputes exactly that."""
    model = load_model("gpt?layers=24&hidden=1024&heads=16&vocab=1000", seq_len=128)
    plan = with_stage(with_stage(pipeline([20, 4], tp=8, micro_batches=8, recompute=True), 0, recompute_layers=6),
                      1, recompute_layers=4)
    args = megatron_arguments(model, plan, global_batch=8, seq_len=128)
    i = args.index("--recompute-method")
    assert args[i:i + 4] == ["--recompute-method", "block", "--recompute-num-layers", "6"]
    five = with_stage(plan, 1, recompute_layers=3)  # 3 of 4 is not what N=6 does on that stage
    with pytest.raises(ExportError, match=r"stages recompute \[3, 6\] layers"):
        megatron_arguments(model, five, global_batch=8, seq_len=128)
