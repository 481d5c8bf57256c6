"""Measured training iterations (JSON lines or CSV) -> `IterationRecord`s.

JSON lines: one object per line with keys `model`, `cluster`, `workload`, `plan`, `measured_s`
and optionally `repeats` and `source`. CSV: a header row naming those columns; `workload` is JSON
text, `plan` JSON text or the path of a Plan JSON file (relative to the CSV), `model` and
`cluster` a SPEC string (or JSON text of an inline object). In both, `plan` is validated as a
`Plan` (docs/PLAN_FORMAT.md) and stored in its canonical form, `workload` as a `Workload`.
Model and cluster SPECs are stored as given, and resolved at import (`rebuild_record`): a record whose model or
cluster does not load, whose plan does not cover the model, or whose time beats what the plan's GPUs can compute
at their peak (`peak_refusal`: a unit mistake, a wrong batch) is refused there, not by every later fit.

Every error is a SpecError naming the file, the line, the field and what was wrong.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from tagplan.cost.bounds import lower_bound_s
from tagplan.errors import SpecError
from tagplan.frontends.catalog import find_device
from tagplan.frontends.cluster_file import parse_cluster_data
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.json_graph import graph_from_dict
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.plan_file import plan_data
from tagplan.frontends.presets import replace_node
from tagplan.frontends.textfile import read_text
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, check_plan
from tagplan.ir.workload import DType, Workload

from .bundle import IterationRecord

REQUIRED = ("model", "cluster", "workload", "plan", "measured_s")
OPTIONAL = ("repeats", "source")
_JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
_Model = TypeVar("_Model", Plan, Workload, IterationRecord)


def import_iterations(path: str | os.PathLike[str]) -> list[IterationRecord]:
    """The iteration records in the JSON-lines or CSV file at `path` (seconds per iteration)."""
    source = Path(path)
    text = read_text(source)
    if source.suffix.lower() == ".csv" or (source.suffix.lower() not in _JSON_SUFFIXES
                                           and not text.lstrip().startswith("{")):
        return _from_csv(source, text)
    return _from_json_lines(source, text)


def _from_json_lines(source: Path, text: str) -> list[IterationRecord]:
    records: list[IterationRecord] = []
    built: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise SpecError(f"{where}: not JSON ({err.msg} at column {err.colno}); expected one iteration "
                            f"object per line with keys {', '.join(REQUIRED)}") from None
        if not isinstance(data, dict):
            raise SpecError(f"{where}: a JSON {type(data).__name__}; expected an object with keys "
                            f"{', '.join(REQUIRED)}")
        records.append(_record(data, where, source.parent, built))
    return records


def csv_header(source: Path, first_row: list[str], required: tuple[str, ...] | list[str],
               optional: tuple[str, ...] | list[str]) -> list[str]:
    """The stripped header of a CSV table; SpecError naming the file, its line 1, the missing or
    unknown columns, what the header has and what is accepted."""
    header = [h.strip() for h in first_row]
    missing = [c for c in required if c not in header]
    unknown = [c for c in header if c not in (*required, *optional)]
    if missing or unknown:
        problem = f"missing column(s) {', '.join(missing)}" if missing else f"unknown column(s) {', '.join(unknown)}"
        raise SpecError(f"{source}:1: {problem}; the header has {', '.join(header) or 'nothing'}; expected "
                        f"{', '.join(required)} and optionally {', '.join(optional)}")
    return header


def _from_csv(source: Path, text: str) -> list[IterationRecord]:
    reader = csv.reader(io.StringIO(text))
    header = csv_header(source, next(reader, []), REQUIRED, OPTIONAL)
    records, end = [], reader.line_num
    built: dict[str, Any] = {}
    for row in reader:
        start, end = end + 1, reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        where = f"{source}:{start}"
        if len(row) != len(header):
            raise SpecError(f"{where}: {len(row)} cells; the header has {len(header)} columns ({', '.join(header)})")
        cells = {name: cell.strip() for name, cell in zip(header, row, strict=True)}
        records.append(_record(_parse_cells(cells, where), where, source.parent, built))
    return records


def _parse_cells(cells: dict[str, str], where: str) -> dict[str, Any]:
    """CSV cells as the values a JSON line would carry (JSON text parsed, numbers converted)."""
    data: dict[str, Any] = {k: v for k, v in cells.items() if v or k in REQUIRED}
    for name in ("model", "cluster", "plan"):
        if data[name].startswith("{"):
            data[name] = _json_cell(data[name], name, where)
    data["workload"] = _json_cell(data["workload"], "workload", where)
    for name, kind in (("measured_s", float), ("repeats", int)):
        if name in data:
            try:
                data[name] = kind(data[name])
            except ValueError:
                raise SpecError(f"{where}: {name} {data[name]!r} is not a{'n integer' if kind is int else ' number'}"
                                ) from None
    return data


def _json_cell(text: str, name: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecError(f"{where}: {name}: not JSON text ({err.msg} at character {err.pos}): {text[:60]!r}") from None


def _record(data: dict[str, Any], where: str, base: Path, built: dict[str, Any]) -> IterationRecord:
    """Validate one iteration's fields; SpecError naming `where` and the field."""
    missing = [k for k in REQUIRED if k not in data]
    unknown = [k for k in data if k not in (*REQUIRED, *OPTIONAL, "record")]
    if missing or unknown:
        problem = f"missing field(s) {', '.join(missing)}" if missing else f"unknown field(s) {', '.join(unknown)}"
        raise SpecError(f"{where}: {problem}; expected {', '.join(REQUIRED)} and optionally {', '.join(OPTIONAL)}")
    plan = _load_plan(data["plan"], where, base) if isinstance(data["plan"], str) else data["plan"]
    fields = {**data, "record": "iteration", "plan": _validated(Plan, plan, "plan", where).model_dump(mode="json"),
              "workload": _validated(Workload, data["workload"], "workload", where)}
    record = _validated(IterationRecord, fields, "", where)
    possible_record(record, where, built)
    return record


