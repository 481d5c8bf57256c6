"""Import what machines already print into a `tagplan-traces/1` bundle, whatever the file is.

`import_file` tells the kind of a file by its content: a Kineto trace is JSON with `traceEvents`,
an nccl-tests log has the `# size count type` column header or `#` header lines with `nThread`
or `Rank N`, a Metis profile has `layer_compute_total_ms` or Metis's file name, a Galvatron profile has keys such as
`layertype_0_bsz8_seq2048` or `tp_activation_per_bsz_dict`, a layer table has `forward_s`,
`backward_s` and `micro_batch`, iteration records are JSON lines or CSV mentioning `measured_s`.
A Galvatron memory profile goes with its computation profile (`galvatron.pair_profiles`). `import_to_bundle`
imports every file first and writes only when all of them are valid, so one bad file leaves the
bundle as it was; an existing bundle is appended to, never rewritten without its records.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, get_args

from tagplan.errors import SpecError, unknown
from tagplan.frontends.catalog import find_device, known_devices, lookup_device
from tagplan.ir.cluster import is_cpu_name

from .bundle import (
    MANIFEST_FILE,
    RECORDS_FILE,
    CollectiveRecord,
    Fingerprint,
    IterationRecord,
    LayerRecord,
    Manifest,
    OpRecord,
    append_records,
    now_iso,
    read_bundle,
    write_bundle,
)
from .galvatron import import_galvatron, looks_like_galvatron, pair_profiles
from .iterations import import_iterations
from .kineto import import_kineto
from .layers import import_layer_table, looks_like_layer_table
from .metis import import_metis, looks_like_metis, metis_device
from .nccl import import_nccl_tests

ImportKind = Literal["kineto", "nccl-tests", "iterations", "layers", "metis", "galvatron"]
KINDS: tuple[str, ...] = get_args(ImportKind)
KIND_ALIASES = {"generic": "layers"}
"""Other names of kinds: `generic` is the generic layer table (`layers`)."""
ImportedRecord = OpRecord | CollectiveRecord | IterationRecord | LayerRecord

_HEAD_BYTES = 1 << 20  # enough to see a Kineto header or an nccl-tests column header
_NCCL = re.compile(r"^\s*#\s*size\s+count\s+type\b|^\s*#.*\bnThread\b|^\s*#\s*Rank\s+\d+", re.MULTILINE)
_ITERATION_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".json")


def detect_kind(path: str | os.PathLike[str]) -> ImportKind:
    """The kind of the file at `path`, from its first MiB; SpecError naming the file if none fits."""
    source = Path(path)
    head = _head(source)
    if '"traceEvents"' in head:
        return "kineto"
    if _NCCL.search(head):
        return "nccl-tests"
    if (looks_like_metis(head) or metis_device(source)) and source.suffix.lower() == ".json":
        return "metis"
    if looks_like_galvatron(head) and source.suffix.lower() == ".json":
        return "galvatron"
    if looks_like_layer_table(head) and source.suffix.lower() in _ITERATION_SUFFIXES:
        return "layers"
    if "measured_s" in head and source.suffix.lower() in _ITERATION_SUFFIXES:
        return "iterations"
    if head.lstrip().startswith("{") and source.name.lower().endswith((".json", ".json.gz")):
        return "kineto"  # JSON that is not iterations: let the Kineto reader say what is wrong with it
    raise SpecError(f"{source}: cannot tell what this file is; accepted: a Kineto trace (JSON with traceEvents), "
                    "an nccl-tests log ('# size count type' header or '#  Rank N ... on HOST' lines), iteration "
                    "records (.jsonl or .csv with a measured_s field), a layer table (forward_s, backward_s, "
                    "micro_batch), a Metis profile (layer_compute_total_ms) or a Galvatron profile "
                    f"(layertype_0_bsz8_seq2048 keys); or pass kind= one of {', '.join(KINDS)}")


def import_file(path: str | os.PathLike[str], *, device: str | None = None, kind: str | None = None,
                model: str | None = None, seq_len: int | None = None, dtype: str | None = None,
                memory: str | os.PathLike[str] | None = None,
                warn: Callable[[str], None] | None = None) -> tuple[str, list[ImportedRecord]]:
    """(kind, records) of one file; `kind` is detected unless given; `device` names the measured device.

    Kineto traces and nccl-tests logs measure a device, so they need `device`; iteration records
    name their cluster themselves. Layer tables and Metis and Galvatron profiles need `model`, the
    SPEC whose blocks their layers are; Metis profiles also `seq_len`; `dtype` is the precision of
    profiles that do not state theirs; `memory` is the Galvatron memory profile that goes with a
    computation profile. SpecError naming the file for anything it cannot import.
    """
    kind = resolve_kind(path, kind)
    if kind == "iterations":
        return kind, list(import_iterations(path))
    if kind == "layers":
        return kind, list(import_layer_table(path, model=model, device=device))
    if kind == "metis":
        return kind, list(import_metis(path, model=model, device=device, seq_len=seq_len, dtype=dtype, warn=warn))
    if kind == "galvatron":
        return kind, list(import_galvatron(path, memory=memory, model=model, device=device, dtype=dtype, warn=warn))
    if not device:
        raise SpecError(f"{path}: a {kind} file measures one device type; pass device= (its catalog name, "
                        "or a name for a device outside the catalog)")
    if kind == "kineto":
        return kind, list(import_kineto(path, device=device))
    return kind, list(import_nccl_tests(path, device=device))


def resolve_kind(path: str | os.PathLike[str], kind: str | None) -> str:
    """`kind` (an alias resolved), or the detected kind of the file when None; SpecError for an unknown kind."""
    if kind is None:
        return detect_kind(path)
    kind = KIND_ALIASES.get(kind, kind)
    if kind not in KINDS:
        raise unknown("import kind", kind, (*KINDS, *KIND_ALIASES))
    return kind


def measured_device(path: str | os.PathLike[str], kind: str) -> str | None:
    """The device a file says it measured, where it says so: a Kineto trace's `deviceProperties` name
    (or "cpu" when it holds no GPU kernels), an nccl-tests log's `[0x..] NAME` rank lines, a Metis
    file name's `DeviceType.NAME`; else None."""
    if kind == "metis":
        return metis_device(path)
    head = _head(Path(path))
    if kind == "nccl-tests":
        found = re.search(r"^#\s*Rank\s+\d+.*\[0x[0-9a-fA-F]+\]\s+(.+?)\s*$", head, re.MULTILINE)
        return found.group(1) if found else None
    if kind != "kineto":
        return None
    try:
        opener = gzip.open if Path(path).suffix == ".gz" else open
        with opener(path, "rt") as handle:
            trace = json.load(handle)
    except (OSError, ValueError, EOFError):
        return None
    props = trace.get("deviceProperties") if isinstance(trace, dict) else None
    if isinstance(props, list) and props and isinstance(props[0], dict) and props[0].get("name"):
        return str(props[0]["name"])
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else []
    gpu = any(isinstance(e, dict) and str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy") for e in events)
    return None if gpu else "cpu"


def device_disagrees(measured: str, device: str) -> bool:
    """Whether a file's own device name contradicts `device` (model tokens like A100, H100 compared; a CPU
    trace filed as a GPU or the other way round)."""
    if is_cpu_name(measured) != is_cpu_name(device):
        return True
    known, imported = find_device(measured), find_device(device)
    if known is not None and imported is not None and known.name != imported.name:  # A100 40 GB and 80 GB
        return True
    tokens = lambda name: set(re.findall(r"[a-z]{1,3}\d{2,4}[a-z]?", name.lower()))  # noqa: E731
    a, b = tokens(measured), tokens(device)
    return bool(a and b and not a & b)


def import_to_bundle(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], *, device: str,
                     source: str, warn: Callable[[str], None] | None = None, model: str | None = None,
                     kind: str | None = None, seq_len: int | None = None, dtype: str | None = None) -> Path:
    """Import `paths` into the bundle at `out_dir` (created, or appended to); returns its directory.

    Everything is read and validated before anything is written. `kind` applies to every file
    (detected per file when None); `model`, `seq_len` and `dtype` as `import_file` takes them.
    Galvatron memory profiles are imported with their computation profiles. A new bundle's
    fingerprint names `device` only: the host doing the import is not the one that was measured.
    SpecError if a file cannot be imported or holds no records, or if the existing bundle measured
    another device.
    """
    if not paths:
        raise SpecError("import: no files given; expected Kineto traces, nccl-tests logs, iteration records, layer "
                        "tables, or Metis or Galvatron profiles")
    device = catalog_name(device, warn)
    kinds = {Path(p): resolve_kind(p, kind) for p in paths}
    memories = dict(pair_profiles([p for p, k in kinds.items() if k == "galvatron"]))
    files: list[tuple[Path, list[ImportedRecord]]] = []
    for path in (p for p, k in kinds.items() if k != "galvatron" or p in memories):
        _, found = import_file(path, device=device, kind=kinds[path], model=model, seq_len=seq_len, dtype=dtype,
                               memory=memories.get(path), warn=warn)
        if not found:
            raise SpecError(f"{path}: no records found in this {kinds[path]} file; nothing to import")
        measured = measured_device(path, kinds[path])
        if warn is not None and measured is not None and device_disagrees(measured, device):
            warn(f"{path}: the file says it measured {measured!r}, but it is imported as {device!r}")
        files.append((path, _on_device(path, found, device)))
    out = Path(out_dir)
    if (out / MANIFEST_FILE).is_file():
        existing = read_bundle(out)
        measured = existing.manifest.fingerprint.device_type
        if catalog_name(measured, None) != device:
            raise SpecError(f"{out}: the bundle measured device {measured!r}; these files were imported for "
                            f"{device!r}; import them into another bundle directory")
        records = _not_imported_before(files, existing.records, warn)
        if records:
            append_records(out, records)
    elif (out / RECORDS_FILE).exists():
        raise SpecError(f"{out}: has {RECORDS_FILE} but no {MANIFEST_FILE}; not a bundle to append to, "
                        "and not overwritten")
    else:
        manifest = Manifest(created=now_iso(), source=source, fingerprint=Fingerprint(device_type=device))
        write_bundle(out, manifest, [r for _, found in files for r in found])
    return out


