"""Import what machines already print into a `tagplan-traces/1` bundle, whatever the file is.

`import_file` tells the kind of a file by its content: a Kineto trace is JSON with `traceEvents`,
an nccl-tests log has the `# size count type` column header or `#` header lines with `nThread`
or `Rank N`, iteration records are JSON lines or CSV mentioning `measured_s`. `import_to_bundle`
imports every file first and writes only when all of them are valid, so one bad file leaves the
bundle as it was; an existing bundle is appended to, never rewritten without its records.
"""

from __future__ import annotations

import gzip
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

from tagplan.errors import SpecError, unknown

from .bundle import (
    MANIFEST_FILE,
    RECORDS_FILE,
    CollectiveRecord,
    Fingerprint,
    IterationRecord,
    Manifest,
    OpRecord,
    append_records,
    now_iso,
    read_bundle,
    write_bundle,
)
from .iterations import import_iterations
from .kineto import import_kineto
from .nccl import import_nccl_tests

ImportKind = Literal["kineto", "nccl-tests", "iterations"]
KINDS: tuple[str, ...] = get_args(ImportKind)
ImportedRecord = OpRecord | CollectiveRecord | IterationRecord

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
    if "measured_s" in head and source.suffix.lower() in _ITERATION_SUFFIXES:
        return "iterations"
    if head.lstrip().startswith("{") and source.name.lower().endswith((".json", ".json.gz")):
        return "kineto"  # JSON that is not iterations: let the Kineto reader say what is wrong with it
    raise SpecError(f"{source}: cannot tell what this file is; accepted: a Kineto trace (JSON with traceEvents), "
                    "an nccl-tests log ('# size count type' header or '#  Rank N ... on HOST' lines), iteration "
                    f"records (.jsonl or .csv with a measured_s field); or pass kind= one of {', '.join(KINDS)}")


def import_file(path: str | os.PathLike[str], *, device: str | None = None,
                kind: str | None = None) -> tuple[str, list[ImportedRecord]]:
    """(kind, records) of one file; `kind` is detected unless given; `device` names the measured device.

    Kineto traces and nccl-tests logs measure a device, so they need `device`; iteration records
    name their cluster themselves. SpecError naming the file for anything it cannot import.
    """
    if kind is None:
        kind = detect_kind(path)
    elif kind not in KINDS:
        raise unknown("import kind", kind, KINDS)
    if kind == "iterations":
        return kind, list(import_iterations(path))
    if not device:
        raise SpecError(f"{path}: a {kind} file measures one device type; pass device= (its catalog name, "
                        "or a name for a device outside the catalog)")
    if kind == "kineto":
        return kind, list(import_kineto(path, device=device))
    return kind, list(import_nccl_tests(path, device=device))


def import_to_bundle(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], *, device: str,
                     source: str) -> Path:
    """Import `paths` into the bundle at `out_dir` (created, or appended to); returns its directory.

    Everything is read and validated before anything is written. A new bundle's fingerprint names
    `device` only: the host doing the import is not the one that was measured. SpecError if a file
    cannot be imported or holds no records, or if the existing bundle measured another device.
    """
    if not paths:
        raise SpecError("import: no files given; expected Kineto traces, nccl-tests logs or iteration records")
    records: list[ImportedRecord] = []
    for path in paths:
        kind, found = import_file(path, device=device)
        if not found:
            raise SpecError(f"{path}: no records found in this {kind} file; nothing to import")
        records.extend(found)
    out = Path(out_dir)
    if (out / MANIFEST_FILE).is_file():
        measured = read_bundle(out).manifest.fingerprint.device_type
        if measured != device:
            raise SpecError(f"{out}: the bundle measured device {measured!r}; these files were imported for "
                            f"{device!r}; import them into another bundle directory")
        append_records(out, records)
    elif (out / RECORDS_FILE).exists():
        raise SpecError(f"{out}: has {RECORDS_FILE} but no {MANIFEST_FILE}; not a bundle to append to, "
                        "and not overwritten")
    else:
        manifest = Manifest(created=now_iso(), source=source, fingerprint=Fingerprint(device_type=device))
        write_bundle(out, manifest, records)
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
