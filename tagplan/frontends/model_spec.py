"""The model SPEC grammar shared by every command: a pure parse step, then a build step.

    SPEC := ZOO_NAME                        gpt3-175b, llama2-7b, ... (`tagplan inspect model --list`)
          | FAMILY[?key=value&...]          gpt?layers=96&hidden=12288&heads=96&vocab=50257
          | hf:CONFIG_CLASS[?key=value&...] hf:LlamaConfig?num_hidden_layers=4
          | hf:ARCHITECTURE[?key=value&...] hf:MistralForCausalLM (any class transformers' auto mappings list)
          | PATH/config.json | PATH/        a Hugging Face config.json, or a directory holding one (kind HF_FILE)
          | PATH                            a .json/.yaml/.yml graph (docs/GRAPH_FORMAT.md), or any SPEC with '/';
                                            a .json holding `model_type` and a directory are read as HF configs
          | MODULE:NAME                     path/to/file.py:Name or package.module:Name (an nn.Module class or
                                            a factory; see `frontends.user_module`)

`parse_model_spec(text) -> ModelSpec` reads no file, imports nothing heavy and builds nothing:
the service checks a request's size on the parsed spec alone. `build_model(spec, ...)` builds
the ModelGraph; `load_model(text, ...)` is the two in one call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from urllib.parse import parse_qsl

from tagplan.errors import SpecError, unknown
from tagplan.frontends.families import TransformerShape
from tagplan.frontends.json_graph import graph_from_dict
from tagplan.frontends.parametric import FAMILIES, parse_shape
from tagplan.frontends.textfile import parse_structured, read_text
from tagplan.frontends.zoo import ZOO, build_zoo, resolve_zoo_name, zoo_names
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType

DEFAULT_SEQ_LEN = 2048
MAX_SPEC_CHARS = 2000
_FAMILY_SEQ_LEN = {"bert": 512, "t5": 512}
_GRAPH_SUFFIXES = (".json", ".yaml", ".yml")
_HF_CONFIG_NAME = "config.json"
_MODULE = re.compile(r"(?P<module>[^:?]+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*)")
# Hugging Face config keys that count blocks (the service bounds them before anything is built).
_HF_DEPTH_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "encoder_layers",
                  "decoder_layers")


class ModelSpecKind(StrEnum):
    """What a model SPEC names."""

    ZOO = "zoo"
    FAMILY = "family"
    HF = "hf"
    FILE = "file"
    HF_FILE = "hf_file"
    MODULE = "module"


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model SPEC.

    `name`: the canonical zoo name, the family, the Hugging Face config class, the file path, or
    the module (file or dotted package path). `attr`: the class or factory of a MODULE spec.
    `overrides`: the `key=value` pairs as given (family shape keys, Hugging Face config keys).
    `family` and `shape`: the transformer family and exact shape where the SPEC alone fixes them
    (zoo and family SPECs). `blocks`: the number of repeated blocks where the SPEC alone tells it
    (zoo, family, and Hugging Face SPECs that set a depth key), else None.
    """

    text: str
    kind: ModelSpecKind
    name: str
    attr: str = ""
    overrides: tuple[tuple[str, str], ...] = ()
    family: str | None = None
    shape: TransformerShape | None = None
    blocks: int | None = None

    @property
    def names_file(self) -> bool:
        """True when building it reads a file or imports code (a graph file, a config.json, a user module)."""
        return self.kind in (ModelSpecKind.FILE, ModelSpecKind.HF_FILE, ModelSpecKind.MODULE)

    @property
    def default_seq_len(self) -> int | None:
        """Tokens per sample when none is asked for (None: the builder decides, e.g. Hugging Face)."""
        if self.kind is ModelSpecKind.ZOO:
            return ZOO[self.name].seq_len
        if self.kind is ModelSpecKind.FAMILY:
            return _FAMILY_SEQ_LEN.get(self.name, DEFAULT_SEQ_LEN)
        return None


