"""Turn layer groups into Blocks keyed by a structural hash, and the Layer sequence.

Two layers share a Block when their kind, parameter count, output bytes, Ops and structure
(op targets, parameter names relative to the layer with their shapes, shapes of tensors from
outside the layer) all agree; the hash is the first 16 hex characters of their sha256.

An op of a later layer that reads a parameter the first layer owns (a head tied to the token
embedding) carries its bytes in `Op.shared_param_bytes` (`ops.tied_reads`); hashes leave that field
out, so marking it changes no hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from torch import fx

from tagplan.frontends.tracing.layers import Group, layer_edges, layer_inputs
from tagplan.frontends.tracing.nodes import OpNode, Scale, Trace, node_shape
from tagplan.frontends.tracing.ops import make_op
from tagplan.ir.model import HASH_EXCLUDED, Block, Layer, Op

_HASH_CHARS = 16


def build_blocks(trace: Trace, groups: list[Group], scale: Scale) -> tuple[list[Block], list[Layer]]:
    """Turn layer groups into unique Blocks and the Layer sequence."""
    sources, out_bytes = layer_edges(trace, groups, scale)
    first_layer = first_layer_params(groups)
    blocks: dict[str, Block] = {}
    layers: list[Layer] = []
    for i, g in enumerate(groups):
        ops, signature = block_ops(trace, g, scale, first_layer if i > 0 else frozenset())
        params = sum(trace.params[fqn] for op in g.ops for fqn in op.owned)
        dumped = [op.model_dump(mode="json", exclude=set(HASH_EXCLUDED)) for op in ops]
        block_hash = digest([g.kind, params, out_bytes[i], signature, dumped])
        block = Block(hash=block_hash, kind=g.kind, ops=tuple(ops), params=params, output_bytes=out_bytes[i])
        blocks.setdefault(block_hash, block)
        layers.append(Layer(name=g.name, block=block_hash, inputs=layer_inputs(i, sources[i])))
    return list(blocks.values()), layers


def first_layer_params(groups: list[Group]) -> frozenset[str]:
    """FQNs of the parameters the ops of the first layer (layer 0) own; empty without layers."""
    return frozenset(fqn for op in groups[0].ops for fqn in op.owned) if groups else frozenset()


def block_ops(
    trace: Trace, g: Group, scale: Scale, first_layer: frozenset[str] = frozenset()
) -> tuple[list[Op], list[Any]]:
    """The block's Ops and the structural facts Ops do not hold (targets, params, external edges).

    `first_layer`: the first layer's parameters (`first_layer_params`), given for every later layer;
    its ops that read one of them carry its bytes in `shared_param_bytes`.
    """
    prefix = f"{g.key}." if g.key else ""
    names: dict[OpNode, str] = {}
    counts: dict[str, int] = {}
    saved: set[fx.Node] = set()
    ops: list[Op] = []
    signature: list[Any] = []
    for op in g.ops:
        base = _base_name(op, g.key, prefix)
        counts[base] = counts.get(base, 0) + 1
        names[op] = base if counts[base] == 1 else f"{base}_{counts[base] - 1}"
        producers = [trace.op_of.get(a) for a in op.inputs]
        local = tuple(dict.fromkeys(names[p] for p in producers if p is not None and p in names))
        ops.append(make_op(trace, op, names[op], local, saved, scale, first_layer))
        signature.append(
            [
                op.target,
                [(_strip(trace.param_of[a], prefix), node_shape(a)) for a in op.inputs if a in trace.param_of],
                [node_shape(a) for a, p in zip(op.inputs, producers, strict=True) if p not in names],
            ]
        )
    return ops, signature


def _base_name(op: OpNode, key: str | None, prefix: str) -> str:
    """`module.path.opname` relative to the layer's module (just `opname` at the layer itself)."""
    rel = op.path[len(prefix) :] if prefix and op.path.startswith(prefix) else op.path
    rel = "" if key is not None and op.path == key else rel
    return f"{rel}.{op.opname}" if rel else op.opname


def _strip(fqn: str, prefix: str) -> str:
    """A parameter's name relative to its layer."""
    return fqn[len(prefix) :] if prefix and fqn.startswith(prefix) else fqn


def digest(payload: Sequence[Any]) -> str:
    """sha256 of a JSON payload, first 16 hex characters."""
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:_HASH_CHARS]