def catalog_name(device: str, warn: Callable[[str], None] | None) -> str:
    """`device` as the catalog names it (`h100`, `NVIDIA H100 80GB HBM3` -> `H100-SXM`): records apply to a
    cluster's devices by that name. A name outside the catalog (a CPU, a cluster file's own GPU) is kept, with a
    warning unless it names a CPU: its records apply only to devices named exactly so."""
    try:
        name = lookup_device(device).name
    except SpecError:
        if warn is not None and not is_cpu_name(device):
            warn(f"device {device!r} is not in the catalog ({', '.join(known_devices())}): its records apply only "
                 f"to a cluster whose GPU is named exactly {device!r} (a cluster file's own GPU)")
        return device
    variants = [n for n in known_devices() if _spelled(device) in _prefixes(n)]
    if warn is not None and len(variants) > 1 and _spelled(device) != _spelled(name):  # `a100`: the 40 GB SXM
        warn(f"device {device!r} is imported as the catalog's {name!r}; give the exact name for another variant "
             f"({', '.join(variants)})")
    return name


def _prefixes(name: str) -> set[str]:
    """A catalog name's leading parts as `_spelled` writes them: A100-SXM-40GB -> a100, a100sxm, a100sxm40gb."""
    parts = re.split(r"[^A-Za-z0-9]+", name)
    return {_spelled("".join(parts[: i + 1])) for i in range(len(parts))}


