"""Layer tables (CSV or JSON) -> `LayerRecord`s, mapped onto a model's blocks.

The generic form, one row per layer kind x device x tp x micro-batch:

    layer,device,tp,micro_batch,seq_len,dtype,forward_s,backward_s,activation_bytes,peak_bytes
    decoder,H100-SXM,1,1,4096,bf16,0.0123,0.0251,,

- `layer`: the model's block hash, or its kind (`embedding`, `block`, `head`, ...), or an alias
  other planners use (`decoder`, `encoder_layer`, `transformer`, `layer` -> `block`; `embed`,
  `embeddings` -> `embedding`; `lm_head`, `output`, `loss`, `cls` -> `head`);
- `device` (default: the import's `--device`), `tp` (default 1), `dtype` (default bf16);
- `forward_s`, `backward_s`: seconds per micro-batch on one device of the tp group (no communication);
- `activation_bytes`, `peak_bytes`: optional.

JSON: a list of such objects, or an object with a `layers` list. The model SPEC (`model=`) says
which blocks the rows belong to: each row's block hash is that of the model built at the row's
sequence length and dtype. A kind that names several different blocks (an encoder-decoder's two
stacks) must be given by hash. Errors name the file, the row and the field.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.textfile import read_text
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType

from .bundle import LayerRecord
from .iterations import csv_header

REQUIRED = ("layer", "micro_batch", "seq_len", "forward_s", "backward_s")
OPTIONAL = ("device", "tp", "dtype", "activation_bytes", "peak_bytes", "repeats", "source")
ALIASES = {"decoder": "block", "decoder_layer": "block", "encoder_layer": "block", "transformer": "block",
           "transformer_layer": "block", "layer": "block", "embed": "embedding", "embeddings": "embedding",
           "lm_head": "head", "output": "head", "loss": "head", "cls": "head", "post_process": "head",
           "pre_process": "embedding"}
_NUMBERS = {"tp": int, "micro_batch": int, "seq_len": int, "repeats": int, "forward_s": float, "backward_s": float,
            "activation_bytes": float, "peak_bytes": float}


def looks_like_layer_table(head: str) -> bool:
    """Whether a file's first bytes look like a layer table (its columns or keys)."""
    return all(k in head for k in ("forward_s", "backward_s", "micro_batch"))


def import_layer_table(path: str | os.PathLike[str], *, model: str | None,
                       device: str | None) -> list[LayerRecord]:
    """The layer records of the table at `path`, mapped onto `model`'s blocks (module docstring)."""
    source = Path(path)
    if not model:
        raise SpecError(f"{source}: a layer table needs the model its layers belong to; pass --model SPEC")
    text = read_text(source)
    rows = _json_rows(source, text) if text.lstrip().startswith(("[", "{")) else _csv_rows(source, text)
    mapper = BlockMapper(model)
    return [_record(row, where, mapper, device, model) for where, row in rows]


class BlockMapper:
    """Finds the block hash a layer name means in the model at a sequence length and dtype."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.models: dict[tuple[int, DType], ModelGraph] = {}

    def block_hash(self, name: str, seq_len: int, dtype: DType) -> str:
        """The hash of the block `name` denotes; SpecError listing the model's blocks otherwise."""
        model = self.models.get((seq_len, dtype))
        if model is None:
            model = self.models[(seq_len, dtype)] = load_model(self.spec, seq_len=seq_len, dtype=dtype)
        if name in model.block_by_hash:
            return name
        kind = ALIASES.get(name.lower(), name.lower())
        matches = [b.hash for b in model.blocks if b.kind.lower() == kind]
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(f"{b.kind} ({b.hash})" for b in model.blocks)
        problem = "names several different blocks" if matches else "matches no block"
        raise SpecError(f"layer {name!r} {problem} of {self.spec} (blocks: {known}); give the block hash")


def _json_rows(source: Path, text: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(f"{source}: not JSON ({err.msg} at line {err.lineno})") from None
    rows = data.get("layers") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SpecError(f"{source}: expected a list of layer rows, or an object with a `layers` list")
    return [(f"{source}: layers[{i}]", r) for i, r in enumerate(rows)]


def _csv_rows(source: Path, text: str) -> list[tuple[str, dict[str, Any]]]:
    reader = csv.reader(io.StringIO(text))
    header = csv_header(source, next(reader, []), REQUIRED, OPTIONAL)
    rows = []
    for number, row in enumerate(reader, start=2):
        if any(cell.strip() for cell in row):
            if len(row) != len(header):
                raise SpecError(f"{source}:{number}: {len(row)} cells; the header has {len(header)} columns")
            rows.append((f"{source}:{number}", {k: v.strip() for k, v in zip(header, row, strict=True) if v.strip()}))
    return rows


def _record(row: dict[str, Any], where: str, mapper: BlockMapper, device: str | None, model: str) -> LayerRecord:
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise SpecError(f"{where}: missing field(s) {', '.join(missing)}; expected {', '.join(REQUIRED)}")
    values: dict[str, Any] = {}
    for key, value in row.items():
        if key not in (*REQUIRED, *OPTIONAL):
            raise SpecError(f"{where}: unknown field {key!r}; expected {', '.join((*REQUIRED, *OPTIONAL))}")
        try:
            values[key] = _NUMBERS[key](value) if key in _NUMBERS and isinstance(value, str) else value
        except ValueError:
            raise SpecError(f"{where}: {key} {value!r} is not a number") from None
    name = str(values.pop("layer"))
    values.setdefault("device", device)
    if not values.get("device"):
        raise SpecError(f"{where}: no device: give a device column or --device")
    try:
        dtype = DType(values.setdefault("dtype", "bf16"))
    except ValueError:
        accepted = ", ".join(d.value for d in DType)
        raise SpecError(f"{where}: dtype {values['dtype']!r} is not one of {accepted}") from None
    try:
        block = mapper.block_hash(name, int(values["seq_len"]), dtype)
        return LayerRecord(block_hash=block, block_name=name, model=model, **values)
    except SpecError as err:
        raise SpecError(f"{where}: {err}") from None
    except ValidationError as err:
        e = err.errors()[0]
        raise SpecError(f"{where}: {'.'.join(map(str, e['loc']))}: {e['msg']} (got {e.get('input')!r})") from None
