"""Folding and the analytic mixture-of-experts pass shared by the Hugging Face builders.

Folding: a copy of the config with at most `FOLD_DEPTH` repeated blocks per stack (after a
prefix of blocks of another kind, e.g. DeepSeek-V3's dense first layers) is traced; when the
traced blocks after the first repeated one hash equal, the last one is replicated to the
configured depth, numbering continued. Otherwise the caller traces the full model.

Mixture of experts: what is traced and what is analytic.
- Traced: attention, norms, the router (gate linear, softmax or sigmoid, top-k), shared experts
  and the expert computation as transformers implements it: tokens sorted by expert and two
  grouped matmuls over `tokens * top_k` rows. All expert weights are parameters of the graph,
  so `params` and `param_bytes` count every expert.
- Analytic: FlopCounterMode does not count the grouped matmul custom op on meta (and other
  implementations loop over experts with data-dependent sizes). The routed experts' matmul FLOPs
  are therefore set to the top-k cost, `2 * 3 * hidden * expert_ffn * top_k` per token (gate, up
  and down projections for each of the token's top_k experts), split over the expert matmul ops
  in proportion to their traced figures. Two ALL_TO_ALL ops (dispatch before the experts,
  combine after; 0 FLOPs, `tokens * hidden * top_k` elements each way) mark where expert
  parallelism moves tokens; expert matmuls carry PartitionDim.EXPERTS.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tagplan.errors import SpecError
from tagplan.frontends.hf_config import is_causal_lm
from tagplan.ir.model import Block, Layer, ModelGraph, Op, OpKind, PartitionDim

log = logging.getLogger(__name__)

FOLD_DEPTH = 3  # repeated blocks per stack traced when folding
MAX_UNFOLDED_BLOCKS = 256
"""Blocks traced one by one where folding fails: the trace grows faster than linearly (128 blocks about 30 s,
256 about 90 s on 2 cores), and a 4096-layer config would hold a service worker for half an hour."""


def folded_or_whole(name: str, stacks: tuple[Stack, ...], full: dict[str, int], fold: bool,
                    trace: Callable[[dict[str, int] | None], ModelGraph]) -> ModelGraph:
    """The graph of a model with `full` blocks per stack: `trace(short)` of at most `FOLD_DEPTH` per stack,
    replicated (`unfold`), else `trace(None)` of every block, which is refused past `MAX_UNFOLDED_BLOCKS` (the
    trace grows faster than linearly). `fold` False traces every block at once."""
    short = short_depths(stacks, full)
    if fold and short != full:
        folded = unfold(trace(short), stacks, short, full)
        if folded is not None:
            return folded
        blocks = sum(full.values())
        if blocks > MAX_UNFOLDED_BLOCKS:
            raise SpecError(f"{name}: its traced blocks differ from one another, so its {blocks} blocks would be "
                            f"traced one by one; at most {MAX_UNFOLDED_BLOCKS} are (minutes past that): give fewer "
                            "layers, or the model as a tagplan-graph/1 file")
        log.info("%s: traced blocks differ, tracing all %s blocks", name, blocks)
    return trace(None)


@dataclass(frozen=True)
class Stack:
    """One stack of repeated blocks: its depth attribute and a substring of its layer names."""

    depth_attr: str
    hint: str = ""
    prefix: int = 0  # leading blocks of another kind (traced, never replicated)


def with_values(config: Any, values: dict[str, Any]) -> Any:
    """A deep copy of the config with some attributes replaced."""
    new = copy.deepcopy(config)
    for key, value in values.items():
        setattr(new, key, value)
    return new


def short_depths(stacks: tuple[Stack, ...], depths: dict[str, int]) -> dict[str, int]:
    """Blocks per stack to trace: the prefix plus at most FOLD_DEPTH."""
    return {s.depth_attr: min(depths[s.depth_attr], s.prefix + FOLD_DEPTH) for s in stacks}


def unfold(graph: ModelGraph, stacks: tuple[Stack, ...], traced: dict[str, int],
           full: dict[str, int]) -> ModelGraph | None:
    """Replicate each stack's last traced block to the full depth; None if blocks are not periodic."""
    layers = list(graph.layers)
    spans = []
    for stack in stacks:
        attr = stack.depth_attr
        if traced[attr] == full[attr]:
            continue
        span = stack_span(layers, stack.hint, traced[attr])
        if span is None:
            return None
        first, last = span
        if len({layers[i].block for i in range(first + stack.prefix + 1, last + 1)}) > 1:
            return None
        spans.append((first, last, full[attr]))
    for first, last, depth in sorted(spans, reverse=True):  # later stacks first: indices stay valid
        layers = extend(layers, first, last, depth)
    return rebuild(graph, layers=tuple(layers))


