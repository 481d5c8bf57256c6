"""Galvatron computation and memory profiles -> `LayerRecord`s, mapped onto a model's blocks.

Galvatron (PKU-DAIR/Hetu-Galvatron) writes two JSON files per model and precision. Followed:
the search-engine guide (`docs/en/source/5_search_engine_usage/search_engine_usage.md`, "Model
Configuration") for the keys, `galvatron/core/profiler/model_profiler.py`
(`_process_computation_data`, `_process_single_sequence_config`) for how the figures are made,
`galvatron/core/profiler/runtime_profiler.py` and `.../profiler/utils.py` for the units, the
search engine (`get_profiled_model_configs`, `TimeCostModel.estimate_computation_time`) for how
Galvatron reads them, and the shipped `galvatron/models/*/configs/computation_profiling_*.json`
and `galvatron-visualizer/public/configs/memory_profiling_*.json` for their layout.

- `computation_profiling_{bf16|fp16|fp32}_{model}.json`: `"layertype_{i}_bsz{b}_seq{s}": ms`, the
  forward milliseconds of one layer of type i per sample, measured at batch size b, sequence
  length s, tp 1 (the profiler runs forward only with `global_tp_deg 1` and divides the batch's
  time by b and by the layer count). Also there and not imported: `layertype_other_bsz{b}_seq..`
  (the embedding, head and loss together, per sample: no one block of tagplan's), raw
  whole-model runs `layernum[..]_bsz.._seq..`, and per-unit figures ending `_attention` or
  `_mlp` (a part of a layer, not a whole one).
- `memory_profiling_{dtype}_{model}.json` (optional): `"layertype_{i}[_sp]": {"{seq}":
  {"parameter_size": MB, "tp_activation_per_bsz_dict": {"1": MB, "2": MB, ..., "checkpoint": MB}}}`,
  MB = 2**20 bytes, the activation one layer keeps for its backward per sample on one device of
  a tp group. `other_memory_pp_off|pp_on_first|pp_on_last[_sp]`, `model_config` and raw
  per-strategy measurements (`{pp}_{tp}_{dp}[_c][_vtp][_sp]`) are not per block and are skipped.

Conventions, stated in each record's `source`:

- micro_batch = b; forward_s = ms x b / 1000; backward_s = 2 x forward_s (Galvatron's own
  `bct_fct_coe = 2`); tp = 1. Galvatron scales tp > 1 as ideal (time / tp); tagplan does not
  invent such points, so its simulator interpolates only between measured ones.
- activation_bytes = tp_activation_per_bsz_dict["1"] x b x 2**20 where the memory profile has
  that layer type and sequence length; else unknown. peak_bytes is not known.
- The precision is the file name's (`_profiling_bf16_`); `--dtype` must agree, and is used when
  the name states none (else bf16).
- Mapping: layer type i is the model's i-th repeated block in layer order (blocks two or more
  layers instantiate; for GPT-style models the decoder block; for T5 the encoder then the
  decoder block, as Galvatron numbers them). The file's layer types must be 0..k-1 for a model
  with k repeated blocks.
- `parameter_size` (MB) of a memory profile is compared with the block's parameters (a count or
  2 or 4 bytes each, within 10%); a mismatch is a warning that `--model` may not be the profiled
  model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from tagplan.errors import SpecError
from tagplan.ir.model import Block
from tagplan.ir.workload import DType

from .bundle import LayerRecord
from .planner_profiles import (
    MIB,
    json_object,
    model_at,
    ms_to_s,
    non_negative_number,
    params_plausible,
    positive_number,
    repeated_blocks,
    resolve_dtype,
)

Role = Literal["computation", "memory"]
BACKWARD_PER_FORWARD = 2.0
"""Galvatron's bct_fct_coe: backward seconds per forward second."""

LAYER_TIME = re.compile(r"^layertype_(\d+)_bsz(\d+)_seq(\d+)$")
_UNIT_TIME = re.compile(r"^layertype_\d+_bsz\d+_seq\d+_(attention|mlp)$")
_OTHER_TIME = re.compile(r"^layertype_other_bsz\d+_seq(\d+|\[[\d,\s]+\])(_\w+)?$")
_RAW_TIME = re.compile(r"^layernum\[[\d,\s]+\]_bsz\d+_seq(\d+|\[[\d,\s]+\])(_\w+)?$")
LAYER_MEMORY = re.compile(r"^layertype_(\d+)(_sp)?$")
_OTHER_MEMORY = re.compile(r"^other_memory_(pp_off|pp_on_first|pp_on_last)(_sp)?$")
_RAW_MEMORY = re.compile(r"^\d+_\d+_\d+(_\w+)?$")
_PRECISION = re.compile(r"(?:computation|memory)_profiling_([A-Za-z0-9]+)_")
_PREFIX = re.compile(r"^(?:computation|memory)_profiling_")
_TIME_KEYS = ("layertype_{i}_bsz{b}_seq{s}", "layertype_other_bsz{b}_seq{s}", "layernum[..]_bsz{b}_seq{s}",
              "layertype_{i}_bsz{b}_seq{s}_attention|_mlp")
