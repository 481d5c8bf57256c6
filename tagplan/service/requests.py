"""What a job is asked: one pydantic model per job kind, used by the API and again by the worker.

The API validates a body with `PlanRequest` (FastAPI does, from the route's signature) and stores
`to_request()`; the worker validates the stored JSON with the same model (`read_request`), so
a request is understood one way everywhere. Nothing here needs FastAPI, reads a file a tenant
names, or builds a model or a cluster:

- `model` is parsed into a `ModelSpec` (`frontends.model_spec.parse_model_spec`, pure) or kept as
  an inline tagplan-graph/1 object; a SPEC naming a file or a Python module is refused.
- `cluster` is parsed into a `ClusterSpec` (`frontends.cluster_spec.parse_cluster_spec`, pure) or
  kept as an inline cluster-file object (cluster-file YAML text is read into one, aliases refused);
  a SPEC naming a file (the cluster or a `gpu=` device file) is refused.
- `check_limits` bounds the size on the parsed request alone: blocks of the SPEC or layers of the
  inline graph, devices of the preset terms or of the node groups, budget and evaluations.

Error messages name the field and the value, quoting at most `MAX_SHOWN` characters of input.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tagplan.cost.calibration import Calibration
from tagplan.datasets.traces.bundle import Bundle, IterationRecord
from tagplan.errors import SpecError
from tagplan.frontends import presets
from tagplan.frontends.cluster_file import parse_cluster_data
from tagplan.frontends.cluster_spec import ClusterSpec, parse_cluster_spec
from tagplan.frontends.hf_config import spec_depth
from tagplan.frontends.json_graph import graph_from_dict
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind, parse_model_spec, positions_refusal
from tagplan.ir.workload import (
    EAGER_RUNTIME_TEXT,
    LOSS_KERNEL_TEXT,
    DType,
    EagerRuntime,
    LossKernel,
    Optimizer,
    eager_dtype_refusal,
)
from tagplan.search.problem import DEFAULT_BUDGET_S, DEFAULT_GLOBAL_BATCH, DEFAULT_MAX_EVALUATIONS, Objective
from tagplan.service.settings import Settings
from tagplan.training.calibrations import resolve_calibration
from tagplan.training.registry import Registry

MAX_SHOWN = 80  # characters of a rejected value quoted back
MAX_NAME_CHARS = 200  # a registry version name (a calibration choice)
MAX_SPEC_CHARS = 10_000  # a model or cluster SPEC string, before any parsing (settings may say less)
MAX_NESTING = 32  # levels of an inline object or of cluster YAML text (a graph needs about 5); not a setting
_DEVICE_FILE_SUFFIXES = (".yaml", ".yml", ".json")
R = TypeVar("R", bound=BaseModel)

PLAN_EXAMPLE: dict[str, Any] = {
    "model": "gpt3-1.3b",
    "cluster": "p3.8xlarge:nodes=2",
    "workload": {"global_batch": 16, "seq_len": 1024, "dtype": "bf16"},
    "objective": "time",
    "budget_s": 30,
    "max_evaluations": 400,
    "seed": 0,
}
TINY_PLAN_EXAMPLE: dict[str, Any] = {"model": "gpt?layers=4&hidden=256&heads=4&vocab=100",
                                     "cluster": "p3.8xlarge", "max_evaluations": 20}


class LimitError(SpecError):
    """A request over one of the service's limits; `status` is the HTTP status to answer (413 | 422)."""

    def __init__(self, message: str, *, limit: str, status: int = 422) -> None:
        super().__init__(message)
        self.limit, self.status = limit, status


# -- how input is quoted back ----------------------------------------------------------------------


def shown(value: Any) -> str | None:
    """`value` as an error quotes it: its repr, at most `MAX_SHOWN` characters; a container by its type."""
    if isinstance(value, dict | list):
        return type(value).__name__ if value else None
    if isinstance(value, int) and not isinstance(value, bool):
        return _number(value)
    text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN] + "..."


def describe(error: Mapping[str, Any]) -> str:
    """One pydantic error as `where: message (got value)`."""
    where = ".".join(str(p) for p in error.get("loc", ())) or "(request)"
    quoted = shown(error.get("input"))
    return f"{where}: {error.get('msg', 'invalid')}" + (f" (got {quoted})" if quoted is not None else "")