def _spelled(name: str) -> str:
    """A device name without case or separators, as the catalog compares names."""
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _on_device(path: Path, records: list[ImportedRecord], device: str) -> list[ImportedRecord]:
    """`records` with the device each names written as the catalog names it; SpecError where one names another
    device than the one imported (a layer table's device column)."""
    out = []
    for number, record in enumerate(records):
        named = getattr(record, "device", None)
        if isinstance(named, str):
            if catalog_name(named, None) != device:
                raise SpecError(f"{path}: record {number + 1} measured device {named!r}, but the files are imported "
                                f"as {device!r}; import each device's rows into its own bundle (--device)")
            record = record.model_copy(update={"device": device}) if named != device else record
        out.append(record)
    return out


def _not_imported_before(files: Sequence[tuple[Path, list[ImportedRecord]]], existing: Sequence[object],
                         warn: Callable[[str], None] | None) -> list[ImportedRecord]:
    """The records of the files beyond those the bundle already holds, counted: a file imported again, or grown
    since (a training log with new lines), adds only what it adds (a measurement counted twice is weighed twice
    and lands on both sides of a cross-validation split), while a row a file holds twice, two runs printing the
    same figures, is kept twice."""
    held = Counter(record.model_dump_json() for record in existing if hasattr(record, "model_dump_json"))
    out: list[ImportedRecord] = []
    for path, found in files:
        new = []
        for record in found:
            key = record.model_dump_json()
            if held[key] > 0:
                held[key] -= 1
            else:
                new.append(record)
        if warn is not None and len(new) < len(found):
            warn(f"{path}: the bundle already holds {len(found) - len(new)} of its {len(found)} record(s) "
                 f"(imported before); {'only the rest are added' if new else 'skipped'}")
        out.extend(new)
    return out


def _head(path: Path) -> str:
    """The first MiB of the file as text (decompressed for .gz); SpecError if it cannot be read."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            raw = handle.read(_HEAD_BYTES)
    except (OSError, EOFError) as err:
        raise SpecError(f"cannot read {path}: {getattr(err, 'strerror', None) or err}") from None
    return raw.decode("utf-8", errors="replace")
