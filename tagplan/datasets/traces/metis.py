"""Metis profile files -> `LayerRecord`s, mapped onto a model's blocks.

Metis (Um et al., USENIX ATC'24; github.com/SamsungLabs/Metis) profiles one JSON file per device
type, tensor-parallel degree and batch size. Followed: the repository's README ("Profile Data
Guide") for the names and units, `data_loader.py` (`ProfileDataLoader`) for how Metis itself
reads them, and the files under `profile_data_samples/` for their layout:

- file name `DeviceType.{device}_tp{tp}_bs{bs}.json` (the loader's regexes `DeviceType\\.(\\w+?)_`,
  `tp(\\d+)`, `bs(\\d+)`); one iteration where micro-batch = batch = global batch = `bs`;
- `execution_time.layer_compute_total_ms`: per layer, in model order (the embedding first and
  the head last: `parameters_per_layer_bytes` of the samples is largest at both ends), the
  forward plus backward milliseconds of one micro-batch on one device of the tp group;
- `execution_memory.layer_memory_total_mb` (optional): per layer, MB of everything the layer
  holds (activations, gradients and optimizer states; `torch.cuda.max_memory_reserved`);
- `model.num_layers` (optional; must equal the list's length) and
  `model.parameters.parameters_per_layer_bytes` (optional; only checked, see below).
  `total_time_ms`, `forward_backward_time_ms`, `batch_generator_time_ms`, the all-reduce and
  optimizer times and `total_memory[_mb]` are iteration-level and not imported.

Conventions, stated in each record's `source`:

- Metis gives forward + backward together; tagplan needs them apart. forward = total / 3 and
  backward = 2 x forward (the 1:2 FLOP ratio of a matmul's forward and backward passes).
- The files record neither the sequence length nor the precision: `seq_len` is required and
  `dtype` defaults to bf16.
- `peak_bytes` = layer_memory_total_mb x 2**20 (it includes the layer's parameters, gradients
  and optimizer states, not only its activations); `activation_bytes` is not known. When the
  memory list's length is not the layer count (as in some of Metis's own samples) no memory is
  imported.
- Metis times layers with hooks inside a Megatron run, so at tp > 1 the times include the
  layer's tensor-parallel all-reduces, which tagplan's simulator also adds: such records
  overstate a stage's time by that communication.
- Mapping: when the file has as many layers as the model, layer i is the model's layer i;
  otherwise the model must be one first layer, one repeated block and one last layer, and the
  file's first, middle and last layers map onto them. The layers mapped onto one block become
  one record with the median of their times (`repeats` = how many).
- `parameters_per_layer_bytes` of the repeated block is compared with the block's parameters (a
  count, or 2 or 4 bytes each, of the layer or of a 1/tp share, within 10%); a mismatch is a
  warning that `--model` may not be the profiled model.
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError
from tagplan.ir.model import ModelGraph

from .bundle import LayerRecord
from .planner_profiles import (
    MIB,
    json_object,
    model_at,
    ms_to_s,
    params_plausible,
    positive_number,
    resolve_dtype,
)

FILE_NAME = re.compile(r"DeviceType\.(\w+?)_tp(\d+)_bs(\d+)")
NAME_FORM = "DeviceType.{device}_tp{tp}_bs{bs}.json"
FORWARD_SHARE = 1.0 / 3.0
"""forward / (forward + backward) under the backward = 2 x forward convention."""


def looks_like_metis(head: str) -> bool:
    """Whether a file's first bytes look like a Metis profile."""
    return '"layer_compute_total_ms"' in head


def metis_device(path: str | os.PathLike[str]) -> str | None:
    """The device type a Metis file name states (`A100` of `DeviceType.A100_tp1_bs1.json`), else None."""
    found = FILE_NAME.search(Path(path).name)
    return found.group(1) if found else None


def import_metis(path: str | os.PathLike[str], *, model: str | None, device: str | None, seq_len: int | None,
                 dtype: str | None = None, warn: Callable[[str], None] | None = None) -> list[LayerRecord]:
    """The layer records of the Metis profile at `path` (module docstring); SpecError naming the
    file and the field for anything it cannot read."""
    source = Path(path)
    if not model:
        raise SpecError(f"{source}: a Metis profile needs the model its layers belong to; pass --model SPEC")
    if not device:
        raise SpecError(f"{source}: pass --device (the catalog name of the profiled device type)")
    if not seq_len or seq_len <= 0:
        raise SpecError(f"{source}: Metis profiles do not record the sequence length; pass --seq N "
                        "(the sequence length the profile was measured at)")
    named = FILE_NAME.search(source.name)
    if named is None:
        raise SpecError(f"{source}: a Metis profile is named {NAME_FORM} (it states the device type, tp and "
                        f"batch size); got {source.name!r}")
    tp, micro_batch = int(named.group(2)), int(named.group(3))
    if tp < 1 or micro_batch < 1:
        raise SpecError(f"{source}: tp {tp} and batch size {micro_batch} in the file name must be at least 1")
    data = _json_object(source)
    times_ms = _layer_times(source, data)
    memory_mb, memory_note = _layer_memory(source, data, len(times_ms))
    chosen, how = resolve_dtype(str(source), None, dtype)
    graph = model_at(model, seq_len, chosen)
    hashes = map_layers(source, graph, len(times_ms), model)
    if warn is not None:
        _check_params(source, data, graph, hashes, tp, model, warn)
    groups: dict[str, list[int]] = {}
    for i, block in enumerate(hashes):
        groups.setdefault(block, []).append(i)
    records = []
    for block, indices in groups.items():
        total_s = ms_to_s(statistics.median(times_ms[i] for i in indices))
        peak = None if memory_mb is None else statistics.median(memory_mb[i] for i in indices) * MIB
        where = _span(indices)
        notes = [f"metis {source.name} layer_compute_total_ms{where}: forward + backward of one micro-batch; "
                 "forward = total / 3, backward = 2 x forward", f"seq_len {seq_len} from --seq", how]
        if peak is not None:
            notes.append(f"peak_bytes = layer_memory_total_mb{where} x 2**20 (with parameters, gradients and "
                         "optimizer states)")
        elif memory_note:
            notes.append(memory_note)
        if tp > 1:
            notes.append("includes the layer's tensor-parallel communication")
        records.append(LayerRecord(
            block_hash=block, block_name=f"metis layer{where}", model=model, device=device, tp=tp,
            micro_batch=micro_batch, seq_len=seq_len, dtype=chosen, forward_s=total_s * FORWARD_SHARE,
            backward_s=total_s * (1.0 - FORWARD_SHARE), peak_bytes=peak, repeats=len(indices),
            source="; ".join(notes)))
    return records


