"""The JSON graph format for models that are not PyTorch (docs/GRAPH_FORMAT.md).

Two shapes are accepted: a `ModelGraph` as tagplan writes it (`blocks` is a list of blocks with
hashes), and the hand-written `tagplan-graph/1` format, where `blocks` is a mapping from a
name of your choice to `{kind, ops, output_bytes[, params]}` and each layer may `repeat`. The
loader computes structural hashes, so two names for identical blocks fold into one.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import ValidationError

from tagplan.errors import SpecError, from_validation
from tagplan.ir.model import HASH_EXCLUDED, Block, Layer, ModelGraph, Op
from tagplan.ir.workload import DType

FORMAT = "tagplan-graph/1"


def graph_from_dict(data: Any, source: str = "graph") -> ModelGraph:
    """A ModelGraph from parsed JSON/YAML in either accepted shape; SpecError on bad input."""
    if not isinstance(data, dict):
        raise SpecError(f"{source}: a model graph must be a mapping, got {type(data).__name__}")
    try:
        if isinstance(data.get("blocks"), list):
            return ModelGraph.model_validate(data)
        return _from_handwritten(data, source)
    except ValidationError as exc:
        raise from_validation(source, exc) from None


def _from_handwritten(data: dict[str, Any], source: str) -> ModelGraph:
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise SpecError(f"{source}: format {fmt!r} is not supported; accepted: {FORMAT!r}")
    unknown_keys = set(data) - {"format", "name", "family", "seq_len", "dtype", "blocks", "layers"}
    if unknown_keys:
        raise SpecError(f"{source}: unknown top-level keys {sorted(unknown_keys)}; accepted: "
                        "format, name, family, seq_len, dtype, blocks, layers")
    raw_dtype = data.get("dtype", DType.BF16.value)
    if raw_dtype not in {d.value for d in DType}:
        raise SpecError(f"{source}: dtype {raw_dtype!r} is not one of {[d.value for d in DType]}")
    dtype = DType(raw_dtype)
    raw_blocks = data.get("blocks")
    if not isinstance(raw_blocks, dict) or not raw_blocks:
        raise SpecError(f"{source}: blocks must be a non-empty mapping of name -> block")
    blocks = {name: _block(name, spec, dtype, source) for name, spec in raw_blocks.items()}
    layers = _layers(data.get("layers"), blocks, source)
    unique = {b.hash: b for b in blocks.values()}
    return ModelGraph(name=data.get("name", "graph"), family=data.get("family", "custom"),
                      seq_len=data.get("seq_len", 1), dtype=dtype, blocks=tuple(unique.values()),
                      layers=tuple(layers))


def _block(name: str, spec: Any, dtype: DType, source: str) -> Block:
    if not isinstance(spec, dict) or not isinstance(spec.get("ops"), list) or not spec["ops"]:
        raise SpecError(f"{source}: blocks.{name} must be a mapping with a non-empty list 'ops'")
    ops: list[Op] = []
    for i, raw in enumerate(spec["ops"]):
        try:
            ops.append(Op.model_validate(raw))
        except ValidationError as exc:
            raise from_validation(f"{source}: blocks.{name}.ops[{i}]", exc) from None
    params = spec.get("params", round(sum(op.param_bytes for op in ops) / dtype.nbytes))
    kind = spec.get("kind", "block")
    output_bytes = spec.get("output_bytes", ops[-1].bytes_written)
    digest = hashlib.sha256(f"{kind}|{params}|{output_bytes}".encode())
    for op in ops:
        digest.update(op.model_dump_json(exclude=set(HASH_EXCLUDED)).encode())
    return Block(hash=digest.hexdigest()[:16], kind=kind, ops=tuple(ops), params=params, output_bytes=output_bytes)


def _layers(raw: Any, blocks: dict[str, Block], source: str) -> list[Layer]:
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"{source}: layers must be a non-empty list of {{name, block[, repeat]}}")
    out: list[Layer] = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or entry.get("block") not in blocks:
            got = entry.get("block") if isinstance(entry, dict) else entry
            raise SpecError(f"{source}: layers[{i}].block {got!r} is not one of the blocks {sorted(blocks)}")
        repeat = entry.get("repeat", 1)
        if not isinstance(repeat, int) or repeat < 1:
            raise SpecError(f"{source}: layers[{i}].repeat must be a positive whole number, got {repeat!r}")
        base = entry.get("name", entry["block"])
        for r in range(repeat):
            out.append(Layer(name=f"{base}.{r}" if repeat > 1 else base, block=blocks[entry["block"]].hash))
    return out