def invalid(what: str, err: ValidationError) -> SpecError:
    """A SpecError listing the first failures of `err` (each `field: message (got value)`)."""
    errors = err.errors()
    more = f"; and {len(errors) - 5} more" if len(errors) > 5 else ""
    return SpecError(f"{what}: " + "; ".join(describe(e) for e in errors[:5]) + more)


_LONG_QUOTE = re.compile(rf"'[^'\n]{{{MAX_SHOWN + 1},}}'|\"[^\"\n]{{{MAX_SHOWN + 1},}}\"")  # a long quoted value


def clipped(message: str) -> str:
    """`message` with any quoted value longer than `MAX_SHOWN` characters cut to that length."""
    return _LONG_QUOTE.sub(lambda m: m.group(0)[:MAX_SHOWN + 1] + "..." + m.group(0)[0], message)


def _clipped(message: str, text: str) -> str:
    """`message` with the input `text`, and any quoted value longer than `MAX_SHOWN`, cut to that length."""
    for whole in {text, text.strip()}:
        if len(whole) > MAX_SHOWN:
            message = message.replace(whole, whole[:MAX_SHOWN] + "...")
    return _LONG_QUOTE.sub(lambda m: m.group(0)[:MAX_SHOWN + 1] + "..." + m.group(0)[0], message)


def _refused(kind: str, reason: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{reason}", {"reason": reason})


def _parsed(parse: Callable[[str], Any], text: str) -> Any:
    """`parse(text)`; any failure to read it is an input error (a 422, never a 500)."""
    try:
        return parse(text)
    except SpecError as err:
        raise _refused("spec", _clipped(str(err), text)) from None
    except Exception as err:  # a SPEC the parser did not foresee is still the tenant's input
        raise _refused("spec", f"{shown(text)} cannot be read ({type(err).__name__})") from None


# -- model -----------------------------------------------------------------------------------------


def _long(value: str, what: str) -> None:
    if len(value) > MAX_SPEC_CHARS:
        raise _refused("spec_length", f"a {what} of {len(value)} characters is not accepted; at most "
                                      f"{MAX_SPEC_CHARS} (starts {shown(value[:MAX_SHOWN])})")


def _model_value(value: Any) -> ModelSpec | dict[str, Any]:
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, dict):
        return _shallow(value, "graph")
    if not isinstance(value, str):
        raise _refused("model_type", f"{type(value).__name__} is not accepted; expected a model SPEC string "
                                     "(e.g. 'gpt3-1.3b') or an inline tagplan-graph/1 object")
    _long(value, "model SPEC")
    spec: ModelSpec = _parsed(parse_model_spec, value)
    if spec.names_file:
        raise _refused("file_path", f"{shown(spec.text)} is a file path or a Python module; the service reads "
                                    "no files and imports no code: send the graph inline as a tagplan-graph/1 "
                                    "object, or give a zoo name, FAMILY?key=value or hf:ConfigClass?key=value")
    return spec


def _model_json(value: ModelSpec | dict[str, Any]) -> str | dict[str, Any]:
    return value.text if isinstance(value, ModelSpec) else value


ModelField = Annotated[
    ModelSpec | dict[str, Any], PlainValidator(_model_value), PlainSerializer(_model_json),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "object"}], "title": "Model",
                    "description": "a model SPEC (`gpt3-1.3b`, `gpt?layers=4&hidden=256&heads=4&vocab=100`, "
                                   "`hf:LlamaConfig?num_hidden_layers=4`) or an inline tagplan-graph/1 object",
                    "examples": ["gpt3-1.3b"]})]


def model_layers(model: ModelSpec | Mapping[str, Any]) -> int:
    """Layers a model asks for, read off the request: the SPEC's blocks (0 where the SPEC does not
    tell, e.g. a Hugging Face config at its default depth), or the inline graph's layers with
    their repeats (an entry that is not a positive whole number counts once; building explains)."""
    if isinstance(model, ModelSpec):
        if model.kind is ModelSpecKind.HF:  # the config's own layer counts: a key the SPEC leaves out, or one
            return max(model.blocks or 0, spec_depth(model.name, dict(model.overrides)))  # that defaults to another
        return model.blocks or 0
    layers = model.get("layers")
    if not isinstance(layers, list):
        return 0
    return sum(_count(e.get("repeat", 1)) if isinstance(e, Mapping) else 1 for e in layers)


