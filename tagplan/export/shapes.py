"""The transformer shape an exporter writes, read from the parsed model SPEC (no torch here).

The SPEC grammar is the frontends' (`tagplan.frontends.model_spec`): zoo names and
`family?key=value` SPECs carry their family and shape; `hf:LlamaConfig?...` and
`hf:GPT2Config?...` are read through the Hugging Face config (`frontends.huggingface.make_config`)
and exported as the llama and gpt families of the same shape (same layer list, same parameter
counts as the traced graph). Other Hugging Face configs, graph files and user modules have no
shape known from the SPEC alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlencode

from tagplan.errors import SpecError
from tagplan.frontends.families import TransformerShape, llama_ffn
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind, family_positions, parse_model_spec

SUPPORTED_FAMILIES = ("gpt", "llama")
"""The families the torch program builds (`tagplan.export.modules`)."""
HF_FAMILIES = {"LlamaConfig": "llama", "GPT2Config": "gpt"}
"""Hugging Face configs exported as the tagplan family of the same shape."""


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one model the torch program builds: family plus the shape fields it reads."""

    family: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int
    kv_heads: int
    head_dim: int
    max_positions: int
    tied: bool

    @property
    def num_layers(self) -> int:
        """Entries of the layer list: embedding, the blocks, the head."""
        return self.layers + 2


def parsed(spec: str | ModelSpec) -> ModelSpec:
    """`spec` parsed by the frontends' grammar (a ModelSpec is returned as it is)."""
    return spec if isinstance(spec, ModelSpec) else parse_model_spec(spec)


def transformer_shape(spec: str | ModelSpec) -> tuple[str, TransformerShape] | None:
    """(family, shape) of a zoo, family or `hf:LlamaConfig`/`hf:GPT2Config` SPEC; None for a graph
    file or a user module; SpecError for other Hugging Face configs."""
    model = parsed(spec)
    if model.kind is ModelSpecKind.HF:
        return hf_family_shape(model)
    if model.family is None or model.shape is None:
        return None
    return model.family, model.shape


def hf_family_shape(spec: ModelSpec) -> tuple[str, TransformerShape]:
    """The family and shape of an `hf:LlamaConfig?...` or `hf:GPT2Config?...` SPEC (config defaults
    overridden as `build_model` overrides them); SpecError for other config classes."""
    from tagplan.frontends.huggingface import make_config  # transformers: import on demand

    if spec.name not in HF_FAMILIES:
        raise SpecError(f"model {spec.text!r}: the exporters build {', '.join(sorted(HF_FAMILIES))} "
                        f"(as the {' and '.join(sorted(set(HF_FAMILIES.values())))} families); not {spec.name}")
    config = make_config(spec.name, dict(spec.overrides))
    if spec.name == "LlamaConfig":
        return "llama", TransformerShape(
            layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads or config.num_attention_heads, ffn=config.intermediate_size,
            vocab=config.vocab_size, max_positions=config.max_position_embeddings,
            tied=bool(config.tie_word_embeddings))
    return "gpt", TransformerShape(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head,
                                   ffn=config.n_inner or 4 * config.n_embd, vocab=config.vocab_size,
                                   max_positions=config.n_positions)


def family_shape(spec: str | ModelSpec) -> tuple[str, TransformerShape]:
    """(family, shape) of a SPEC the torch program builds (gpt and llama, see module docstring);
    SpecError for other families, graph files and user modules."""
    model = parsed(spec)
    found = transformer_shape(model)
    if found is None or found[0] not in SUPPORTED_FAMILIES:
        raise SpecError(f"model {model.text!r}: the torch exporter builds the {' and '.join(SUPPORTED_FAMILIES)} "
                        "families (zoo names or FAMILY?key=value); other families and user modules are not "
                        "supported yet")
    return found


def ffn_width(family: str, shape: TransformerShape) -> int:
    """The MLP width: the shape's own, else the family default (gpt 4x hidden, llama SwiGLU's)."""
    if shape.ffn:
        return shape.ffn
    return 4 * shape.hidden if family == "gpt" else llama_ffn(shape.hidden)


def model_config(spec: str | ModelSpec, *, seq_len: int) -> ModelConfig:
    """The ModelConfig of `spec` at `seq_len` tokens (a parametric gpt's positions grow to cover it,
    as `build_model` grows them: `frontends.model_spec.family_positions`)."""
    model = parsed(spec)
    family, s = family_shape(model)
    if model.kind is not ModelSpecKind.HF:
        s = family_positions(model, seq_len)
    if family == "gpt" and seq_len > s.max_positions:
        raise SpecError(f"gpt: seq_len={seq_len} exceeds max_positions={s.max_positions}")
    return ModelConfig(family=family, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab,
                       ffn=ffn_width(family, s), kv_heads=s.kvh, head_dim=s.dh, max_positions=s.max_positions,
                       tied=s.tied)


def scaled_down(spec: str | ModelSpec, *, seq_len: int = 16, heads: int = 4, head_dim: int = 16,
                vocab: int = 128) -> str:
    """A `family?...` SPEC of the same family and layer count, `heads * head_dim` wide, `vocab` tokens.

    Grouped-query attention keeps a ratio: kv_heads becomes 1 if the model has one kv head,
    else `heads // 2` when it has fewer kv heads than heads, else `heads`. gpt positions are
    cut to `seq_len`; the FFN takes the family's default for the new width.
    """
    family, s = family_shape(spec)
    small = replace(s, hidden=heads * head_dim, heads=heads, vocab=vocab, ffn=0, head_dim=0)
    query: dict[str, int | str] = {"layers": s.layers, "hidden": small.hidden, "heads": heads, "vocab": vocab}
    if family == "gpt":
        query["max_positions"] = seq_len
    else:
        query["kv_heads"] = 1 if s.kvh == 1 else heads // 2 if s.kvh < s.heads else heads
    if s.tied != (family == "gpt"):
        query["tied"] = str(s.tied).lower()
    return f"{family}?{urlencode(query)}"
