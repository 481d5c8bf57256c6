"""Reading Plan JSON v1 files (docs/PLAN_FORMAT.md) with errors that name the stage and field.

A file `tagplan plan --out` writes also says what the plan was searched for: `searched_for`, the global batch and
tokens per sample (`SearchedFor`). `export`, `measure` and `simulate` take those as their defaults and refuse a
different `--batch` or `--seq`: a plan's micro-batches and shares are whole samples of that batch only, and its
costs were for that sequence.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from tagplan.errors import SpecError, from_validation
from tagplan.frontends.textfile import parse_structured, read_text
from tagplan.ir.base import Record
from tagplan.ir.plan import Plan
from tagplan.ir.workload import DType, Workload

SEARCHED_FOR = "searched_for"


class SearchedFor(Record):
    """The workload a plan was searched for: what its whole-sample shares and its costs hold for."""

    global_batch: int = Field(gt=0, description="samples per iteration")
    seq_len: int = Field(gt=0, description="tokens per sample")
    grad_reduce_dtype: DType | None = Field(
        default=None, description="what the data-parallel gradients were costed crossing the group in (None: the "
        "training dtype); `plan --exportable torch` costs fp32, as the program reduces")


def plan_data(data: Any, where: str) -> tuple[Any, SearchedFor | None]:
    """(the Plan JSON object, what it was searched for) of a plan file's parsed content: a Plan object, optionally
    with `searched_for`, or a `tagplan plan --json` result's best entry (`{"plan": ...}`)."""
    if isinstance(data, dict) and "plan" in data and "stages" not in data:
        data = data["plan"]
    if not isinstance(data, dict) or SEARCHED_FOR not in data:
        return data, None
    data = dict(data)
    try:
        return data, SearchedFor.model_validate(data.pop(SEARCHED_FOR))
    except ValidationError as exc:
        raise from_validation(f"{where}: {SEARCHED_FOR}", exc) from None


def searched_for(workload: Workload, seq_len: int) -> SearchedFor:
    """What a plan costed under `workload` (at `seq_len` tokens, the model's) was searched for."""
    return SearchedFor(global_batch=workload.global_batch, seq_len=seq_len,
                       grad_reduce_dtype=workload.grad_reduce_dtype)


def plan_file_json(plan: Plan, searched: SearchedFor) -> str:
    """What `tagplan plan --out` writes: the Plan JSON with `searched_for` (its unset fields left out)."""
    return json.dumps({**plan.model_dump(mode="json"), SEARCHED_FOR: searched.model_dump(mode="json",
                                                                                          exclude_none=True)}, indent=2)


def load_plan_file(path: str) -> tuple[Plan, SearchedFor | None]:
    """The plan in the JSON (or YAML) file at `path` and what it was searched for (None where the file does not
    say); SpecError naming the stage and field if invalid."""
    data, searched = plan_data(parse_structured(read_text(path), path), path)
    try:  # strict, as JSON: "2" is no micro-batch count and "yes" no recompute flag (whole numbers stay numbers)
        return Plan.model_validate_json(json.dumps(data), strict=True), searched
    except ValidationError as exc:
        raise from_validation(path, exc) from None


def load_plan(path: str) -> Plan:
    """The plan in the JSON (or YAML) file at `path`; SpecError naming the stage and field if invalid."""
    return load_plan_file(path)[0]


def searched_workload(given_batch: int | None, given_seq: int | None, searched: SearchedFor | None,
                      path: str) -> tuple[int | None, int | None]:
    """(--batch, --seq) for a command on the plan file at `path`: what it was searched for where not given; SpecError
    where one given differs (its whole-sample shares and its costs hold for its own batch and sequence)."""
    if searched is None:
        return given_batch, given_seq
    out = []
    for option, given, value in (("--batch", given_batch, searched.global_batch), ("--seq", given_seq,
                                                                                  searched.seq_len)):
        if given is not None and given != value:
            raise SpecError(f"{option} {given}: {path} was searched for {option} {value} (its {SEARCHED_FOR}); give "
                            f"{option} {value}, or search a plan for {option} {given} (tagplan plan ... --out)")
        out.append(value)
    return out[0], out[1]