def model_tokens(model: ModelSpec | Mapping[str, Any]) -> int | None:
    """Tokens per sample a model fixes itself, read off the request (None: the workload's seq_len says): a ViT's
    patches and class token, an inline graph's `seq_len`."""
    if isinstance(model, ModelSpec):
        shape = model.shape
        if model.family == "vit" and shape is not None and shape.patch > 0:
            return (shape.image // shape.patch) ** 2 + 1
        return None
    seq = model.get("seq_len")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _count(value: Any) -> int:
    """A count as the size check sees it: a whole number, at least 1 (building rejects the rest)."""
    return max(1, value) if isinstance(value, int) and not isinstance(value, bool) else 1


# -- cluster ---------------------------------------------------------------------------------------


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without aliases and at most `MAX_NESTING` levels deep: a small text cannot expand into a
    huge object, and a deep one is refused before the composer recurses into it."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not accepted", event.start_mark)
        if self._depth >= MAX_NESTING:
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_NESTING} levels",
                                              event.start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def nesting(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of containers in `value` (a scalar: 0), counted level by level without recursion and
    no further than `limit + 1`."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [c for c in level if isinstance(c, dict | list)]
        if not containers:
            break
        depth += 1
        level = [v for c in containers for v in (c.values() if isinstance(c, dict) else c)]
    return depth


def _shallow(value: dict[str, Any], what: str) -> dict[str, Any]:
    if nesting(value) > MAX_NESTING:
        raise _refused("nesting", f"the inline {what} is nested deeper than {MAX_NESTING} levels")
    where = non_finite(value, what)
    if where:
        raise _refused("finite", f"the inline {what}'s {where} is not a finite number; numbers must be finite")
    return value


def non_finite(value: Any, path: str) -> str | None:
    """The path of the first infinite or NaN number in a JSON-like value (None: every number is finite); JSON
    bodies may spell them Infinity and NaN (and `1e999` parses as one), which nothing stored could keep."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = non_finite(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{str(key)[:MAX_SHOWN]}")
        if found:
            return found
    return None


def _json_like(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, str | int | bool)


def _cluster_yaml(text: str) -> dict[str, Any]:
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)
    except (yaml.YAMLError, ValueError) as err:  # ValueError: an integer too long to convert
        raise _refused("yaml", f"not valid cluster-file YAML: {_clipped(str(err), text)[:300]}") from None
    if not isinstance(data, dict) or not _json_like(data):
        raise _refused("yaml", f"cluster-file YAML text must hold a mapping of JSON values (name, node_groups, "
                               f"network); got {type(data).__name__}")
    return data


def _cluster_value(value: Any) -> ClusterSpec | dict[str, Any]:
    if isinstance(value, ClusterSpec):
        return value
    if isinstance(value, str) and ("\n" in value or value.lstrip().startswith("{")):
        value = _cluster_yaml(value)
    if isinstance(value, dict):
        return _shallow(value, "cluster")
    if not isinstance(value, str):
        raise _refused("cluster_type", f"{type(value).__name__} is not accepted; expected a cluster SPEC string "
                                       "(e.g. 'p3.8xlarge:nodes=2'), a cluster-file object or its YAML text")
    _long(value, "cluster SPEC")
    spec: ClusterSpec = _parsed(parse_cluster_spec, value)
    if spec.names_file:  # a cluster or topology file, or a custom device file (gpu=...yaml)
        raise _refused("file_path", f"{shown(spec.text)} names a file path; the service reads no files: send "
                                    "the cluster file inline (an object or its YAML text), or give "
                                    "PRESET[:nodes=N][:gpu=NAME][+...]")
    return spec


def _cluster_json(value: ClusterSpec | dict[str, Any]) -> str | dict[str, Any]:
    return value.text if isinstance(value, ClusterSpec) else value


ClusterField = Annotated[
    ClusterSpec | dict[str, Any], PlainValidator(_cluster_value), PlainSerializer(_cluster_json),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "object"}], "title": "Cluster",
                    "description": "a cluster SPEC (`p3.8xlarge:nodes=2`), an inline cluster-file object, "
                                   "or cluster-file YAML text", "examples": ["p3.8xlarge:nodes=2"]})]


def cluster_devices(cluster: ClusterSpec | Mapping[str, Any]) -> int:
    """Devices a cluster asks for, read off the request: nodes x GPUs per node of each preset term,
    or of each node group of an inline cluster file (a count that is not a positive whole number,
    or a preset that does not exist, counts as one; building explains)."""
    if isinstance(cluster, ClusterSpec):
        return sum(presets.preset(t.preset).node.gpus * (t.nodes or 1) for t in cluster.terms)
    groups = cluster.get("node_groups")
    if not isinstance(groups, list):
        return 0
    total = 0
    for group in groups:
        if not isinstance(group, Mapping):
            total += 1
            continue
        gpus = group.get("gpus_per_node")
        per_node = _count(gpus) if gpus is not None else _preset_gpus(group.get("preset"))
        total += _count(group.get("nodes", 1)) * per_node
    return total


def _preset_gpus(name: Any) -> int:
    try:
        return presets.preset(name).node.gpus if isinstance(name, str) else 1
    except SpecError:
        return 1


# -- the requests ----------------------------------------------------------------------------------

CalibrationChoice = dict[str, Any] | Annotated[StrictStr, Field(max_length=MAX_NAME_CHARS)] | None


class WorkloadRequest(BaseModel):
    """What one iteration processes; a field left out takes the planner's default."""

    model_config = ConfigDict(extra="forbid")

    global_batch: StrictInt | None = Field(default=None, gt=0, le=10**9,
                                           description=f"samples per iteration (default {DEFAULT_GLOBAL_BATCH})")
    seq_len: StrictInt | None = Field(default=None, gt=0, le=10**9,
                                      description="tokens per sample (default: the model's)")
    dtype: DType | None = Field(default=None, description="default bf16")
    optimizer: Optimizer | None = Field(default=None, description="default adam")
    grad_reduce_dtype: Literal[DType.FP32, DType.BF16, DType.FP16] | None = Field(
        default=None, description="dtype gradients cross the data-parallel group in (default: the training "
        "dtype; fp32 as DeepSpeed's fp32_allreduce)")
    grad_reduce_overlap: StrictBool | None = Field(
        default=None, description="default true: gradients reduce while the backward runs; false: after it, "
        "exposed (DeepSpeed's pipeline engine)")
    tp_comm_overlap: StrictBool | None = Field(
        default=None, description="default false: every tensor-parallel collective exposed; true: they run in "
        "chunks under the GEMMs (Megatron-Core's --tp-comm-overlap)")
    fused_attention: StrictBool | None = Field(
        default=None, description="default: each GPU's own attention kernel (FlashAttention-2 from sm80, scores "
        "materialised before); true: a fused kernel on every device; false: scores materialised everywhere "
        "(runtimes before FlashAttention)")
    loss: LossKernel | None = Field(
        default=None, description="the runtime's cross-entropy, which sets the memory of the stage holding the head: "
        + "; ".join(f"{k.value}: {LOSS_KERNEL_TEXT[k]}" for k in LossKernel) + " (default eager)")
    eager: EagerRuntime | None = Field(
        default=None, description="the runtime runs the model op by op as eager PyTorch: "
        + "; ".join(f"{r.value}: {EAGER_RUNTIME_TEXT[r]}" for r in EagerRuntime)
        + " (default: fused kernels, as Megatron-Core and Transformer Engine run)")
    fused_loss: StrictBool | None = Field(
        default=None, exclude=True, description="the earlier spelling of `loss`, read for the jobs stored with it: "
        "true is loss fused, false or null eager; not given beside loss")

    @model_validator(mode="after")
    def _earlier_fused_loss(self) -> WorkloadRequest:
        """`fused_loss` as `loss` (never both)."""
        if self.fused_loss is not None:
            if self.loss is not None:
                raise ValueError(f"fused_loss={str(self.fused_loss).lower()} beside loss={self.loss.value!r}: "
                                 "fused_loss is the earlier spelling of loss; give loss alone")
            self.loss = LossKernel.FUSED if self.fused_loss else LossKernel.EAGER
            self.fused_loss = None
        return self

    @model_validator(mode="after")
    def _sixteen_bit_weights(self) -> WorkloadRequest:
        """Weights held in the compute dtype need a 16-bit one."""
        dtype = self.dtype or DType.BF16
        refusal = eager_dtype_refusal(self.eager, dtype)
        if refusal and self.eager is not None:
            raise ValueError(f"eager={self.eager.value!r} with dtype={dtype.value!r}: {refusal}")
        return self


class PlanRequest(BaseModel):
    """A planning problem: a model, a cluster and how to search (`POST /v1/plans`, and a plan job)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [PLAN_EXAMPLE, TINY_PLAN_EXAMPLE]})

    model: ModelField
    cluster: ClusterField
    workload: WorkloadRequest | None = None
    objective: Objective | None = Field(default=None, description="what `best` means (default time)")
    budget_s: StrictFloat | None = Field(default=None, gt=0, allow_inf_nan=False, description=(
        f"wall-clock budget of the search, seconds (default {DEFAULT_BUDGET_S:g})"))
    max_evaluations: StrictInt | None = Field(default=None, ge=1, le=10**9, description=(
        f"plans simulated at most (default {DEFAULT_MAX_EVALUATIONS})"))
    seed: StrictInt | None = Field(default=None, ge=0, le=2**32 - 1)
    time_bound_s: StrictFloat | None = Field(default=None, gt=0, allow_inf_nan=False, description=(
        "objective memory|gpus: the slowest acceptable iteration, seconds (default 1.25 x the fastest)"))
    calibration: CalibrationChoice = Field(default=None, description=(
        "a cost-model calibration object (from `tagplan calibrate`) or a registry version with one pinned; "
        "default: the one pinned beside the active GNN version"))

    def to_request(self) -> dict[str, Any]:
        """The job's request: the fields given, as plain JSON (`read_request` reads it back)."""
        return self.model_dump(mode="json", exclude_none=True)


class TrainRequest(BaseModel):
    """A training job: the uploaded trace bundles (their paths under the service's home) to train on."""

    model_config = ConfigDict(extra="forbid")

    traces: list[StrictStr] = Field(min_length=1, max_length=256, description="paths of uploaded trace bundles")
    calibration: CalibrationChoice = Field(default=None, description=(
        "a calibration object, or a registry version with one pinned (default: the active version's)"))


def read_request(model: type[R], data: Any, what: str) -> R:
    """`data` (a stored request) validated by `model`; SpecError naming the fields otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise invalid(what, err) from None


def check_limits(request: PlanRequest, settings: Settings) -> None:
    """LimitError naming the limit when the request asks for more than `settings` allow.

    Read off the parsed request alone: no model is built (a Hugging Face SPEC's config is, for its layer counts),
    no file is read.
    """
    check_sizes(request.model, request.cluster, request.workload, settings)
    if request.budget_s is not None and request.budget_s > settings.max_budget_s:
        raise LimitError(f"budget_s: {request.budget_s:g} is over this service's limit of "
                         f"{settings.max_budget_s:g} s (TAGPLAN_MAX_BUDGET_S)", limit="max_budget_s")
    if request.max_evaluations is not None and request.max_evaluations > settings.max_evaluations:
        raise LimitError(f"max_evaluations: {request.max_evaluations} is over this service's limit of "
                         f"{settings.max_evaluations} (TAGPLAN_MAX_EVALUATIONS)", limit="max_evaluations")


def check_inline(request: PlanRequest) -> None:
    """SpecError naming the field when an inline graph or cluster file does not parse (no layers, no node groups, a
    wrong field): read, within the limits `check_limits` already held, so that a bad one is refused before it is
    queued; a SPEC is left to the worker, which builds it."""
    if isinstance(request.model, Mapping):
        graph_from_dict(dict(request.model), "model")
    if isinstance(request.cluster, Mapping):
        parse_cluster_data(dict(request.cluster))
    if isinstance(request.calibration, Mapping):
        where = non_finite(request.calibration, "calibration")
        if where:
            raise SpecError(f"{where}: numbers must be finite")
        try:
            Calibration.model_validate(dict(request.calibration))
        except ValidationError as err:
            raise invalid("calibration", err) from None


def check_sizes(model: ModelSpec | Mapping[str, Any], cluster: ClusterSpec | Mapping[str, Any],
                workload: WorkloadRequest | None, settings: Settings, where: str = "") -> None:
    """LimitError when a model, a cluster or a workload is larger than `settings` allow (SPEC lengths,
    layers, devices, global batch, sequence length, the tokens a model fixes itself), read off the parsed values:
    no model is built."""
    texts = [("model", m.text) for m in (model,) if isinstance(m, ModelSpec)]
    texts += [("cluster", c.text) for c in (cluster,) if isinstance(c, ClusterSpec)]
    for name, text in texts:
        if len(text) > settings.max_spec_chars:
            raise LimitError(f"{where}{name}: a SPEC of {len(text)} characters is over this service's limit of "
                             f"{settings.max_spec_chars} (TAGPLAN_MAX_SPEC_CHARS)", limit="max_spec_chars")
    _at_most(f"{where}model: layers", model_layers(model), settings.max_layers, "max_layers")
    _at_most(f"{where}model: tokens per sample", model_tokens(model), settings.max_seq_len, "max_seq_len")
    _at_most(f"{where}cluster: devices", cluster_devices(cluster), settings.max_devices, "max_devices")
    if workload is not None:
        _at_most(f"{where}workload.global_batch", workload.global_batch, settings.max_global_batch,
                 "max_global_batch")
        _at_most(f"{where}workload.seq_len", workload.seq_len, settings.max_seq_len, "max_seq_len")
        if isinstance(model, ModelSpec) and workload.seq_len is not None:
            why = positions_refusal(model, workload.seq_len)
            if why is not None:
                raise SpecError(f"{where}workload.seq_len: {why}")


def _at_most(what: str, value: int | None, limit: int, name: str) -> None:
    if value is not None and value > limit:
        raise LimitError(f"{what}: {_number(value)} is over this service's limit of {limit} "
                         f"(TAGPLAN_{name.upper()})", limit=name)


def _number(value: int) -> str:
    """An integer as an error quotes it: whole up to `MAX_SHOWN` digits, else by its number of digits (one of
    thousands of digits cannot even be written out by default)."""
    if value.bit_length() > 3 * MAX_SHOWN:  # about MAX_SHOWN decimal digits
        return f"a number of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = str(value)
    return text if len(text) <= MAX_SHOWN else f"a number of {len(text)} digits"


def check_iteration(record: IterationRecord, settings: Settings, where: str) -> IterationRecord:
    """The record as the service keeps it (cluster YAML text read into an object), or SpecError
    unless it is safe to rebuild in a worker: its model and its cluster are inline objects or SPECs
    naming no file (the checks of `PlanRequest`), within the service's limits. The worker reads no
    file a record names."""
    try:
        model = _model_value(record.model)
        cluster = _cluster_value(record.cluster)
    except PydanticCustomError as err:
        raise SpecError(f"{where}: {err.message()}") from None
    w = record.workload
    try:
        workload = WorkloadRequest(global_batch=w.global_batch, seq_len=w.seq_len)
    except ValidationError as err:
        raise invalid(f"{where}: workload", err) from None
    check_sizes(model, cluster, workload, settings, where=f"{where}: ")
    return record.model_copy(update={"model": _model_json(model), "cluster": _cluster_json(cluster)})


def check_bundle(bundle: Bundle, settings: Settings, where: str) -> Bundle:
    """`bundle` with every iteration record checked and kept as `check_iteration` does."""
    records = tuple(check_iteration(r, settings, f"{where} record {i}") if isinstance(r, IterationRecord) else r
                    for i, r in enumerate(bundle.records))
    return bundle.model_copy(update={"records": records})


def registry_root(settings: Settings) -> Path:
    """The GNN registry of this service: `<home>/registry` (where `tagplan train` puts versions)."""
    return settings.home / "registry"


def tenant_registry(settings: Settings, tenant_id: int | None) -> Registry:
    """The GNN registry plans of `tenant_id` use: the tenant's own (`<home>/tenants/<id>/registry`,
    where its training runs register versions) falling back to the service-wide one (what admins
    activate); the service-wide one itself when `tenant_id` is None."""
    shared = Registry(registry_root(settings))
    if tenant_id is None:
        return shared
    return Registry(settings.home / "tenants" / str(int(tenant_id)) / "registry", fallback=shared)


def gnn_version(registry: Registry) -> str:
    """Which GNN `registry` answers with: `tenant:vNNNN`, `vNNNN` (service-wide) or `packaged`."""
    if registry.active() is not None:
        return f"tenant:{registry.active()}" if registry.fallback is not None else str(registry.active())
    return gnn_version(registry.fallback) if registry.fallback is not None else "packaged"


def traces_root(settings: Settings) -> Path:
    """Where uploaded trace bundles live: `<home>/traces/<tenant id>/<uuid>/`."""
    return settings.home / "traces"


def calibration_of(choice: CalibrationChoice, settings: Settings) -> Calibration:
    """The Calibration a request's `calibration` names, from this service's registry; never a path.

    (`training.calibrations.resolve_calibration` with `allow_paths=False`: the service reads no
    file a tenant names.)
    """
    return resolve_calibration(choice, Registry(registry_root(settings)), allow_paths=False)

