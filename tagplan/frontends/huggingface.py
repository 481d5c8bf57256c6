"""ModelGraph from a Hugging Face config class, offline: no download, no weights.

`hf:LlamaConfig?num_hidden_layers=4&hidden_size=256` becomes the config class with those
overrides, the matching model class instantiated under `torch.device("meta")` with
`use_cache=False` in training mode, and `graph_from_module` on example inputs of `batch`
samples (token ids, plus decoder ids for T5, or images for ViT).

Folding: a copy of the config with at most 3 blocks per stack is traced; when the traced blocks
after the first hash equal (block 0 may differ, as T5's holds the relative attention bias), the
last one is replicated to the configured depth, numbering continued. Otherwise the full model
is traced. The default 32-layer LlamaConfig builds in a few seconds this way.

Mixture of experts (Mixtral): what is traced and what is analytic.
- Traced: attention, norms, the router (gate linear, softmax, top-k) and the expert
  computation as transformers implements it: tokens sorted by expert and two grouped matmuls
  over `tokens * top_k` rows. All expert weights are parameters of the graph, so `params` and
  `param_bytes` count every expert.
- Analytic: FlopCounterMode reports 0 FLOPs for the grouped matmul custom op on meta, and other
  implementations loop over experts with data-dependent sizes. The expert matmuls' FLOPs are
  therefore set to the top-k cost, `2 * 3 * hidden * intermediate * top_k` per token (gate, up
  and down projections for each of the token's top_k experts), split over the expert matmul ops
  in proportion to their traced shapes. Two ALL_TO_ALL ops (dispatch before the experts,
  combine after; 0 FLOPs, `tokens * hidden * top_k` elements each way) mark where expert
  parallelism moves tokens; expert matmuls carry PartitionDim.EXPERTS.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

from tagplan.errors import SpecError, nearest, unknown
from tagplan.frontends.torch_export import graph_from_module
from tagplan.ir.model import Block, Layer, ModelGraph, Op, OpKind, PartitionDim
from tagplan.ir.workload import DType

log = logging.getLogger(__name__)

_FOLD_DEPTH = 3  # blocks per stack traced when folding
_MAX_DEFAULT_SEQ = 2048


@dataclass(frozen=True)
class _HFModel:
    """How to build and feed one supported config class."""

    model_class: str
    family: str
    inputs: str  # "tokens", "seq2seq" or "pixels"
    stacks: tuple[tuple[str, str], ...]  # (depth attribute, substring of its layer names)
    positions: str | None = None  # attribute bounding seq_len; None: any length
    learned_positions: bool = False  # position table: seq_len may not exceed it
    default_seq: int | None = None


_MODELS: dict[str, _HFModel] = {
    "GPT2Config": _HFModel("GPT2LMHeadModel", "gpt2", "tokens", (("n_layer", ""),), "n_positions", True),
    "LlamaConfig": _HFModel(
        "LlamaForCausalLM", "llama", "tokens", (("num_hidden_layers", ""),), "max_position_embeddings"
    ),
    "BertConfig": _HFModel(
        "BertForMaskedLM", "bert", "tokens", (("num_hidden_layers", ""),), "max_position_embeddings", True
    ),
    "T5Config": _HFModel(
        "T5ForConditionalGeneration",
        "t5",
        "seq2seq",
        (("num_layers", "encoder."), ("num_decoder_layers", "decoder.")),
        default_seq=512,
    ),
    "MixtralConfig": _HFModel(
        "MixtralForCausalLM", "mixtral", "tokens", (("num_hidden_layers", ""),), "max_position_embeddings"
    ),
    "ViTConfig": _HFModel("ViTForImageClassification", "vit", "pixels", (("num_hidden_layers", ""),)),
}


def list_hf_configs() -> list[str]:
    """Names of the supported Hugging Face config classes, sorted."""
    return sorted(_MODELS)


def graph_from_hf(
    config_class: str,
    overrides: dict[str, str],
    *,
    seq_len: int | None = None,
    dtype: DType = DType.BF16,
    batch: int = 2,
    fold: bool = True,
) -> ModelGraph:
    """Build the ModelGraph of a Hugging Face model from its config class and string overrides.

    `seq_len` defaults to min(max positions, 2048) (T5: 512; ViT derives patches + 1 and ignores
    it). `fold=False` traces every block instead of replicating a traced one. Returns a graph
    with per-sample figures in `dtype`. Raises SpecError for an unknown class or key, a value of
    the wrong type, or a config the model class rejects.
    """
    spec = _MODELS.get(config_class)
    if batch < 1:
        raise SpecError(f"{config_class}: batch must be positive, got {batch}")
    if spec is None:
        raise unknown("Hugging Face config class", config_class, list(_MODELS))
    config = make_config(config_class, overrides)
    seq = _seq_len(spec, config, seq_len, config_class)
    name = "hf:" + config_class + ("?" + "&".join(f"{k}={v}" for k, v in overrides.items()) if overrides else "")
    depths = _depths(spec, config)
    short = {attr: min(d, _FOLD_DEPTH) for attr, d in depths.items()}
    if fold and short != depths:
        graph = _trace(spec, _with(config, short), name, seq, dtype, batch)
        folded = _unfold(graph, spec, short, depths)
        if folded is not None:
            return folded
        log.info("%s: traced blocks differ, tracing all %s blocks", name, sum(depths.values()))
    return _trace(spec, config, name, seq, dtype, batch)


def make_config(config_class: str, overrides: dict[str, str]) -> Any:
    """The config object with overrides coerced to the types of the defaults."""
    import transformers

    cls = getattr(transformers, config_class)
    default = cls()
    keys = sorted(set(default.to_dict()) | set(getattr(cls, "attribute_map", {})))
    values: dict[str, Any] = {}
    for key, text in overrides.items():
        if key not in keys:
            close = nearest(key, keys, n=5) or keys[:5]
            raise SpecError(
                f"unknown {config_class} key {key!r}. Did you mean {', '.join(repr(c) for c in close)}? "
                f"({len(keys)} keys are accepted)"
            )
        values[key] = _coerce(config_class, key, text, getattr(default, key, None))
    values["use_cache"] = False
    try:
        return cls(**values)
    except Exception as exc:
        raise SpecError(f"{config_class}: the overrides {overrides} are rejected: {exc}") from exc


def _coerce(config_class: str, key: str, text: str, default: Any) -> Any:
    """Parse a query-string value as the type of the config's default value."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, str):
            return text
        if text.lower() in ("none", "null"):
            return None
        return json.loads(text)  # numbers, booleans, lists and dicts for None/list/dict defaults
    except ValueError:
        if default is None:
            return text
        raise SpecError(
            f"{config_class}: {key}={text!r} is not a valid {type(default).__name__} "
            f"(default {default!r})"
        ) from None