def rebuild(graph: ModelGraph, **update: Any) -> ModelGraph:
    """A validated copy of `graph` with some fields replaced."""
    return ModelGraph.model_validate({**dict(graph), **update})


def stack_span(layers: list[Layer], hint: str, depth: int) -> tuple[int, int] | None:
    """First and last index of the layers `<stem>.0` .. `<stem>.<depth-1>` whose stem holds `hint`."""
    for i, layer in enumerate(layers):
        m = re.fullmatch(r"(.*\.)?0", layer.name)
        if m is None or hint not in layer.name:
            continue
        stem = m.group(1) or ""
        names = [f"{stem}{k}" for k in range(depth)]
        if [x.name for x in layers[i : i + depth]] == names:
            return i, i + depth - 1
    return None


def extend(layers: list[Layer], first: int, last: int, depth: int) -> list[Layer]:
    """Insert copies of `layers[last]` so the stack starting at `first` holds `depth` blocks."""
    added = depth - (last - first + 1)
    template = layers[last]
    stem = template.name.rsplit(".", 1)[0]
    copies = []
    for j in range(1, added + 1):
        inputs = None
        if template.inputs is not None:  # in-stack sources keep their offset, others stay put
            inputs = tuple(s + j if s >= first else s for s in template.inputs)
        copies.append(Layer(name=f"{stem}.{last - first + j}", block=template.block, inputs=inputs))
    after = [
        layer if layer.inputs is None
        else layer.model_copy(update={"inputs": tuple(s + added if s >= last else s for s in layer.inputs)})
        for layer in layers[last + 1 :]
    ]  # fmt: skip
    return layers[: last + 1] + copies + after


def expert_ffn(config: Any) -> int:
    """The hidden width of one routed expert (`moe_intermediate_size`, else `intermediate_size`)."""
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def moe_analytic(graph: ModelGraph, config: Any) -> ModelGraph:
    """Set routed-expert FLOPs to the top-k formula and add dispatch/combine all-to-alls."""
    hidden, ffn = int(config.hidden_size), expert_ffn(config)
    top_k = int(config.num_experts_per_tok)
    per_sample = 2.0 * 3 * hidden * ffn * top_k * graph.seq_len
    a2a_bytes = float(graph.seq_len * hidden * top_k * graph.dtype.nbytes)
    renamed: dict[str, str] = {}
    blocks = []
    for block in graph.blocks:
        new = _moe_block(block, per_sample, a2a_bytes)
        renamed[block.hash] = new.hash
        blocks.append(new)
    layers = tuple(layer.model_copy(update={"block": renamed[layer.block]}) for layer in graph.layers)
    return rebuild(graph, blocks=tuple(blocks), layers=layers)


def _moe_block(block: Block, expert_flops: float, a2a_bytes: float) -> Block:
    """One block with analytic expert FLOPs and all-to-all ops (unchanged if it has no experts)."""
    ops = list(block.ops)
    experts = [i for i, op in enumerate(ops) if op.kind is OpKind.MATMUL and PartitionDim.EXPERTS in op.partition_dims]
    if not experts:
        return block
    traced = sum(ops[i].flops for i in experts)
    for i in experts:
        share = ops[i].flops / traced if traced > 0 else 1 / len(experts)
        ops[i] = ops[i].model_copy(update={"flops": expert_flops * share})
    first, last = ops[experts[0]], ops[experts[-1]]
    scope = first.name.rsplit(".", 1)[0] if "." in first.name else "experts"
    dims = (PartitionDim.BATCH, PartitionDim.EXPERTS)
    dispatch = Op(
        name=f"{scope}.dispatch", kind=OpKind.ALL_TO_ALL, flops=0, bytes_read=a2a_bytes,
        bytes_written=a2a_bytes, partition_dims=dims, inputs=first.inputs,
    )  # fmt: skip
    combine = Op(
        name=f"{scope}.combine", kind=OpKind.ALL_TO_ALL, flops=0, bytes_read=a2a_bytes,
        bytes_written=a2a_bytes, partition_dims=dims, inputs=(last.name,),
    )  # fmt: skip
    ops[experts[0]] = first.model_copy(update={"inputs": (dispatch.name,)})
    ops = [
        op.model_copy(update={"inputs": tuple(combine.name if x == last.name else x for x in op.inputs)})
        for op in ops
    ]
    start, end = experts[0], experts[-1] + 1
    ops = [*ops[:start], dispatch, *ops[start:end], combine, *ops[end:]]
    digest = _rehash(block.hash, expert_flops, a2a_bytes)
    return Block(hash=digest, kind=block.kind, ops=tuple(ops), params=block.params, output_bytes=block.output_bytes)