def parse_model_spec(text: str) -> ModelSpec:
    """The ModelSpec `text` names; SpecError naming the value and what is accepted. Pure: no I/O."""
    if not isinstance(text, str):
        raise SpecError(f"model SPEC: {type(text).__name__} is not accepted; expected a string")
    spec = text.strip()
    if not spec:
        raise SpecError("model SPEC is empty; give a zoo name, FAMILY?key=value, hf:ConfigClass, a file path "
                        "or module.py:Name")
    if len(spec) > MAX_SPEC_CHARS:
        raise SpecError(f"model SPEC: {len(spec)} characters is over the limit of {MAX_SPEC_CHARS}")
    if spec.startswith("hf:"):
        return _parse_hf(spec)
    module = _MODULE.fullmatch(spec)
    if module is not None:
        return ModelSpec(spec, ModelSpecKind.MODULE, module["module"], attr=module["attr"])
    if spec.lower().endswith(".py"):
        raise SpecError(f"model {spec!r}: a Python file needs the class or factory to build: add ':Name' "
                        f"(e.g. {spec}:MyModel; see docs/MODELS.md)")
    if spec.lower().endswith(_HF_CONFIG_NAME) or spec.endswith(("/", "\\")):
        return ModelSpec(spec, ModelSpecKind.HF_FILE, spec)
    if spec.lower().endswith(_GRAPH_SUFFIXES) or "/" in spec or "\\" in spec:
        return ModelSpec(spec, ModelSpecKind.FILE, spec)
    family, _, query = spec.partition("?")
    if family in FAMILIES:
        shape = parse_shape(family, query)
        return ModelSpec(spec, ModelSpecKind.FAMILY, family, overrides=tuple(parse_qsl(query, keep_blank_values=True)),
                         family=family, shape=shape, blocks=_block_count(family, shape))
    key = resolve_zoo_name(spec)
    if key is not None:
        entry = ZOO[key]
        return ModelSpec(spec, ModelSpecKind.ZOO, key, family=entry.family, shape=entry.shape,
                         blocks=_block_count(entry.family, entry.shape))
    err = unknown("model", spec, [*zoo_names(), *FAMILIES])
    raise SpecError(f"{err} (or FAMILY?key=value, hf:Name, a graph file, module.py:Name, or a folder holding "
                    f"config.json written with a trailing '/': {spec}/)")


def _block_count(family: str, shape: TransformerShape) -> int:
    """Repeated blocks of a family model (T5: encoder and decoder stacks)."""
    return shape.layers + (shape.dec_layers or shape.layers if family == "t5" else 0)


def _parse_hf(spec: str) -> ModelSpec:
    config_class, _, query = spec[3:].partition("?")
    if not re.fullmatch(r"[A-Za-z_]\w*", config_class):
        raise SpecError(f"model {spec!r}: {config_class!r} is not a Hugging Face config class name "
                        "(e.g. hf:LlamaConfig?num_hidden_layers=4)")
    overrides = tuple(parse_qsl(query, keep_blank_values=True))
    depths = []
    for key, value in overrides:
        if key in _HF_DEPTH_KEYS:
            if not re.fullmatch(r"\d{1,9}", value):
                raise SpecError(f"model {spec!r}: {key}={value!r} is not accepted; expected a whole number of blocks")
            depths.append(int(value))
    return ModelSpec(spec, ModelSpecKind.HF, config_class, overrides=overrides,
                     blocks=sum(depths) if depths else None)


def build_model(
    spec: ModelSpec,
    *,
    seq_len: int | None = None,
    dtype: DType = DType.BF16,
    input_shape: str | None = None,
) -> ModelGraph:
    """The ModelGraph of a parsed SPEC at `seq_len` tokens per sample (None: the model's own).

    `input_shape` (user modules only, e.g. "8x512:long"): the shape of the one example input, built
    as zeros in place of the module's own example inputs (`frontends.user_module`).

    SpecError for a bad SPEC value, a missing file or a sequence length the model cannot take.
    """
    if seq_len is not None and seq_len <= 0:
        raise SpecError(f"seq_len={seq_len}: must be a positive number of tokens")
    if input_shape is not None and spec.kind is not ModelSpecKind.MODULE:
        raise SpecError(f"input shape {input_shape[:40]!r}: only a user module (module.py:Name) is traced on example "
                        f"inputs; model {spec.text[:80]!r} takes its length from --seq")
    if spec.kind is ModelSpecKind.HF:
        from tagplan.frontends.huggingface import graph_from_hf  # torch + transformers: import on demand

        return graph_from_hf(spec.name, dict(spec.overrides), seq_len=seq_len, dtype=dtype)
    if spec.kind is ModelSpecKind.MODULE:
        from tagplan.frontends.user_module import graph_from_user_module  # imports the user's code

        return graph_from_user_module(spec.name, spec.attr, seq_len=seq_len, dtype=dtype, input_shape=input_shape)
    if spec.kind in (ModelSpecKind.FILE, ModelSpecKind.HF_FILE):
        return _load_file(spec.name, seq_len, dtype)
    if spec.kind is ModelSpecKind.ZOO:
        if seq_len is not None and (why := positions_refusal(spec, seq_len)) is not None:
            raise SpecError(why)
        return build_zoo(spec.name, seq_len=seq_len, dtype=dtype)
    return _build_family(spec, seq_len, dtype)


