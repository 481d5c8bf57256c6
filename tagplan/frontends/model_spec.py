"""The model SPEC grammar shared by every command.

    SPEC := ZOO_NAME                       gpt3-175b, llama2-7b, ... (`tagplan inspect model --list`)
          | FAMILY[?key=value&...]         gpt?layers=96&hidden=12288&heads=96&vocab=50257
          | hf:CONFIG_CLASS[?key=value&...] hf:LlamaConfig?num_hidden_layers=4
          | PATH                           a .json/.yaml graph (docs/GRAPH_FORMAT.md)
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from urllib.parse import parse_qsl

from tagplan.errors import SpecError, unknown
from tagplan.frontends.json_graph import graph_from_dict
from tagplan.frontends.parametric import FAMILIES, parse_shape
from tagplan.frontends.textfile import parse_structured, read_text
from tagplan.frontends.zoo import build_zoo, resolve_zoo_name, zoo_names
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType

DEFAULT_SEQ_LEN = 2048
_FAMILY_SEQ_LEN = {"bert": 512, "t5": 512}


def load_model(spec: str, *, seq_len: int | None = None, dtype: DType = DType.BF16) -> ModelGraph:
    """Build the ModelGraph a SPEC names, at `seq_len` tokens per sample (None: the model's own)."""
    spec = spec.strip()
    if not spec:
        raise SpecError("model SPEC is empty; give a zoo name, FAMILY?key=value, hf:ConfigClass or a file path")
    if seq_len is not None and seq_len <= 0:
        raise SpecError(f"seq_len={seq_len}: must be a positive number of tokens")
    if spec.startswith("hf:"):
        return _load_hf(spec[3:], seq_len, dtype)
    if _looks_like_path(spec):
        return _load_file(spec, seq_len, dtype)
    family, _, query = spec.partition("?")
    if family in FAMILIES:
        return _load_family(spec, family, query, seq_len, dtype)
    if resolve_zoo_name(spec) is not None:
        return build_zoo(spec, seq_len=seq_len, dtype=dtype)
    raise unknown("model", spec, [*zoo_names(), *FAMILIES])


def _looks_like_path(spec: str) -> bool:
    return spec.endswith((".json", ".yaml", ".yml")) or "/" in spec or Path(spec).is_file()


def _load_family(spec: str, family: str, query: str, seq_len: int | None, dtype: DType) -> ModelGraph:
    shape = parse_shape(family, query)
    seq = seq_len or _FAMILY_SEQ_LEN.get(family, DEFAULT_SEQ_LEN)
    if family == "gpt" and "max_positions" not in dict(parse_qsl(query)):
        shape = replace(shape, max_positions=max(shape.max_positions, seq))
    if family in {"gpt", "bert"} and seq > shape.max_positions:
        raise SpecError(f"{family}: seq_len={seq} exceeds max_positions={shape.max_positions}")
    return FAMILIES[family](spec, shape, seq, dtype)


def _load_hf(rest: str, seq_len: int | None, dtype: DType) -> ModelGraph:
    from tagplan.frontends.huggingface import graph_from_hf  # torch + transformers: import on demand

    cls, _, query = rest.partition("?")
    overrides = dict(parse_qsl(query, keep_blank_values=True))
    return graph_from_hf(cls, overrides, seq_len=seq_len, dtype=dtype)


def _load_file(spec: str, seq_len: int | None, dtype: DType) -> ModelGraph:
    if not Path(spec).is_file():
        raise SpecError(f"model file {spec!r} does not exist (a SPEC with '/' or a .json/.yaml suffix is a path)")
    graph = graph_from_dict(parse_structured(read_text(spec), spec), spec)
    if seq_len is not None and seq_len != graph.seq_len:
        raise SpecError(f"{spec}: the graph is fixed at seq_len={graph.seq_len}; got --seq {seq_len}")
    return graph
