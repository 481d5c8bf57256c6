"""What the simulator refuses to cost: a plan no runtime runs as written is an error naming the field, not a figure."""

from __future__ import annotations

import pytest

from tagplan.cost.sharding import accepted_strategies
from tagplan.cost.simulator import Simulator
from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import OpKind
from tagplan.ir.plan import Plan, ShardStrategy, Stage
from tagplan.ir.workload import Workload

MODEL = "gpt?layers=2&hidden=64&heads=4&vocab=100"


def _simulate(plan: Plan, seq_len: int = 64) -> float:
    sim = Simulator(load_model(MODEL, seq_len=seq_len), load_cluster("p3.8xlarge"),
                    Workload(global_batch=8, seq_len=seq_len))
    return sim.simulate(plan).iteration_time_s


def _one_stage(**stage: object) -> Plan:
    return Plan(micro_batches=1, stages=(Stage(layers=(0, 4), devices=(0, 1), **stage),))  # type: ignore[arg-type]


def test_a_sharding_that_names_no_op_or_a_strategy_its_op_does_not_take_is_refused() -> None:
    assert _simulate(_one_stage(tp=2, sharding={"mlp.fc1": "column", "attn.sdpa": "replicate"})) > 0
    with pytest.raises(SpecError, match=r"stages\[0\]\.sharding names op 'attn\.Q', which no layer of the model "
                                        r"has \(its ops: .*attn\.q"):
        _simulate(_one_stage(tp=2, sharding={"attn.Q": "column"}))
    shared = {"attn.q": "column", "final_norm": "replicate", "wte": "replicate"}  # one dict for every stage
    two = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2, sharding=shared),
                                        Stage(layers=(2, 4), devices=(2, 3), tp=2, sharding=shared)))
    assert _simulate(two) > 0
    with pytest.raises(SpecError, match=r"stages\[0\]\.sharding\['mlp\.fc1'\] = 'experts' is not accepted for a "
                                        r"matmul op; accepted: column, row, sequence, replicate, batch"):
        _simulate(_one_stage(tp=2, sharding={"mlp.fc1": "experts"}))
    with pytest.raises(SpecError, match=r"'attn\.sdpa'\] = 'column' is not accepted for a attention op"):
        _simulate(_one_stage(tp=2, sharding={"attn.sdpa": "column"}))


def test_an_expert_bank_takes_the_experts_split_and_a_dense_matmul_does_not() -> None:
    moe = load_model("moe?layers=1&hidden=64&heads=4&kv_heads=2&vocab=100&experts=4&top_k=2&ffn=128", seq_len=16)
    ops = {op.name: op for block in moe.blocks for op in block.ops}
    assert ShardStrategy.EXPERTS in accepted_strategies(ops["experts.up"])
    assert ShardStrategy.EXPERTS not in accepted_strategies(ops["attn.q"])
    assert ops["attn.sdpa"].kind is OpKind.ATTENTION
    assert accepted_strategies(ops["attn.sdpa"]) == (ShardStrategy.HEADS, ShardStrategy.REPLICATE)


def test_context_parallelism_must_split_the_tokens_whole() -> None:
    assert _simulate(_one_stage(cp=2), seq_len=64) > 0
    with pytest.raises(SpecError, match=r"stages\[0\]\.cp = 2 does not divide the 63 tokens per sample"):
        _simulate(_one_stage(cp=2), seq_len=63)