def load_model(
    text: str, *, seq_len: int | None = None, dtype: DType = DType.BF16, input_shape: str | None = None
) -> ModelGraph:
    """`build_model(parse_model_spec(text), ...)`: the ModelGraph a SPEC string names."""
    return build_model(parse_model_spec(text), seq_len=seq_len, dtype=dtype, input_shape=input_shape)


def positions_refusal(spec: ModelSpec, seq_len: int) -> str | None:
    """Why a zoo model of learned positions (gpt, bert) cannot take `seq_len` tokens: it keeps its published table
    (a `gpt?...` SPEC grows its own: `family_positions`); None where it can, or the SPEC is another kind."""
    if spec.kind is not ModelSpecKind.ZOO or spec.family not in {"gpt", "bert"} or spec.shape is None:
        return None
    positions = spec.shape.max_positions
    if seq_len <= positions:
        return None
    return (f"{spec.text}: seq_len={seq_len} exceeds its {positions} learned positions; accepted: at most {positions} "
            f"(or {spec.family}?... with max_positions={seq_len})")


def family_positions(spec: ModelSpec, seq_len: int) -> TransformerShape:
    """The family shape of a FAMILY or ZOO spec, a parametric gpt's position table grown to `seq_len`.

    A `gpt?...` SPEC that does not set max_positions gets a table as long as the sequence (what
    `build_model` builds); a zoo model keeps its published table.
    """
    if spec.shape is None:
        raise SpecError(f"model {spec.text!r}: its transformer shape is not known from the SPEC alone")
    shape = spec.shape
    if spec.kind is ModelSpecKind.FAMILY and spec.name == "gpt" and "max_positions" not in dict(spec.overrides):
        shape = replace(shape, max_positions=max(shape.max_positions, seq_len))
    return shape


def _build_family(spec: ModelSpec, seq_len: int | None, dtype: DType) -> ModelGraph:
    seq = seq_len or _FAMILY_SEQ_LEN.get(spec.name, DEFAULT_SEQ_LEN)
    shape = family_positions(spec, seq)
    if spec.name in {"gpt", "bert"} and seq > shape.max_positions:
        raise SpecError(f"{spec.name}: seq_len={seq} exceeds max_positions={shape.max_positions}")
    return FAMILIES[spec.name](spec.text, shape, seq, dtype)


def _load_hf_file(path: str, seq_len: int | None, dtype: DType) -> ModelGraph:
    from tagplan.frontends.huggingface import graph_from_hf_file  # torch + transformers: import on demand

    return graph_from_hf_file(path, seq_len=seq_len, dtype=dtype)


def _load_file(path: str, seq_len: int | None, dtype: DType) -> ModelGraph:
    if Path(path).is_dir():
        return _load_hf_file(path, seq_len, dtype)
    if not Path(path).is_file():
        raise SpecError(f"model file {path!r} does not exist (a SPEC with '/' or a .json/.yaml suffix is a path)")
    data = parse_structured(read_text(path), path)
    if isinstance(data, dict) and "blocks" not in data and ("model_type" in data or "architectures" in data):
        return _load_hf_file(path, seq_len, dtype)  # a Hugging Face config.json
    graph = graph_from_dict(data, path)
    if seq_len is not None and seq_len != graph.seq_len:
        raise SpecError(f"{path}: the graph is fixed at seq_len={graph.seq_len}; got --seq {seq_len}")
    return graph
