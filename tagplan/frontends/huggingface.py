"""ModelGraph from a Hugging Face config, offline: no download, no weights.

Three ways in (the model SPEC grammar, `frontends.model_spec`):
- `hf:LlamaConfig?num_hidden_layers=4&hidden_size=256`: a config class with overrides;
- `hf:MistralForCausalLM?...`: an architecture (any class transformers' auto mappings list);
- a `config.json` file as published on a model hub, or a directory holding one
  (`graph_from_hf_file`; `hf_config.read_hf_config` reads it).

Six config classes have a hand-checked recipe below (`_MODELS`: GPT-2, Llama, BERT, T5, Mixtral,
ViT; they also cover encoder-decoder and image inputs): the matching model class is instantiated
under `torch.device("meta")` with `use_cache=False` in training mode and traced by
`graph_from_module` on example inputs of `batch` samples (token ids, plus decoder ids for T5, or
images for ViT). Every other name and every config.json goes through `hf_auto.graph_from_config`
(causal LMs on token ids: Mistral, Qwen2/3, Gemma 2/3, Phi-3, GPT-NeoX, Falcon, DeepSeek-V3,
Qwen-MoE, ...).

Folding and the analytic mixture-of-experts costs are shared (`hf_fold`): a copy of the config
with at most 3 blocks per stack is traced; when the traced blocks after the first hash equal
(block 0 may differ, as T5's holds the relative attention bias), the last one is replicated to
the configured depth, numbering continued. Otherwise the full model is traced. The default
32-layer LlamaConfig builds in a few seconds this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tagplan.errors import SpecError
from tagplan.frontends.hf_auto import graph_from_config
from tagplan.frontends.hf_config import make_config, read_hf_config, resolve_hf_name
from tagplan.frontends.hf_fold import Stack, causal_masks, folded_or_whole, moe_analytic, with_values
from tagplan.frontends.torch_export import graph_from_module
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType

__all__ = ["graph_from_hf", "graph_from_hf_file", "list_hf_configs", "make_config"]

_MAX_DEFAULT_SEQ = 2048


@dataclass(frozen=True)
class _HFModel:
    """How to build and feed one config class with a recipe of its own."""

    model_class: str
    family: str
    inputs: str  # "tokens", "seq2seq" or "pixels"
    stacks: tuple[Stack, ...]  # depth attributes and substrings of their layer names
    positions: str | None = None  # attribute bounding seq_len; None: any length
    learned_positions: bool = False  # position table: seq_len may not exceed it
    default_seq: int | None = None


_LAYERS = (Stack("num_hidden_layers"),)
_MODELS: dict[str, _HFModel] = {
    "GPT2Config": _HFModel("GPT2LMHeadModel", "gpt2", "tokens", (Stack("n_layer"),), "n_positions", True),
    "LlamaConfig": _HFModel("LlamaForCausalLM", "llama", "tokens", _LAYERS, "max_position_embeddings"),
    "BertConfig": _HFModel("BertForMaskedLM", "bert", "tokens", _LAYERS, "max_position_embeddings", True),
    "T5Config": _HFModel(
        "T5ForConditionalGeneration",
        "t5",
        "seq2seq",
        (Stack("num_layers", "encoder."), Stack("num_decoder_layers", "decoder.")),
        default_seq=512,
    ),
    "MixtralConfig": _HFModel("MixtralForCausalLM", "mixtral", "tokens", _LAYERS, "max_position_embeddings"),
    "ViTConfig": _HFModel("ViTForImageClassification", "vit", "pixels", _LAYERS),
}


def list_hf_configs() -> list[str]:
    """Names of the config classes with a recipe of their own, sorted (any other causal LM is built too)."""
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
    """Build the ModelGraph of a Hugging Face model from a config class or architecture name and overrides.

    `seq_len` defaults to min(max positions, 2048) (T5: 512; ViT derives patches + 1 and ignores
    it). `fold=False` traces every block instead of replicating a traced one. Returns a graph
    with per-sample figures in `dtype`. Raises SpecError for an unknown name or key, a value of
    the wrong type, or a config the model class rejects.
    """
    if batch < 1:
        raise SpecError(f"{config_class}: batch must be positive, got {batch}")
    name = "hf:" + config_class + ("?" + "&".join(f"{k}={v}" for k, v in overrides.items()) if overrides else "")
    spec = _MODELS.get(config_class)
    if spec is None:
        arch = resolve_hf_name(config_class)
        config = make_config(arch.config_class, overrides)
        return graph_from_config(config, arch, name=name, seq_len=seq_len, dtype=dtype, batch=batch, fold=fold)
    config = make_config(config_class, overrides)
    seq = _seq_len(spec, config, seq_len, config_class)
    return folded_or_whole(name, spec.stacks, _depths(spec, config), fold, lambda short: _trace(
        spec, config if short is None else with_values(config, short), name, seq, dtype, batch))


def graph_from_hf_file(
    path: str, *, seq_len: int | None = None, dtype: DType = DType.BF16, batch: int = 2, fold: bool = True
) -> ModelGraph:
    """The ModelGraph of a Hugging Face `config.json` (or a directory holding one), built offline.

    The graph is named after the path; its family is the config's `model_type`. SpecError for a
    missing or unreadable file, an unknown model type, or a config transformers rejects.
    """
    config, arch = read_hf_config(path)
    return graph_from_config(config, arch, name=path, seq_len=seq_len, dtype=dtype, batch=batch, fold=fold)


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
    for stack in spec.stacks:
        value = getattr(config, stack.depth_attr, None)
        out[stack.depth_attr] = int(value if value is not None else getattr(config, spec.stacks[0].depth_attr))
    return out


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
        graph = moe_analytic(graph, config)
    return causal_masks(graph, spec.model_class, config)


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