_MEMORY_KEYS = ("layertype_{i}[_sp]", "other_memory_pp_off|pp_on_first|pp_on_last[_sp]", "model_config",
                "{pp}_{tp}_{dp}[_c][_vtp][_sp]")
_HEAD = re.compile(r'"(layertype_\d+_bsz\d+_seq|layertype_other_bsz|layernum\[|tp_activation_per_bsz_dict|'
                   r'other_memory_pp_off)')


def looks_like_galvatron(head: str) -> bool:
    """Whether a file's first bytes look like a Galvatron computation or memory profile."""
    return _HEAD.search(head) is not None


def profile_role(path: str | os.PathLike[str]) -> Role:
    """Whether the Galvatron profile at `path` is a computation or a memory profile (by its keys)."""
    source = Path(path)
    return _role(source, _json_object(source))


def pair_profiles(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[Path, Path | None]]:
    """Each computation profile among `paths` with its memory profile, if one is given: the one of the
    same name after `computation_`/`memory_profiling_`, else the only one beside the only computation
    profile. SpecError for a memory profile with no computation profile to go with."""
    roles = {Path(p): profile_role(p) for p in paths}
    computations = [p for p, r in roles.items() if r == "computation"]
    pairs: dict[Path, Path | None] = dict.fromkeys(computations)
    for memory in (p for p, r in roles.items() if r == "memory"):
        same = [c for c in computations if _PREFIX.sub("", c.name) == _PREFIX.sub("", memory.name)]
        if len(same) == 1 and pairs[same[0]] is None:
            pairs[same[0]] = memory
        elif not same and len(computations) == 1 and pairs[computations[0]] is None:
            pairs[computations[0]] = memory
        else:
            names = ", ".join(c.name for c in computations) or "none given"
            raise SpecError(f"{memory}: a Galvatron memory profile holds no times; import it with its computation "
                            f"profile (computation_profiling_<same suffix>; given: {names})")
    return list(pairs.items())


def import_galvatron(path: str | os.PathLike[str], *, memory: str | os.PathLike[str] | None = None,
                     model: str | None, device: str | None, dtype: str | None = None,
                     warn: Callable[[str], None] | None = None) -> list[LayerRecord]:
    """The layer records of the Galvatron computation profile at `path`, with activation memory from
    the memory profile `memory` where given (module docstring); SpecError naming the file and key."""
    source = Path(path)
    if not model:
        raise SpecError(f"{source}: a Galvatron profile needs the model its layer types belong to; pass --model SPEC")
    if not device:
        raise SpecError(f"{source}: pass --device (the catalog name of the profiled device type)")
    data = _json_object(source)
    if _role(source, data) == "memory":
        raise SpecError(f"{source}: a Galvatron memory profile holds no times; import it with its computation "
                        "profile (computation_profiling_*.json)")
    chosen, how = resolve_dtype(str(source), _precision(source), dtype)
    points = _layer_times(source, data)
    activations: dict[tuple[int, int], tuple[float, float, str]] = {}
    memory_path = Path(memory) if memory is not None else None
    if memory_path is not None:
        resolve_dtype(str(memory_path), _precision(memory_path), chosen)  # the two files' precisions agree
        activations = _activations(memory_path, _json_object(memory_path))
    types = sorted({layer_type for layer_type, _, _, _, _ in points})
    records = []
    for layer_type, batch, seq, ms, key in points:
        block = _blocks(source, model, seq, chosen, types)[layer_type]
        forward_s = ms_to_s(ms) * batch
        notes = [f"galvatron {source.name} {key}: {ms:g} ms forward per sample x micro-batch {batch}; backward = "
                 "2 x forward (Galvatron's bct_fct_coe); tp 1 (Galvatron profiles computation without tensor "
                 "parallelism)", how]
        activation = None
        found = activations.get((layer_type, seq))
        if found is not None and memory_path is not None:
            per_sample_mb, _, memory_key = found
            activation = per_sample_mb * batch * MIB
            notes.append(f"activation_bytes = {memory_path.name} {memory_key}.{seq}.tp_activation_per_bsz_dict['1'] "
                         f"x {batch} x 2**20")
        records.append(LayerRecord(
            block_hash=block.hash, block_name=f"layertype_{layer_type}", model=model, device=device, tp=1,
            micro_batch=batch, seq_len=seq, dtype=chosen, forward_s=forward_s,
            backward_s=forward_s * BACKWARD_PER_FORWARD, activation_bytes=activation, source="; ".join(notes)))
    if warn is not None and memory_path is not None:
        measured = {(layer_type, seq) for layer_type, _, seq, _, _ in points}
        for (layer_type, seq), (_, parameter_mb, memory_key) in activations.items():
            if (layer_type, seq) not in measured:
                continue
            block = _blocks(source, model, seq, chosen, types)[layer_type]
            if not params_plausible(parameter_mb * MIB, block.params):
                warn(f"{memory_path}: {memory_key}.{seq}.parameter_size is {parameter_mb:g} MB, not 1, 2 or 4 bytes "
                     f"a parameter of {model}'s {block.kind} block ({block.params} parameters): is --model the "
                     "profiled model?")
    return records


