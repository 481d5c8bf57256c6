"""What the Metis and Galvatron importers share: units, the model at a point, number checks.

Other planners' profiles state milliseconds and megabytes; `layer` records hold seconds and
bytes. A megabyte here is 2**20 bytes: both planners divide torch's byte counters by 2**20.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.textfile import read_text
from tagplan.ir.model import Block, ModelGraph
from tagplan.ir.workload import DType

MIB = float(1 << 20)
"""Bytes per MB as Metis and Galvatron count them (torch's byte counters / 2**20)."""
END_KINDS = ("embedding", "head")
"""Block kinds that are the ends of a model rather than its repeated layers."""
_BYTES_PER_PARAM = (1.0, 2.0, 4.0)  # a count, fp16/bf16 bytes, fp32 bytes
_PARAM_TOLERANCE = 0.10


def ms_to_s(ms: float) -> float:
    """Milliseconds to seconds."""
    return ms / 1e3


def model_at(spec: str, seq_len: int, dtype: DType) -> ModelGraph:
    """The model `spec` names, built at `seq_len` and `dtype` (cached: profiles repeat the point)."""
    return _model_at(spec, seq_len, dtype)


@lru_cache(maxsize=32)
def _model_at(spec: str, seq_len: int, dtype: DType) -> ModelGraph:
    return load_model(spec, seq_len=seq_len, dtype=dtype)


def repeated_blocks(model: ModelGraph) -> list[Block]:
    """The model's repeated layer blocks in order of first use: blocks two or more layers
    instantiate; for a model with none, its blocks that are neither an embedding nor a head."""
    counts: dict[str, int] = {}
    for layer in model.layers:
        counts[layer.block] = counts.get(layer.block, 0) + 1
    repeated = [model.block_by_hash[h] for h, n in counts.items() if n > 1]
    if repeated:
        return repeated
    return [model.block_by_hash[h] for h in counts if model.block_by_hash[h].kind.lower() not in END_KINDS]


def params_plausible(param_bytes: float, params: int, tp: int = 1) -> bool:
    """Whether a profile's parameter size of a layer fits a block of `params` parameters: a count,
    or 2 or 4 bytes a parameter, of the whole layer or of one device's 1/tp share, within 10%."""
    if params <= 0 or param_bytes <= 0:
        return True  # nothing to compare
    ratio = param_bytes / params
    return any(abs(ratio / (b / share) - 1.0) <= _PARAM_TOLERANCE
               for b in _BYTES_PER_PARAM for share in {1, tp})


def resolve_dtype(where: str, in_file: str | None, given: str | DType | None) -> tuple[DType, str]:
    """(dtype, how it was chosen): the file's own precision, else `given`, else bf16; SpecError
    when the file and `given` disagree or a name is not a dtype."""
    accepted = ", ".join(d.value for d in DType)
    chosen: dict[str, DType] = {}
    for label, value in (("the file name", in_file), ("--dtype", given)):
        if value is not None:
            try:
                chosen[label] = DType(str(value).lower())
            except ValueError:
                raise SpecError(f"{where}: dtype {value!r} (from {label}) is not one of {accepted}") from None
    if len(set(chosen.values())) > 1:
        raise SpecError(f"{where}: the file name says dtype {chosen['the file name'].value}, --dtype says "
                        f"{chosen['--dtype'].value}; drop --dtype or import the profile of that precision")
    if "the file name" in chosen:
        return chosen["the file name"], "dtype from the file name"
    if "--dtype" in chosen:
        return chosen["--dtype"], "dtype from --dtype"
    return DType.BF16, "dtype bf16 assumed (the file does not say; pass --dtype)"


def positive_number(value: Any, where: str, field: str, unit: str) -> float:
    """`value` as a finite number above zero; SpecError naming `where`, the field and the value."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{where}: {field} {value!r} is not a positive number of {unit}")
    return float(value)


def non_negative_number(value: Any, where: str, field: str, unit: str) -> float:
    """`value` as a finite number at or above zero; SpecError naming `where`, the field and the value."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise SpecError(f"{where}: {field} {value!r} is not a number of {unit} at or above zero")
    return float(value)


def json_object(source: Path, accepted: str) -> dict[str, Any]:
    """The JSON object in `source`; SpecError naming the file when it is not JSON or not an object
    (`accepted`: what a profile of this kind holds, for the message)."""
    try:
        data = json.loads(read_text(source))
    except json.JSONDecodeError as err:
        raise SpecError(f"{source}: not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{source}: {accepted}; got a {type(data).__name__}")
    return data
