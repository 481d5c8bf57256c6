"""Traced models mark an op that reads the first layer's table (a tied head) in `Op.shared_param_bytes`:
Hugging Face configs and users' modules alike, block hashes unchanged, and the cost model keeps the copy."""

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional

from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.torch_export import graph_from_module
from tagplan.frontends.tracing import blocks as tracing_blocks
from tagplan.frontends.user_module import fold_trace
from tagplan.ir import DType, ModelGraph, Plan, Stage, Workload

SEQ, VOCAB, HIDDEN = 16, 100, 64
TABLE = VOCAB * HIDDEN  # parameters of the token embedding
BF16 = DType.BF16.nbytes
GPT2 = f"hf:GPT2Config?n_layer=2&n_embd={HIDDEN}&n_head=4&vocab_size={VOCAB}&n_positions=64"


@functools.cache
def gpt2(tied: bool) -> ModelGraph:
    """A 2-block GPT-2 (embed, h.0, h.1, head) traced from its config, head tied or not."""
    return load_model(f"{GPT2}&tie_word_embeddings={str(tied).lower()}", seq_len=SEQ)


def marked(g: ModelGraph) -> list[tuple[int, str, float]]:
    """(layer index, op name, shared_param_bytes) of every op that carries shared parameter bytes."""
    return [
        (i, op.name, op.shared_param_bytes)
        for i in range(len(g.layers))
        for op in g.block_of(i).ops
        if op.shared_param_bytes
    ]


def test_a_traced_tied_gpt2_head_carries_the_embedding_table_and_an_untied_one_nothing() -> None:
    tied, untied = gpt2(True), gpt2(False)
    assert [layer.name for layer in tied.layers] == ["embed", "h.0", "h.1", "head"]
    assert marked(tied) == [(3, "lm_head.linear", TABLE * BF16)]
    assert marked(untied) == []
    # the table is still owned (and counted) once, by the embedding; the head owns only its final norm
    wte = next(op for op in tied.block_of(0).ops if op.name == "transformer.wte.embedding")
    assert wte.param_bytes == TABLE * BF16
    assert tied.block_of(0).params == (VOCAB + 64) * HIDDEN  # token and position tables
    assert tied.block_of(3).param_bytes == 2 * HIDDEN * BF16
    assert untied.params - tied.params == TABLE


def test_marking_changes_no_block_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same trace with the marking switched off: equal layers and hashes, equal graphs but the field."""
    tied = gpt2(True)
    monkeypatch.setattr(tracing_blocks, "first_layer_params", lambda groups: frozenset())
    plain = load_model(f"{GPT2}&tie_word_embeddings=true", seq_len=SEQ)
    assert marked(plain) == [] and marked(tied) != []
    assert [b.hash for b in plain.blocks] == [b.hash for b in tied.blocks]
    assert plain.layers == tied.layers

    def zeroed(g: ModelGraph) -> dict[str, object]:
        dumped = g.model_dump()
        for block in dumped["blocks"]:
            for op in block["ops"]:
                op["shared_param_bytes"] = 0.0
        return dumped

    assert zeroed(plain) == zeroed(tied)


class Block(nn.Module):
    """A residual MLP block; `shared` is a weight another module owns, when given."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, shared: torch.Tensor | None = None) -> torch.Tensor:  # x: [b, s, dim]
        x = x + torch.relu(self.fc(x))
        return x if shared is None else functional.linear(x, shared)


class TiedLM(nn.Module):
    """A user's language model whose head reuses the embedding's weight; with `share_later`, every block
    also multiplies by the first block's weight (a parameter shared between later layers)."""

    def __init__(self, depth: int = 6, share_later: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN) for _ in range(depth))
        self.norm = nn.LayerNorm(HIDDEN)
        self.share_later = share_later

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s]
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.blocks[0].fc.weight if self.share_later else None)
        return functional.linear(self.norm(x), self.embed.weight)  # [b, s, vocab]


def trace_user(module: nn.Module, *, fold: bool = True) -> ModelGraph:
    """`module` traced as the user-module SPECs trace it (folding, runs split where their dataflow does)."""
    with torch.device("meta"):
        module = module.to("meta")
        ids = torch.zeros(2, SEQ, dtype=torch.long)
    return fold_trace(module, (ids,), {}, name="tied-lm", seq_len=SEQ, dtype=DType.BF16, fold=fold)


def test_a_user_module_whose_head_reuses_the_embedding_weight_marks_the_head() -> None:
    g = trace_user(TiedLM())
    assert [layer.name for layer in g.layers] == ["embed", *(f"blocks.{i}" for i in range(6)), "head"]
    assert marked(g) == [(7, "linear", TABLE * BF16)]
    assert g.block_of(0).params == TABLE
    assert g.model_dump() == trace_user(TiedLM(), fold=False).model_dump()  # the folded graph keeps the mark


def test_a_parameter_shared_between_later_layers_is_not_marked() -> None:
    """Only the first layer's parameters count; the first block owns its weight and the others read it free."""
    with torch.device("meta"):
        g = graph_from_module(
            TiedLM(depth=2, share_later=True),
            (torch.zeros(2, SEQ, dtype=torch.long),),
            name="shared-later",
            seq_len=SEQ,
        )
    assert [layer.name for layer in g.layers] == ["embed", "blocks.0", "blocks.1", "head"]
    assert marked(g) == [(3, "linear", TABLE * BF16)]


def test_the_simulator_keeps_and_syncs_a_copy_of_a_traced_tied_table_on_the_heads_stage() -> None:
    cluster = load_cluster("p3.8xlarge")
    workload = Workload(global_batch=8, seq_len=SEQ)
    split = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0,)), Stage(layers=(2, 4), devices=(1,))))
    whole = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0,)),))
    tied = Simulator(gpt2(True), cluster, workload)
    assert tied.coster.tied_copy_params(split.stages[1]) == TABLE
    assert tied.coster.local_params(split.stages[1]) == gpt2(True).block_of(2).params + 2 * HIDDEN + TABLE
    seconds, waiting = tied.tied_sync(split)
    assert seconds > 0 and waiting == frozenset({0, 1})
    assert tied.tied_sync(whole) == (0.0, frozenset())
    untied = Simulator(gpt2(False), cluster, workload)
    assert untied.coster.tied_copy_params(split.stages[1]) == 0.0
    assert untied.tied_sync(split) == (0.0, frozenset())