def _json_object(source: Path) -> dict[str, Any]:
    return json_object(source, "a Galvatron profile is a JSON object of keys such as "
                               "layertype_0_bsz8_seq2048 or layertype_0")


def _role(source: Path, data: dict[str, Any]) -> Role:
    if any(LAYER_TIME.match(k) or _UNIT_TIME.match(k) or _OTHER_TIME.match(k) or _RAW_TIME.match(k) for k in data):
        return "computation"
    if any(LAYER_MEMORY.match(k) or _OTHER_MEMORY.match(k) for k in data):
        return "memory"
    raise SpecError(f"{source}: not a Galvatron profile: no computation keys ({', '.join(_TIME_KEYS)}) and no "
                    f"memory keys ({', '.join(_MEMORY_KEYS)})")


def _precision(source: Path) -> str | None:
    found = _PRECISION.search(source.name)
    return found.group(1) if found else None


def _layer_times(source: Path, data: dict[str, Any]) -> list[tuple[int, int, int, float, str]]:
    """(layer type, batch size, sequence length, forward ms per sample, key) of each whole-layer figure."""
    points, parts = [], 0
    for key, value in data.items():
        found = LAYER_TIME.match(key)
        if found:
            layer_type, batch, seq = (int(g) for g in found.groups())
            if batch < 1 or seq < 1:
                raise SpecError(f"{source}: {key}: batch size and sequence length must be at least 1")
            points.append((layer_type, batch, seq, positive_number(value, str(source), key, "milliseconds"), key))
        elif _UNIT_TIME.match(key):
            parts += 1
        elif not (_OTHER_TIME.match(key) or _RAW_TIME.match(key)):
            raise SpecError(f"{source}: key {key!r} is not one of a Galvatron computation profile's: "
                            f"{', '.join(_TIME_KEYS)}")
    if not points:
        why = (f"only per-unit figures ({parts} keys ending _attention or _mlp: parts of a layer)" if parts
               else "no layertype_{i}_bsz{b}_seq{s} keys")
        raise SpecError(f"{source}: {why}; tagplan imports whole-layer times (Galvatron's --profile_unit all)")
    return sorted(points)


def _activations(source: Path, data: dict[str, Any]) -> dict[tuple[int, int], tuple[float, float, str]]:
    """(layer type, sequence length) -> (activation MB per sample at tp 1, parameter MB, key) of a memory profile."""
    found: dict[tuple[int, int], tuple[float, float, str]] = {}
    for key in sorted(data, key=lambda k: k.endswith("_sp")):  # without sequence parallelism first: tp 1 either way
        match = LAYER_MEMORY.match(key)
        if not match:
            if not (_OTHER_MEMORY.match(key) or _RAW_MEMORY.match(key) or key == "model_config"):
                raise SpecError(f"{source}: key {key!r} is not one of a Galvatron memory profile's: "
                                f"{', '.join(_MEMORY_KEYS)}")
            continue
        by_seq = data[key]
        if not isinstance(by_seq, dict):
            raise SpecError(f"{source}: {key} {by_seq!r} is not an object of sequence lengths")
        for seq_text, entry in by_seq.items():
            where = f"{key}.{seq_text}"
            if not str(seq_text).isdigit() or int(seq_text) < 1:
                raise SpecError(f"{source}: {key}: sequence length {seq_text!r} is not a whole number above zero")
            if not isinstance(entry, dict) or not isinstance(entry.get("tp_activation_per_bsz_dict"), dict):
                raise SpecError(f"{source}: {where} needs parameter_size and tp_activation_per_bsz_dict {{\"1\": MB, "
                                "...}")
            parameter = non_negative_number(entry.get("parameter_size"), str(source), f"{where}.parameter_size", "MB")
            per_tp = entry["tp_activation_per_bsz_dict"]
            if "1" not in per_tp:
                continue
            activation = non_negative_number(per_tp["1"], str(source),
                                             f"{where}.tp_activation_per_bsz_dict['1']", "MB")
            found.setdefault((int(match.group(1)), int(seq_text)), (activation, parameter, key))
    return found


def _blocks(source: Path, spec: str, seq: int, dtype: DType, types: list[int]) -> list[Block]:
    """The model's repeated blocks, one per layer type; SpecError when the counts differ."""
    blocks = repeated_blocks(model_at(spec, seq, dtype))
    if types != list(range(len(blocks))):
        kinds = ", ".join(f"{b.kind} ({b.hash})" for b in blocks) or "none"
        raise SpecError(f"{source}: layer types {', '.join(map(str, types))} do not match the {len(blocks)} repeated "
                        f"block(s) of {spec} at sequence length {seq} ({kinds}); accepted: layer types 0..k-1, "
                        "layer type i being the model's i-th repeated block")
    return blocks
