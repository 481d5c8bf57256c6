"""Trace bundles: measurements of real hardware in one on-disk format, `tagplan-traces/1`.

A bundle is a directory holding

- `manifest.json`: a `Manifest` (format, creation date, the command or importer that made it,
  the fingerprint of the machine measured, and the `DeviceSpec` the compute records refer to);
- `records.jsonl`: one measurement per line, each a JSON object with a `record` field:
  - `op` (`OpRecord`): one kernel or op of one call, its FLOPs and bytes as `ir.model.Op` counts
    them and its measured seconds, forward or backward;
  - `collective` (`CollectiveRecord`): one collective over `ranks` processes on `nodes` machines,
    its message size as nccl-tests counts it and its measured seconds;
  - `iteration` (`IterationRecord`): one measured training iteration of a plan;
  - `layer` (`LayerRecord`): one block (layer kind) of a model measured on one device of a
    `tp`-way group at one micro-batch size: forward and backward seconds, memory where known.

Every time is seconds, every size bytes, every rate per second. `write_bundle` writes both files
atomically (a temporary file renamed into place), so a failed write leaves what was stored
before intact; `append_records` adds to a bundle the same way. `read_bundle` names the file and
line of the first malformed record.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import Field, TypeAdapter, ValidationError

from tagplan.errors import SpecError
from tagplan.ir.base import Record
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.model import OpKind
from tagplan.ir.workload import DType, Workload

FORMAT: Final = "tagplan-traces/1"
MANIFEST_FILE = "manifest.json"
RECORDS_FILE = "records.jsonl"
RECORD_KINDS = ("op", "collective", "iteration", "layer")


class Fingerprint(Record):
    """What was measured: device type and count, software versions, host."""

    device_type: str = Field(min_length=1, description="catalog name, or a name for a device outside it")
    device_name: str = Field(default="", description="as the driver or OS reports it")
    device_count: int = Field(default=1, ge=1)
    backend: str = Field(default="", description="cpu, cuda, ...")
    torch: str = ""
    driver: str = ""
    cuda: str = ""
    host: str = ""
    os: str = ""
    cpu: str = ""


class Manifest(Record):
    """A bundle's header."""

    format: Literal["tagplan-traces/1"] = FORMAT
    created: str = Field(description="ISO 8601, UTC")
    source: str = Field(min_length=1, description="the command or importer that made the bundle")
    fingerprint: Fingerprint
    device: DeviceSpec | None = Field(default=None, description="the figures op efficiencies are relative to")
    notes: str = ""


class OpRecord(Record):
    """One op call measured on one device."""

    record: Literal["op"] = "op"
    device: str = Field(min_length=1, description="device type (a Fingerprint.device_type)")
    kind: OpKind
    name: str = Field(default="", description="what was run, e.g. aten::mm or matmul 1024x1024x1024")
    phase: Literal["forward", "backward", "step"] = "forward"
    dtype: DType
    flops: float = Field(ge=0, description="FLOPs of the call")
    bytes_read: float = Field(ge=0, description="bytes read by the call, parameters included")
    bytes_written: float = Field(ge=0)
    param_bytes: float = Field(default=0.0, ge=0)
    time_s: float = Field(gt=0, description="median seconds per call")
    repeats: int = Field(default=1, ge=1, description="calls the median is over")
    shape: dict[str, int] = Field(default_factory=dict, description="the dimensions that define the call")


class CollectiveRecord(Record):
    """One collective (or p2p transfer) among `ranks` processes."""

    record: Literal["collective"] = "collective"
    collective: Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "broadcast"]
    backend: str = Field(min_length=1, description="gloo, nccl, ...")
    device: str = Field(min_length=1, description="device type of the ranks")
    ranks: int = Field(ge=2)
    nodes: int = Field(default=1, ge=1)
    bytes: float = Field(gt=0, description="message size per rank, as nccl-tests' size column")
    time_s: float = Field(gt=0, description="median seconds per call")
    repeats: int = Field(default=1, ge=1)
    bus_bandwidth_Bps: float | None = Field(default=None, gt=0, description="as nccl-tests reports busbw")


class IterationRecord(Record):
    """One measured training iteration: what ran, on what, how long it took."""

    record: Literal["iteration"] = "iteration"
    model: str | dict[str, Any] = Field(description="a model SPEC, or an inline tagplan-graph/1 JSON object")
    cluster: str | dict[str, Any] = Field(description="a cluster SPEC, or an inline cluster file object")
    workload: Workload
    plan: dict[str, Any] = Field(description="a Plan JSON object (docs/PLAN_FORMAT.md)")
    measured_s: float = Field(gt=0, description="seconds per iteration (median over steady-state steps)")
    repeats: int = Field(default=1, ge=1)
    peak_memory_bytes: float | None = Field(default=None, ge=0, description="peak memory allocated on the device "
                                            "over the measured steps, where known")
    peak_reserved_bytes: float | None = Field(default=None, ge=0, description="peak memory the runtime's allocator "
                                              "reserved from the device (allocated plus its cache and fragmentation: "
                                              "what runs out first), where known")
    source: str = ""


