"""What a job does: a plan request -> the planner's JSON and a timeline; a training run -> a model card.

`validate_plan_request` is the same check the worker runs, so the API rejects a bad request with
a 4xx before a job exists; whatever reaches a worker has passed it once already. Requests come
from the network: file paths are not accepted where the CLI would read a file (a model or cluster
SPEC, a GPU name), and the size limits are checked before the graph or cluster is built.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import yaml
from pydantic import ValidationError

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration, load_calibration
from tagplan.errors import SpecError, from_validation
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType, Workload
from tagplan.search.result import Objective
from tagplan.service.settings import Settings

Progress = Callable[[float, str], None]

PLAN_KEYS = ("model", "cluster", "workload", "objective", "budget_s", "max_evaluations", "seed", "time_bound_s",
             "calibration")
WORKLOAD_KEYS = ("global_batch", "seq_len", "dtype", "optimizer")
TRAIN_KEYS = ("traces", "calibration")
DEFAULT_BUDGET_S = 30.0  # the CLI's defaults, capped by the service's limits
DEFAULT_MAX_EVALUATIONS = 400
_PATH_SUFFIXES = (".json", ".yaml", ".yml", ".xml", ".txt", ".log", ".topo")
_HF_LAYER_KEYS = re.compile(r"(num_hidden_layers|num_layers|n_layer|num_decoder_layers|encoder_layers|decoder_layers)")


class Cancelled(Exception):  # noqa: N818 (the name docs/SERVICE.md promises)
    """Raised by a job's progress callback when its worker was asked to stop it."""


class LimitError(SpecError):
    """A request over one of the service's limits; `status` is the HTTP status to answer (413 | 422)."""

    def __init__(self, message: str, *, limit: str, status: int = 422) -> None:
        super().__init__(message)
        self.limit, self.status = limit, status


@dataclass(frozen=True)
class PlanProblem:
    """A validated plan request: what `plan()` needs, and the request with every default filled in."""

    model: ModelGraph
    cluster: Cluster
    workload: Workload
    objective: Objective
    budget_s: float
    max_evaluations: int
    seed: int
    time_bound_s: float | None
    calibration: Calibration
    request: dict[str, Any]


def validate_plan_request(request: Any, settings: Settings) -> None:
    """Check a plan request as a worker would; SpecError (LimitError over a limit) naming the field."""
    parse_plan_request(request, settings)


def run_job(kind: str, request: dict[str, Any], settings: Settings, progress: Progress) -> dict[str, Any]:
    """Run a job of `kind` and return its result JSON; SpecError for a bad request.

    `progress(fraction 0..1, message)` is called as the work advances; it may raise (`Cancelled`)
    to stop the job.
    """
    if kind == "plan":
        return _finite(_run_plan(request, settings, progress))
    if kind == "train":
        return _finite(_run_train(request, settings, progress))
    raise SpecError(f"job kind {kind!r} is not accepted; accepted: plan, train")


# -- plan ------------------------------------------------------------------------------------------


def parse_plan_request(request: Any, settings: Settings) -> PlanProblem:
    """The problem a plan request describes; SpecError / LimitError naming the field and value."""
    if not isinstance(request, Mapping):
        raise SpecError(f"a plan request is a JSON object with {', '.join(PLAN_KEYS)}; got {type(request).__name__}")
    _check_keys(request, PLAN_KEYS, "plan request")
    for required in ("model", "cluster"):
        if required not in request:
            raise SpecError(f"{required}: required (a SPEC string or an inline object)")
    raw_workload = _workload_fields(request.get("workload"))
    model = _model(request["model"], raw_workload.get("seq_len"), DType(raw_workload.get("dtype", "bf16")), settings)
    workload = _workload({**raw_workload, "seq_len": model.seq_len})
    cluster = _cluster(request["cluster"], settings)
    objective = _objective(request.get("objective", Objective.TIME.value))
    budget_s = _number(request.get("budget_s", min(DEFAULT_BUDGET_S, settings.max_budget_s)), "budget_s")
    if budget_s > settings.max_budget_s:
        raise LimitError(f"budget_s: {budget_s:g} is over this service's limit of {settings.max_budget_s:g} s",
                         limit="max_budget_s")
    evaluations = _whole(request.get("max_evaluations", min(DEFAULT_MAX_EVALUATIONS, settings.max_evaluations)),
                         "max_evaluations", minimum=1)
    if evaluations > settings.max_evaluations:
        raise LimitError(f"max_evaluations: {evaluations} is over this service's limit of "
                         f"{settings.max_evaluations}", limit="max_evaluations")
    seed = _whole(request.get("seed", 0), "seed", minimum=0)
    bound = request.get("time_bound_s")
    time_bound_s = None if bound is None else _number(bound, "time_bound_s")
    calibration = _calibration(request.get("calibration"), settings)
    normalised = {"model": request["model"], "cluster": request["cluster"],
                  "workload": workload.model_dump(mode="json"), "objective": objective.value, "budget_s": budget_s,
                  "max_evaluations": evaluations, "seed": seed, "time_bound_s": time_bound_s,
                  "calibration": request.get("calibration")}
    return PlanProblem(model, cluster, workload, objective, budget_s, evaluations, seed, time_bound_s, calibration,
                       normalised)