def map_layers(source: Path, graph: ModelGraph, count: int, spec: str) -> list[str]:
    """The block hash of each of a profile's `count` layers (module docstring: Mapping)."""
    layers = [layer.block for layer in graph.layers]
    if count == len(layers):
        return layers
    middle = set(layers[1:-1])
    if count >= 3 and len(layers) >= 3 and len(middle) == 1:
        return [layers[0], *[layers[1]] * (count - 2), layers[-1]]
    kinds = ", ".join(graph.block_by_hash[h].kind for h in dict.fromkeys(layers))
    raise SpecError(f"{source}: execution_time.layer_compute_total_ms has {count} layers and {spec} has "
                    f"{len(layers)} ({kinds}); accepted: as many layers as the model, or at least 3 for a model of "
                    "a first layer, one repeated block and a last layer")


def _json_object(source: Path) -> dict[str, Any]:
    return json_object(source, "a Metis profile is a JSON object with execution_time, execution_memory and model")


def _section(source: Path, data: dict[str, Any], name: str, required: bool, field: str = "") -> dict[str, Any]:
    """The object `data[name]` (empty when absent and not required); SpecError naming `field` otherwise."""
    section = data.get(name)
    if section is None and not required:
        return {}
    if not isinstance(section, dict):
        shown = "missing" if section is None else f"{section!r} is not an object"
        raise SpecError(f"{source}: {field or name} {shown}; a Metis profile has {field or name}: {{...}}")
    return section


def _layer_times(source: Path, data: dict[str, Any]) -> list[float]:
    times = _section(source, data, "execution_time", True).get("layer_compute_total_ms")
    field = "execution_time.layer_compute_total_ms"
    if not isinstance(times, list) or not times:
        raise SpecError(f"{source}: {field} {times!r} is not a list of milliseconds, one per layer")
    values = [positive_number(t, str(source), f"{field}[{i}]", "milliseconds") for i, t in enumerate(times)]
    declared = _section(source, data, "model", False).get("num_layers")
    if declared is not None and declared != len(values):
        raise SpecError(f"{source}: model.num_layers {declared!r} is not the {len(values)} layers of {field}; "
                        "they must agree")
    return values


def _layer_memory(source: Path, data: dict[str, Any], count: int) -> tuple[list[float] | None, str]:
    memory = _section(source, data, "execution_memory", False).get("layer_memory_total_mb")
    field = "execution_memory.layer_memory_total_mb"
    if memory is None:
        return None, ""
    if not isinstance(memory, list):
        raise SpecError(f"{source}: {field} {memory!r} is not a list of MB, one per layer")
    values = [positive_number(m, str(source), f"{field}[{i}]", "MB") for i, m in enumerate(memory)]
    if len(values) != count:
        return None, f"memory not imported: {field} has {len(values)} entries for {count} layers"
    return values, ""


def _check_params(source: Path, data: dict[str, Any], graph: ModelGraph, hashes: list[str], tp: int, spec: str,
                  warn: Callable[[str], None]) -> None:
    """Warn when the repeated block's parameter size in the file does not fit the model's block."""
    sizes = _section(source, _section(source, data, "model", False), "parameters", False,
                     "model.parameters").get("parameters_per_layer_bytes")
    if not isinstance(sizes, list) or len(sizes) != len(hashes) or len(hashes) < 3:
        return
    block = graph.block_by_hash[hashes[len(hashes) // 2]]
    size = sizes[len(hashes) // 2]
    if isinstance(size, int | float) and not params_plausible(float(size), block.params, tp):
        warn(f"{source}: model.parameters.parameters_per_layer_bytes[{len(hashes) // 2}] is {size}, not 1, 2 or 4 "
             f"bytes a parameter of {spec}'s {block.kind} block ({block.params} parameters): is --model the "
             "profiled model?")


def _span(indices: list[int]) -> str:
    """`[3]`, or `[1-8]` for consecutive layers, or `[1,4]`."""
    if len(indices) == 1:
        return f"[{indices[0]}]"
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"[{indices[0]}-{indices[-1]}]"
    return "[" + ",".join(map(str, indices)) + "]"