def _seq_len(spec: _HFModel, config: Any, requested: int | None, config_class: str) -> int:
    """Tokens per sample: derived for ViT, else requested or min(max positions, 2048)."""
    if spec.inputs == "pixels":
        return int((config.image_size // config.patch_size) ** 2 + 1)
    limit = int(getattr(config, spec.positions)) if spec.positions else None
    if requested is None:
        return spec.default_seq or min(limit or _MAX_DEFAULT_SEQ, _MAX_DEFAULT_SEQ)
    if requested < 1:
        raise SpecError(f"{config_class}: seq_len must be positive, got {requested}")
    if spec.learned_positions and limit is not None and requested > limit:
        raise SpecError(
            f"{config_class}: seq_len {requested} exceeds the {limit} learned positions ({spec.positions})"
        )
    return requested


def _depths(spec: _HFModel, config: Any) -> dict[str, int]:
    """Blocks per stack (T5's decoder depth defaults to the encoder's)."""
    out: dict[str, int] = {}
    for attr, _ in spec.stacks:
        value = getattr(config, attr, None)
        out[attr] = int(value if value is not None else getattr(config, spec.stacks[0][0]))
    return out


def _with(config: Any, values: dict[str, int]) -> Any:
    """A copy of the config with some attributes replaced."""
    new = copy.deepcopy(config)
    for key, value in values.items():
        setattr(new, key, value)
    return new


def _trace(spec: _HFModel, config: Any, name: str, seq: int, dtype: DType, batch: int) -> ModelGraph:
    """Instantiate the model on meta and trace it; MoE models get their analytic expert costs."""
    import transformers

    try:
        with torch.device("meta"):
            model = getattr(transformers, spec.model_class)(config)
    except Exception as exc:
        raise SpecError(f"{name}: cannot build {spec.model_class} from this config: {exc}") from exc
    model.train()
    graph = graph_from_module(
        model, (), _example_inputs(spec, config, seq, batch), name=name, family=spec.family,
        seq_len=seq, dtype=dtype, batch=batch,
    )  # fmt: skip
    if spec.family == "mixtral":
        graph = _moe_analytic(graph, config)
    return graph


def _example_inputs(spec: _HFModel, config: Any, seq: int, batch: int) -> dict[str, torch.Tensor]:
    """Meta example inputs of `batch` samples."""
    with torch.device("meta"):
        if spec.inputs == "pixels":
            size = int(config.image_size)
            return {"pixel_values": torch.zeros(batch, int(config.num_channels), size, size)}
        ids = torch.zeros(batch, seq, dtype=torch.long)  # [batch, seq]
        if spec.inputs == "seq2seq":
            return {"input_ids": ids, "decoder_input_ids": ids.clone()}
        return {"input_ids": ids}


def _unfold(graph: ModelGraph, spec: _HFModel, traced: dict[str, int], full: dict[str, int]) -> ModelGraph | None:
    """Replicate each stack's last traced block to the full depth; None if blocks are not periodic."""
    layers = list(graph.layers)
    spans = []
    for attr, hint in spec.stacks:
        if traced[attr] == full[attr]:
            continue
        span = _stack_span(layers, hint, traced[attr])
        if span is None:
            return None
        first, last = span
        if len({layers[i].block for i in range(first + 1, last + 1)}) > 1:
            return None
        spans.append((first, last, full[attr]))
    for first, last, depth in sorted(spans, reverse=True):  # later stacks first: indices stay valid
        layers = _extend(layers, first, last, depth)
    return _rebuild(graph, layers=tuple(layers))


def _rebuild(graph: ModelGraph, **update: Any) -> ModelGraph:
    """A validated copy of `graph` with some fields replaced."""
    return ModelGraph.model_validate({**dict(graph), **update})


def _stack_span(layers: list[Layer], hint: str, depth: int) -> tuple[int, int] | None:
    """First and last index of the layers `<stem>.0` .. `<stem>.<depth-1>` whose stem holds `hint`."""
    for i, layer in enumerate(layers):
        m = re.fullmatch(r"(.*\.)?0", layer.name)
        if m is None or hint not in layer.name:
            continue
        stem = m.group(1) or ""
        names = [f"{stem}{k}" for k in range(depth)]
        if [x.name for x in layers[i : i + depth]] == names:
            return i, i + depth - 1
    return None


def _extend(layers: list[Layer], first: int, last: int, depth: int) -> list[Layer]:
    """Insert copies of `layers[last]` so the stack starting at `first` holds `depth` blocks."""
    added = depth - (last - first + 1)
    template = layers[last]
    stem = template.name.rsplit(".", 1)[0]
    copies = []
    for j in range(1, added + 1):
        inputs = None
        if template.inputs is not None:  # in-stack sources keep their offset, others stay put
            inputs = tuple(s + j if s >= first else s for s in template.inputs)
        copies.append(Layer(name=f"{stem}.{last - first + j}", block=template.block, inputs=inputs))
    after = [
        layer if layer.inputs is None
        else layer.model_copy(update={"inputs": tuple(s + added if s >= last else s for s in layer.inputs)})
        for layer in layers[last + 1 :]
    ]  # fmt: skip
    return layers[: last + 1] + copies + after


def _moe_analytic(graph: ModelGraph, config: Any) -> ModelGraph:
    """Set expert FLOPs to the top-k formula and add dispatch/combine all-to-alls."""
    hidden, ffn = int(config.hidden_size), int(config.intermediate_size)
    top_k = int(config.num_experts_per_tok)
    per_sample = 2.0 * 3 * hidden * ffn * top_k * graph.seq_len
    a2a_bytes = float(graph.seq_len * hidden * top_k * graph.dtype.nbytes)
    renamed: dict[str, str] = {}
    blocks = []
    for block in graph.blocks:
        new = _moe_block(block, per_sample, a2a_bytes)
        renamed[block.hash] = new.hash
        blocks.append(new)
    layers = tuple(layer.model_copy(update={"block": renamed[layer.block]}) for layer in graph.layers)
    return _rebuild(graph, blocks=tuple(blocks), layers=layers)


def _moe_block(block: Block, expert_flops: float, a2a_bytes: float) -> Block:
    """One block with analytic expert FLOPs and all-to-all ops (unchanged if it has no experts)."""
    ops = list(block.ops)
    experts = [i for i, op in enumerate(ops) if op.kind is OpKind.MATMUL and PartitionDim.EXPERTS in op.partition_dims]
    if not experts:
        return block
    traced = sum(ops[i].flops for i in experts)
    for i in experts:
        share = ops[i].flops / traced if traced > 0 else 1 / len(experts)
        ops[i] = ops[i].model_copy(update={"flops": expert_flops * share})
    first, last = ops[experts[0]], ops[experts[-1]]
    scope = first.name.rsplit(".", 1)[0] if "." in first.name else "experts"
    dims = (PartitionDim.BATCH, PartitionDim.EXPERTS)
    dispatch = Op(
        name=f"{scope}.dispatch", kind=OpKind.ALL_TO_ALL, flops=0, bytes_read=a2a_bytes,
        bytes_written=a2a_bytes, partition_dims=dims, inputs=first.inputs,
    )  # fmt: skip
    combine = Op(
        name=f"{scope}.combine", kind=OpKind.ALL_TO_ALL, flops=0, bytes_read=a2a_bytes,
        bytes_written=a2a_bytes, partition_dims=dims, inputs=(last.name,),
    )  # fmt: skip
    ops[experts[0]] = first.model_copy(update={"inputs": (dispatch.name,)})
    ops = [
        op.model_copy(update={"inputs": tuple(combine.name if x == last.name else x for x in op.inputs)})
        for op in ops
    ]
    start, end = experts[0], experts[-1] + 1
    ops = [*ops[:start], dispatch, *ops[start:end], combine, *ops[end:]]
    digest = _rehash(block.hash, expert_flops, a2a_bytes)
    return Block(hash=digest, kind=block.kind, ops=tuple(ops), params=block.params, output_bytes=block.output_bytes)


def _rehash(digest: str, *facts: float) -> str:
    """A new structural hash for a block changed by the analytic MoE pass (equal in, equal out)."""
    text = json.dumps([digest, "moe-analytic", *facts])
    return hashlib.sha256(text.encode()).hexdigest()[: len(digest)]