def _run_plan(request: dict[str, Any], settings: Settings, progress: Progress) -> dict[str, Any]:
    from tagplan.cost.simulator import Simulator
    from tagplan.cost.timeline import chrome_trace
    from tagplan.search.planner import plan

    progress(0.0, "loading the model and the cluster")
    problem = parse_plan_request(request, settings)
    start = time.monotonic()

    def tick(done: int, total: int) -> None:
        # The search stops at its evaluation count or its budget, whichever comes first.
        elapsed = (time.monotonic() - start) / problem.budget_s
        progress(min(0.99, max(done / max(total, 1), elapsed)), f"evaluations {done}/{total}")

    result = plan(problem.model, problem.cluster, problem.workload, objective=problem.objective,
                  budget_s=problem.budget_s, max_evaluations=problem.max_evaluations, seed=problem.seed,
                  time_bound_s=problem.time_bound_s, calibration=problem.calibration, progress=tick,
                  prior_factory=gnn_prior_factory(settings, problem.cluster.num_devices))
    progress(0.99, "simulating the timeline of the best plan")
    sim = Simulator(problem.model, problem.cluster, problem.workload, calibration=problem.calibration)
    timeline = chrome_trace(sim.run(result.best.plan))
    from tagplan.views import cluster_summary

    cluster = cluster_summary(problem.cluster, dtype=problem.workload.dtype)  # the web view's stage map
    return {**result.to_json(), "timeline": timeline, "request": problem.request, "cluster": cluster}


def _check_keys(data: Mapping[str, Any], accepted: tuple[str, ...], where: str) -> None:
    extra = sorted(set(data) - set(accepted))
    if extra:
        raise SpecError(f"{where}: unknown keys {extra}; accepted: {', '.join(accepted)}")


