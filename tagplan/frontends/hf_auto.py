"""Any Hugging Face language model from its config: `hf:<Architecture>`, `hf:<ConfigClass>`, config.json.

The model class (a causal LM such as `MistralForCausalLM`, else the base model) is instantiated from
the config under `torch.device("meta")` with `use_cache=False` in training mode and traced by
`graph_from_module` on `batch` samples of token ids. Folding (`hf_fold`): the copy traced holds
`first_k_dense_replace` (DeepSeek-V3's dense prefix, else 0) plus at most 3 decoder layers, and
`layer_types` (sliding or full attention, Gemma 2/3, Qwen) cut to that depth; the layers' blocks
hash equal across attention types (the mask is a constant read from outside the layer). When the
traced repeated blocks do not hash equal, the full model is traced. Mixture-of-experts models
(any config with `num_experts_per_tok`: Mixtral, Qwen-MoE, DeepSeek-V3) get the analytic
routed-expert FLOPs and all-to-all ops of `hf_fold.moe_analytic`.

Tokens per sample default to min(max_position_embeddings, 2048).
"""

from __future__ import annotations

from typing import Any

import torch

from tagplan.errors import SpecError
from tagplan.frontends.hf_config import HFArch
from tagplan.frontends.hf_fold import Stack, causal_masks, folded_or_whole, moe_analytic, with_values
from tagplan.frontends.torch_export import graph_from_module
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType

_DEPTH = "num_hidden_layers"
_MAX_DEFAULT_SEQ = 2048


def graph_from_config(
    config: Any,
    arch: HFArch,
    *,
    name: str,
    seq_len: int | None = None,
    dtype: DType = DType.BF16,
    batch: int = 2,
    fold: bool = True,
) -> ModelGraph:
    """The ModelGraph of `arch.model_class` built from `config` (per-sample figures in `dtype`).

    Raises SpecError when the config has no layer count, the class rejects it, or tracing fails.
    """
    depth = getattr(config, _DEPTH, None)
    if not isinstance(depth, int) or depth < 1:
        raise SpecError(f"{name}: the {arch.config_class} has no positive {_DEPTH} (got {depth!r})")
    if seq_len is not None and seq_len < 1:
        raise SpecError(f"{name}: seq_len must be positive, got {seq_len}")
    seq = seq_len or min(_positions(config) or _MAX_DEFAULT_SEQ, _MAX_DEFAULT_SEQ)
    stacks = (Stack(_DEPTH, "", prefix=_dense_prefix(config, depth)),)
    return folded_or_whole(name, stacks, {_DEPTH: depth}, fold, lambda short: _trace(
        config if short is None else _shortened(config, short[_DEPTH]), arch, name, seq, dtype, batch))


def _positions(config: Any) -> int | None:
    value = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _dense_prefix(config: Any, depth: int) -> int:
    """Leading layers of another kind (DeepSeek's `first_k_dense_replace` dense MLPs)."""
    value = getattr(config, "first_k_dense_replace", None)
    return min(int(value), depth) if isinstance(value, int) and value > 0 else 0


def _shortened(config: Any, depth: int) -> Any:
    """A copy of the config with `depth` decoder layers (per-layer lists cut to match)."""
    values: dict[str, Any] = {_DEPTH: depth}
    types = getattr(config, "layer_types", None)
    if isinstance(types, list):
        values["layer_types"] = types[:depth]
    return with_values(config, values)


def _trace(config: Any, arch: HFArch, name: str, seq: int, dtype: DType, batch: int) -> ModelGraph:
    """Instantiate the model class on meta and trace it on token ids; MoE gets analytic experts."""
    import transformers

    cls = getattr(transformers, arch.model_class, None)
    if cls is None:
        raise SpecError(f"{name}: transformers {transformers.__version__} has no class {arch.model_class}")
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as exc:
        raise SpecError(f"{name}: cannot build {arch.model_class} from this config: {exc}") from exc
    model.train()
    with torch.device("meta"):
        ids = torch.zeros(batch, seq, dtype=torch.long)  # [batch, seq]
    inputs = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):  # T5, BART, ...: the decoder reads its own tokens
        inputs["decoder_input_ids"] = ids.clone()
    graph = graph_from_module(model, (), inputs, name=name, family=arch.model_type, seq_len=seq, dtype=dtype,
                              batch=batch)
    if getattr(config, "num_experts_per_tok", None):
        graph = moe_analytic(graph, config)
    return causal_masks(graph, arch.model_class, config)
