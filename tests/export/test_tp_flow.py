"""How the torch program's matmuls hand tensors on (tagplan.export.tp_flow), and which plans it takes."""

from __future__ import annotations

import pytest

from tagplan.cost.sharding import Layout
from tagplan.export import ExportError
from tagplan.export.shapes import model_config
from tagplan.export.torch_checks import check_expressible, tied_split_alike
from tagplan.export.tp_flow import ExpertsFlow, Flow, block_flow, experts_flow, experts_strategy, head_flow, loss_split
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Stage

R, H, S = Layout.R, Layout.H, Layout.S
GPT = "gpt?layers=2&hidden=64&heads=4&vocab=128&max_positions=16"
MEGATRON = {"attn.q": "column", "attn.k": "column", "attn.v": "column", "attn.o": "row",
            "mlp.fc1": "column", "mlp.fc2": "row"}


def test_megatrons_layout_gathers_the_stream_once_per_module_and_hands_it_back_split() -> None:
    flow = block_flow("gpt", MEGATRON, sp=True)
    assert flow.gathers == {"attn": True, "mlp": True}
    assert flow.flows["attn.q"] == Flow(R, H) and flow.flows["attn.o"] == Flow(H, S)
    assert flow.flows["mlp.fc1"] == Flow(R, H) and flow.flows["mlp.fc2"] == Flow(H, S)
    plain = block_flow("gpt", MEGATRON, sp=False)
    assert plain.gathers == {"attn": False, "mlp": False} and plain.flows["mlp.fc2"] == Flow(H, R)


def test_a_token_split_mlp_reads_its_part_of_the_stream_without_gathering() -> None:
    flow = block_flow("gpt", {**MEGATRON, "attn.o": "sequence", "mlp.fc1": "sequence", "mlp.fc2": "sequence"}, sp=True)
    assert flow.gathers == {"attn": True, "mlp": False}
    assert flow.flows["attn.o"] == Flow(H, S)  # heads in (an all-to-all to tokens), the stream's part out
    assert flow.flows["mlp.fc1"] == Flow(S, S) and flow.flows["mlp.fc2"] == Flow(S, S)
    mixed = block_flow("gpt", {**MEGATRON, "mlp.fc1": "sequence"}, sp=True)  # fc2 row needs the hidden split
    assert mixed.flows["mlp.fc1"] == Flow(S, H) and mixed.gathers["mlp"] is False


def test_llama_gate_and_up_hand_down_what_it_needs_and_replicated_attention_gets_whole_tensors() -> None:
    strategies = {"attn.q": "column", "attn.k": "column", "attn.v": "column", "attn.sdpa": "replicate",
                  "attn.o": "replicate", "mlp.gate": "sequence", "mlp.up": "column", "mlp.down": "sequence"}
    flow = block_flow("llama", strategies, sp=True)
    assert flow.flows["attn.q"] == Flow(R, R) and flow.flows["attn.o"] == Flow(R, S)
    assert flow.flows["mlp.gate"] == Flow(R, S) == flow.flows["mlp.up"]  # up gathered because of column
    assert flow.flows["mlp.down"] == Flow(S, S) and flow.gathers["mlp"] is True
    # a column head keeps its part of the vocabulary, a token-split head its tokens; others hand on whole logits
    assert head_flow("column", sp=True) == Flow(S, H) and head_flow("sequence", sp=False) == Flow(R, S)
    # a row head's partial sums are reduce-scattered over the tokens, as cost.sharding.loss_layout charges
    assert head_flow("row", sp=True) == Flow(S, S) and head_flow("replicate", sp=False) == Flow(R, R)
    assert loss_split("llama", "column", 2) == "vocab" and loss_split("gpt", "sequence", 4) == "tokens"
    assert loss_split("llama", "column", 1) is None and loss_split("hf", "column", 2) is None
    assert loss_split("gpt", "row", 2) == "tokens" and loss_split("gpt", "replicate", 2) is None


def test_the_program_takes_token_split_matmuls_of_gpt_and_llama_but_not_batch_split_ones() -> None:
    model = load_model(GPT, seq_len=16)
    ok = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2,
                            sharding={"attn.o": "sequence", "mlp.fc1": "sequence", "lm_head.tied": "sequence"}),))
    check_expressible(ok, model, config=model_config(GPT, seq_len=16))
    bad = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2, sharding={"mlp.fc1": "batch"}),))
    with pytest.raises(ExportError, match=r"stages\[0\]\.sharding\['mlp\.fc1'\]='batch'"):
        check_expressible(bad, model)


@pytest.mark.parametrize(("wte", "head", "alike"), [("row", "column", True), ("column", "row", True),
                                                     ("column", "column", False), ("row", "row", False),
                                                     ("sequence", "replicate", True), ("row", "sequence", False)])
def test_tied_copies_are_alike_when_their_pieces_match(wte: str, head: str, alike: bool) -> None:
    model = load_model(GPT, seq_len=16)
    plan = Plan(stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2, sharding={"wte": wte}),
                        Stage(layers=(2, 4), devices=(2, 3), tp=2, sharding={"lm_head.tied": head})))
    assert tied_split_alike(plan, model) is alike
    check_expressible(plan, model)  # either way the program runs it (unalike copies sum whole tables)


def test_tied_copies_on_unequal_tp_are_unalike_and_without_tp_alike() -> None:
    model = load_model(GPT, seq_len=16)
    uneven = Plan(stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2), Stage(layers=(2, 4), devices=(2,))))
    assert not tied_split_alike(uneven, model)
    assert tied_split_alike(Plan(stages=(Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,)))),
                            model)


def test_moe_experts_split_their_ffn_or_run_whole_and_the_router_hands_on_logits_in_its_layout() -> None:
    split = {"router": "sequence", "experts.gate": "column", "experts.up": "column", "experts.down": "row"}
    assert experts_strategy(split) == "split"
    # every token through this rank's FFN pieces: tokens and logits made whole, the output reduced into the stream
    assert experts_flow(split, sp=True) == ExpertsFlow(tokens=S, logits=S, runs=R, split=True, departs=S)
    assert experts_flow({**split, "router": "column"}, sp=False) == ExpertsFlow(R, R, R, True, R)
    whole = {"experts.gate": "sequence", "experts.up": "sequence", "experts.down": "sequence"}
    assert experts_strategy(whole) == "sequence"
    assert experts_flow(whole, sp=False) == ExpertsFlow(tokens=R, logits=R, runs=S, split=False, departs=R)
    assert experts_strategy({}) == "replicate"  # missing ops are replicated
    mixes = ({**whole, "experts.up": "column"}, dict.fromkeys(whole, "experts"), {**split, "experts.down": "column"})
    for mixed in mixes:
        assert experts_strategy(mixed) is None
        with pytest.raises(ValueError, match="are not"):
            experts_flow(mixed, sp=True)
    flow = block_flow("moe", split, sp=True)
    assert flow.flows["router"] == Flow(S, S) and flow.gathers["mlp"] is False  # the experts convert for themselves
    assert "experts.gate" not in flow.flows and flow.flows["attn.q"] == Flow(R, H)