def _workload_fields(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(f"workload: {raw!r} is not accepted; expected an object with {', '.join(WORKLOAD_KEYS)}")
    _check_keys(raw, WORKLOAD_KEYS, "workload")
    fields = dict(raw)
    if "dtype" in fields and fields["dtype"] not in {d.value for d in DType}:
        raise SpecError(f"workload.dtype: {fields['dtype']!r} is not accepted; accepted: "
                        f"{', '.join(d.value for d in DType)}")
    if fields.get("seq_len") is not None:
        fields["seq_len"] = _whole(fields["seq_len"], "workload.seq_len", minimum=1)
    return fields


def _workload(fields: dict[str, Any]) -> Workload:
    try:
        return Workload.model_validate(fields)
    except ValidationError as err:
        raise from_validation("workload", err) from None


def _model(value: Any, seq_len: int | None, dtype: DType, settings: Settings) -> ModelGraph:
    from tagplan.frontends.json_graph import graph_from_dict
    from tagplan.frontends.model_spec import load_model

    if isinstance(value, Mapping):
        _check_graph_size(value, settings)
        graph = graph_from_dict(dict(value), "model")
        if seq_len is not None and seq_len != graph.seq_len:
            raise SpecError(f"workload.seq_len: the inline graph is fixed at seq_len={graph.seq_len}; got {seq_len}")
    elif isinstance(value, str):
        _check_model_spec(value.strip(), settings)
        graph = load_model(value, seq_len=seq_len, dtype=dtype)
    else:
        raise SpecError(f"model: {type(value).__name__} is not accepted; expected a SPEC string (e.g. 'gpt3-1.3b') "
                        "or an inline tagplan-graph/1 object")
    if len(graph.layers) > settings.max_layers:
        raise _too_many_layers(len(graph.layers), settings)
    return graph


def _too_many_layers(layers: int, settings: Settings) -> LimitError:
    return LimitError(f"model: {layers} layers is over this service's limit of {settings.max_layers}",
                      limit="max_layers")


def _check_model_spec(spec: str, settings: Settings) -> None:
    """Refuse file paths and layer counts over the limit before building anything."""
    from tagplan.frontends.parametric import FAMILIES, parse_shape

    if not spec.startswith("hf:") and _looks_like_path(spec):
        raise SpecError(f"model: {spec!r} looks like a file path; the service reads no files: send the graph "
                        "inline as a tagplan-graph/1 object, or give a zoo name or FAMILY?key=value")
    family, _, query = spec.removeprefix("hf:").partition("?")
    if family in FAMILIES and not spec.startswith("hf:"):
        layers = parse_shape(family, query).layers
    else:
        counts = [v for k, v in parse_qsl(query) if _HF_LAYER_KEYS.fullmatch(k) and v.isdigit()]
        layers = max((int(v) for v in counts), default=0)
    if layers > settings.max_layers:
        raise _too_many_layers(layers, settings)


def _check_graph_size(graph: Mapping[str, Any], settings: Settings) -> None:
    layers = graph.get("layers")
    if not isinstance(layers, list):
        return  # graph_from_dict explains what is wrong
    total = sum(e.get("repeat", 1) if isinstance(e, Mapping) and isinstance(e.get("repeat", 1), int) else 1
                for e in layers)
    if total > settings.max_layers:
        raise _too_many_layers(total, settings)


def _looks_like_path(spec: str) -> bool:
    lowered = spec.lower()
    return ("/" in spec or "\\" in spec or any(s in lowered for s in _PATH_SUFFIXES)
            or Path(spec).exists())


def _cluster(value: Any, settings: Settings) -> Cluster:
    from tagplan.frontends.cluster_file import parse_cluster_data
    from tagplan.frontends.cluster_spec import load_cluster

    if isinstance(value, str) and ("\n" in value or value.lstrip().startswith("{")):
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise SpecError(f"cluster: not valid cluster-file YAML: {str(err)[:300]}") from None
    if isinstance(value, Mapping):
        _check_nodes(_group_nodes(value), settings)
        cluster = parse_cluster_data(dict(value))
    elif isinstance(value, str):
        spec = value.strip()
        if _looks_like_path(spec):
            raise SpecError(f"cluster: {spec!r} looks like a file path; the service reads no files: send the "
                            "cluster file inline (an object or its YAML text), or give PRESET[:nodes=N][+...]")
        _check_nodes(_spec_nodes(spec), settings)
        cluster = load_cluster(spec)
    else:
        raise SpecError(f"cluster: {type(value).__name__} is not accepted; expected a SPEC string "
                        "(e.g. 'p3.8xlarge:nodes=2'), a cluster-file object or its YAML text")
    if cluster.num_devices > settings.max_devices:
        raise _too_many_devices(cluster.num_devices, settings)
    return cluster


def _spec_nodes(spec: str) -> int:
    """Nodes a preset SPEC asks for (each has at least one device), before building them."""
    total = 0
    for term in spec.split("+"):
        counts = [int(n) for n in re.findall(r"(?:^|[:,])\s*nodes\s*=\s*(\d+)", term)]
        total += counts[-1] if counts else 1
    return total


def _group_nodes(data: Mapping[str, Any]) -> int:
    groups = data.get("node_groups")
    if not isinstance(groups, list):
        return 0
    return sum(g["nodes"] for g in groups if isinstance(g, Mapping) and isinstance(g.get("nodes"), int))


def _check_nodes(nodes: int, settings: Settings) -> None:
    if nodes > settings.max_devices:
        raise _too_many_devices(nodes, settings, at_least=True)


def _too_many_devices(devices: int, settings: Settings, *, at_least: bool = False) -> LimitError:
    return LimitError(f"cluster: {'at least ' if at_least else ''}{devices} devices is over this service's limit "
                      f"of {settings.max_devices}", limit="max_devices")


def _objective(value: Any) -> Objective:
    accepted = [o.value for o in Objective]
    if value not in accepted:
        raise SpecError(f"objective: {value!r} is not accepted; accepted: {', '.join(accepted)}")
    return Objective(value)


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{field}: {value!r} is not accepted; expected a positive number of seconds")
    return float(value)


def _whole(value: Any, field: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"{field}: {value!r} is not accepted; expected a whole number >= {minimum}")
    return value


# -- shared by both kinds --------------------------------------------------------------------------


def registry_root(settings: Settings) -> Path:
    """The GNN registry of this service: `<home>/registry` (where `tagplan train` puts versions)."""
    return settings.home / "registry"


def _calibration(value: Any, settings: Settings) -> Calibration:
    """None: the one pinned beside the active GNN version (else the defaults); a registry version
    name: the one pinned beside it; an object: a calibration; a path: only under the service's home."""
    from tagplan.training.registry import Registry

    registry = Registry(registry_root(settings))
    if value is None or (isinstance(value, str) and value in registry.versions()):
        pinned = registry.calibration_path(value)
        if value is not None and pinned is None:
            raise SpecError(f"calibration: version {value!r} has no calibration pinned beside it")
        return DEFAULT_CALIBRATION if pinned is None else load_calibration(pinned)
    if isinstance(value, Mapping):
        try:
            return Calibration.model_validate(dict(value))
        except ValidationError as err:
            raise from_validation("calibration", err) from None
    if isinstance(value, str) and _inside(Path(value), settings.home):
        return load_calibration(value)
    raise SpecError(f"calibration: {value!r} is not accepted; expected a calibration object (from `tagplan "
                    f"calibrate`) or a registry version with one pinned ({', '.join(registry.versions()) or 'none'})")


def _inside(path: Path, root: Path) -> bool:
    return path.resolve().is_relative_to(root.resolve())


def gnn_prior_factory(settings: Settings, devices: int) -> Callable[[Any], Any] | None:
    """The GNN search prior from this service's registry, by the CLI's rules (`tagplan plan --scorer auto`)."""
    from tagplan.training.registry import Registry
    from tagplan.training.registry import gnn_prior_factory as from_registry

    return from_registry(Registry(registry_root(settings)), devices)


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None: strict JSON (what browsers and Starlette accept)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# -- train -----------------------------------------------------------------------------------------


def _run_train(request: dict[str, Any], settings: Settings, progress: Progress) -> dict[str, Any]:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.registry import Registry
    from tagplan.training.traces import finetune_on_traces

    if not isinstance(request, Mapping):
        raise SpecError("a training request is a JSON object with traces (a list) and calibration (optional)")
    _check_keys(request, TRAIN_KEYS, "training request")
    paths = request.get("traces")
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
        raise SpecError(f"traces: {paths!r} is not accepted; expected a non-empty list of uploaded trace bundles")
    for path in paths:
        if not _inside(Path(path), settings.home):
            raise SpecError(f"traces: {path!r} is not a trace bundle uploaded to this service")
    calibration = _calibration(request.get("calibration"), settings)
    progress(0.05, f"reading {len(paths)} trace bundles")
    bundles = [read_bundle(p) for p in paths]
    progress(0.2, "fine-tuning the GNN on the measured iterations")
    out_dir = settings.home / "training" / uuid.uuid4().hex
    card = finetune_on_traces(bundles, out_dir, registry=Registry(registry_root(settings)), calibration=calibration)
    progress(1.0, "registered")
    return dict(_json_safe(card))


def _json_safe(value: Any) -> Any:
    """A model card as plain JSON values (paths and dates as strings)."""
    return json.loads(json.dumps(value, default=str))