def _rehash(digest: str, *facts: float) -> str:
    """A new structural hash for a block changed by the analytic MoE pass (equal in, equal out)."""
    text = json.dumps([digest, "moe-analytic", *facts])
    return hashlib.sha256(text.encode()).hexdigest()[: len(digest)]


def causal_masks(graph: ModelGraph, model_class: str, config: Any) -> ModelGraph:
    """`graph` with the attention a Hugging Face model masks causally marked so: every self-attention of a
    causal LM; the decoder's self-attention of an encoder-decoder model (T5, BART; `config.is_encoder_decoder`).
    Neither trace shows the mask where the model passes it as a tensor, as Hugging Face's do."""
    if is_causal_lm(model_class):
        return mark_causal(graph)
    if getattr(config, "is_encoder_decoder", False):
        return mark_causal(graph, decoder_blocks_only=True)
    return graph


def mark_causal(graph: ModelGraph, *, decoder_blocks_only: bool = False) -> ModelGraph:
    """`graph` with every self-attention op (as many keys as queries: `Op.score_elements` = heads x queries x
    queries, its queries and keys projected from one tensor) marked causal: what a causal LM's attention is.
    `decoder_blocks_only` (an encoder-decoder model): only in blocks that also hold a cross-attention (keys
    projected from another tensor than the queries: the encoder's output), which are the decoder's; the
    encoder's self-attention sees every token. Block hashes leave the flag out, so they stay as traced."""
    blocks = []
    for block in graph.blocks:
        selfs = {op.name for op in block.ops if _self_attention(op)}
        if decoder_blocks_only:  # a causal LM has no encoder: its queries and keys may come from different
            by_name = {op.name: op for op in block.ops}  # projections (MLA's q_b_proj and kv_b_proj)
            crosses = {op.name for op in block.ops if op.kind is OpKind.ATTENTION and _cross_attention(op, by_name)}
            selfs = selfs - crosses if crosses else set()
        ops = tuple(op.model_copy(update={"causal": True}) if op.name in selfs else op for op in block.ops)
        blocks.append(block.model_copy(update={"ops": ops}) if ops != block.ops else block)
    return rebuild(graph, blocks=tuple(blocks))


def _cross_attention(op: Op, by_name: dict[str, Op]) -> bool:
    """Whether the attention op's queries and keys (its first two inputs) were projected from different
    tensors. A tensor from outside the block (no producer in it) reads as the block's input."""
    if len(op.inputs) < 2:
        return False
    return _projected_from(op.inputs[0], by_name) != _projected_from(op.inputs[1], by_name)


def _projected_from(name: str, by_name: dict[str, Op]) -> tuple[str, ...]:
    """The inputs of the projection (matmul) a query or key tensor comes from, following first inputs back
    through views, reshapes and pointwise ops (rotary); () where the chain leaves the block first."""
    seen: set[str] = set()
    while name in by_name and name not in seen:
        seen.add(name)
        op = by_name[name]
        if op.kind is OpKind.MATMUL:
            return op.inputs
        if not op.inputs:
            return ()
        name = op.inputs[0]
    return ()


def _self_attention(op: Op) -> bool:
    shape = op.output_shape  # (batch, heads, queries, head width) as traced
    if op.kind is not OpKind.ATTENTION or len(shape) != 4 or not op.score_elements:
        return False
    heads, queries = shape[1], shape[2]
    return abs(op.score_elements - heads * queries * queries) < 0.5