def rebuild_record(record: IterationRecord, where: str,
                   built: dict[str, Any] | None = None) -> tuple[ModelGraph, Cluster, Plan]:
    """The model, cluster and plan a record names; SpecError naming `where` when one does not load. `built`: the
    SPECs' graphs and clusters already built for other records of one file (kept there, not process-wide)."""
    built = {} if built is None else built
    w = record.workload
    try:
        if isinstance(record.model, str):
            key = json.dumps(["model", record.model, w.seq_len, w.dtype.value])
            model = built[key] if key in built else built.setdefault(
                key, load_model(record.model, seq_len=w.seq_len, dtype=w.dtype))
        else:
            model = graph_from_dict(record.model, source=f"{where}: model")
        if isinstance(record.cluster, str):
            key = json.dumps(["cluster", record.cluster])
            cluster = built[key] if key in built else built.setdefault(key, load_cluster(record.cluster))
        else:
            cluster = parse_cluster_data(record.cluster, default_name="measured")
        plan = Plan.model_validate(record.plan)
        check_plan(plan, model, cluster)
    except (SpecError, ValueError) as err:
        raise SpecError(f"{where}: {err}") from None
    return model, cluster, plan


def possible_record(record: IterationRecord, where: str,
                    built: dict[str, Any] | None = None) -> tuple[ModelGraph, Cluster, Plan]:
    """`rebuild_record`, then SpecError naming `where` where the measured time cannot be a run of the plan
    (`peak_refusal`): what an import holds every record to, and fine-tuning every record of a bundle no import wrote
    (a service upload, a file by hand)."""
    model, cluster, plan = rebuild_record(record, where, built)
    refusal = peak_refusal(model, cluster, plan, record.workload, record.measured_s)
    if refusal:
        raise SpecError(f"{where}: {refusal}")
    return model, cluster, plan


def catalog_figures(cluster: Cluster) -> Cluster:
    """`cluster` with every device whose name the catalog knows at the catalog's figures: a record cannot make
    its time possible by declaring a GPU of a known name faster than it is (a cluster file's own GPU under
    another name keeps its figures, and applies only to clusters of that name)."""
    nodes = tuple(replace_node(node, device=known) if (known := find_device(node.device.name)) is not None else node
                  for node in cluster.nodes)
    return Cluster(name=cluster.name, nodes=nodes, network=cluster.network)


def peak_refusal(model: ModelGraph, cluster: Cluster, plan: Plan, workload: Workload, measured_s: float) -> str | None:
    """Why `measured_s` cannot be an iteration of `plan` (None: it can): it is shorter than the model's matrix
    multiplications alone take (forward, and twice that backward, over the global batch) on the plan's devices at
    their peak dense rate in the workload's dtype (`cost.bounds.lower_bound_s`); an fp32 run at the 16-bit tensor
    rate, since it may compute its GEMMs as TF32 or on AMD's matrix cores, faster than the catalog's fp32 figure."""
    if workload.dtype is DType.FP32:
        workload = workload.model_copy(update={"dtype": DType.BF16})
    bound_s = max(lower_bound_s(model, c, workload, devices=plan.devices, matmuls_only=True)
                  for c in (cluster, catalog_figures(cluster)))
    if measured_s >= bound_s:
        return None
    return (f"measured_s {measured_s:g} s is shorter than the {bound_s:.3g} s this model's matrix multiplications "
            f"alone take on the plan's {len(plan.devices)} device(s) at their peak {workload.dtype.value} rate "
            f"({bound_s / measured_s:.0%} of peak): are the seconds per iteration, the batch "
            f"({workload.global_batch}) and the plan's devices those of the run?")


def _load_plan(text: str, where: str, base: Path) -> Any:
    """A plan given as a path (relative to the file that names it): its JSON object."""
    path = base / text
    if not path.is_file():
        raise SpecError(f"{where}: plan {text!r} is neither JSON text nor a file ({path} does not exist)")
    try:
        return plan_data(json.loads(read_text(path)), str(path))[0]  # a `plan --out` file: without its searched_for
    except json.JSONDecodeError as err:
        raise SpecError(f"{where}: plan file {path}: malformed JSON at line {err.lineno}, column {err.colno}: "
                        f"{err.msg}") from None


def _validated(cls: type[_Model], value: Any, name: str, where: str) -> _Model:
    try:
        return cls.model_validate(value)
    except ValidationError as err:
        e: dict[str, Any] = dict(err.errors()[0])
        loc = ".".join(str(p) for p in (name, *e.get("loc", ())) if p != "")
        got = e.get("input")
        shown = "" if isinstance(got, dict | list) else f" (got {repr(got)[:80]})"
        message = str(e.get("msg", "")).removeprefix("Value error, ")
        raise SpecError(f"{where}: {loc or name or '(top level)'}: {message}{shown}") from None