class LayerRecord(Record):
    """One block of a model measured per micro-batch on one device of a `tp`-way group (no communication)."""

    record: Literal["layer"] = "layer"
    block_hash: str = Field(min_length=1, description="the model's structural block hash (ir.model.Block.hash)")
    block_name: str = Field(default="", description="the layer kind as the source named it (decoder, embedding...)")
    model: str = Field(default="", description="the model SPEC the block belongs to, where known")
    device: str = Field(min_length=1, description="device type (a Fingerprint.device_type)")
    tp: int = Field(default=1, ge=1, description="tensor-parallel degree the block was sharded over")
    micro_batch: int = Field(ge=1, description="samples per micro-batch")
    seq_len: int = Field(gt=0)
    dtype: DType
    forward_s: float = Field(gt=0, description="median seconds of the forward pass of one micro-batch")
    backward_s: float = Field(gt=0, description="median seconds of the backward pass of one micro-batch")
    activation_bytes: float | None = Field(default=None, ge=0, description="bytes saved for the backward")
    peak_bytes: float | None = Field(default=None, ge=0, description="peak memory while running the block")
    repeats: int = Field(default=1, ge=1)
    source: str = ""


TraceRecord = Annotated[OpRecord | CollectiveRecord | IterationRecord | LayerRecord, Field(discriminator="record")]
_RECORD = TypeAdapter(TraceRecord)


class Bundle(Record):
    """A bundle in memory: its manifest and records, in file order."""

    manifest: Manifest
    records: tuple[TraceRecord, ...] = ()

    def ops(self) -> list[OpRecord]:
        """The op records."""
        return [r for r in self.records if isinstance(r, OpRecord)]

    def collectives(self) -> list[CollectiveRecord]:
        """The collective records."""
        return [r for r in self.records if isinstance(r, CollectiveRecord)]

    def iterations(self) -> list[IterationRecord]:
        """The iteration records."""
        return [r for r in self.records if isinstance(r, IterationRecord)]

    def layers(self) -> list[LayerRecord]:
        """The layer records."""
        return [r for r in self.records if isinstance(r, LayerRecord)]


def now_iso() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def host_fingerprint(device_type: str, *, device_name: str = "", device_count: int = 1, backend: str = "cpu",
                     driver: str = "", cuda: str = "") -> Fingerprint:
    """A fingerprint of this host with the given device figures and the installed torch."""
    import torch

    return Fingerprint(device_type=device_type, device_name=device_name, device_count=device_count, backend=backend,
                       torch=torch.__version__, driver=driver, cuda=cuda, host=socket.gethostname(),
                       os=f"{platform.system()} {platform.release()}", cpu=platform.processor() or platform.machine())


def write_bundle(directory: str | os.PathLike[str], manifest: Manifest, records: Iterable[TraceRecord]) -> Path:
    """Write a bundle (replacing one that is there) and return its directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / RECORDS_FILE, "".join(r.model_dump_json() + "\n" for r in records))
    _atomic_write(out / MANIFEST_FILE, manifest.model_dump_json(indent=2) + "\n")
    return out


def append_records(directory: str | os.PathLike[str], records: Sequence[TraceRecord]) -> int:
    """Add `records` to an existing bundle (validated first); returns how many it now holds."""
    bundle = read_bundle(directory)
    all_records = (*bundle.records, *records)
    write_bundle(directory, bundle.manifest, all_records)
    return len(all_records)


def read_bundle(directory: str | os.PathLike[str]) -> Bundle:
    """Read and validate a bundle; SpecError naming the file and line of the first bad part."""
    root = Path(directory)
    manifest_path, records_path = root / MANIFEST_FILE, root / RECORDS_FILE
    if not root.is_dir():
        raise SpecError(f"{root}: not a trace bundle directory (expected {MANIFEST_FILE} and {RECORDS_FILE} in it)")
    if not manifest_path.is_file():
        raise SpecError(f"{manifest_path}: missing; a {FORMAT} bundle has a manifest")
    try:
        manifest = Manifest.model_validate_json(manifest_path.read_text())
    except ValidationError as err:
        raise SpecError(f"{manifest_path}: not a {FORMAT} manifest: {_first_error(err)}") from None
    records = []
    if records_path.is_file():
        with records_path.open() as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    records.append(parse_record(line, f"{records_path}:{number}"))
    return Bundle(manifest=manifest, records=tuple(records))


def parse_record(line: str, where: str) -> OpRecord | CollectiveRecord | IterationRecord | LayerRecord:
    """One JSON line as a record; SpecError naming `where` (file:line) and the bad field."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise SpecError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise SpecError(f"{where}: not readable JSON: nested too deeply (a record nests a few levels)") from None
    except ValueError as err:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        raise SpecError(f"{where}: not readable JSON: {str(err).split(';')[0]}") from None
    if not isinstance(data, dict) or data.get("record") not in RECORD_KINDS:
        kind = data.get("record") if isinstance(data, dict) else type(data).__name__
        raise SpecError(f"{where}: record {kind!r} is not one of {', '.join(map(repr, RECORD_KINDS))}")
    try:
        return _RECORD.validate_python(data)
    except ValidationError as err:
        raise SpecError(f"{where}: invalid {data['record']} record: {_first_error(err)}") from None


def _first_error(err: ValidationError) -> str:
    e = err.errors()[0]
    path = ".".join(str(p) for p in e.get("loc", ()) if p not in RECORD_KINDS) or "(top level)"
    got = e.get("input")
    shown = repr(got) if not isinstance(got, dict | list) else type(got).__name__
    return f"{path}: {e.get('msg', '')} (got {shown[:80]})"


def _atomic_write(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
