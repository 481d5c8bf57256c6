"""The transformer shape an exporter writes, read from the parsed model SPEC (no torch here).

The SPEC grammar is the frontends' (`tagplan.frontends.model_spec`): zoo names and
`family?key=value` SPECs carry their family and shape; `hf:LlamaConfig?...` and
`hf:GPT2Config?...` are read through the Hugging Face config (`frontends.huggingface.make_config`)
and exported to Megatron-LM as the llama and gpt families of the same shape (`transformer_shape`).
The torch program runs Hugging Face SPECs as the transformers class itself (`model_config` gives
them family `hf`; `tagplan.export.hf_modules`). Graph files and user modules have no shape known
from the SPEC alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlencode

from tagplan.errors import SpecError
from tagplan.frontends.families import TransformerShape, llama_ffn
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind, family_positions, parse_model_spec

SUPPORTED_FAMILIES = ("gpt", "llama", "moe")
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
    hf_spec: str = ""
    """Family `hf`: the `hf:` SPEC (or config.json path) the program builds the class from."""
    model_type: str = ""
    """Family `hf`: transformers' model type (`llama`, `gpt2`, ...)."""
    model_spec: str = ""
    """Family `module`: the user's `file.py:factory` or `package.module:factory` SPEC."""
    experts: int = 0
    """Family `moe`: SwiGLU experts per block, each token routed to `top_k` of them."""
    top_k: int = 0

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
    """(family, shape) of a SPEC the torch program builds (gpt, llama and moe: `SUPPORTED_FAMILIES`);
    SpecError for other families, graph files and user modules."""
    model = parsed(spec)
    found = transformer_shape(model)
    if found is None or found[0] not in SUPPORTED_FAMILIES:
        family = f"of family {found[0]!r}" if found is not None else "of no transformer family"
        raise SpecError(f"model {model.text!r} is {family}: the torch exporter builds the "
                        f"{', '.join(SUPPORTED_FAMILIES)} families from its own modules (zoo names or "
                        "FAMILY?key=value), Llama-style and GPT-2 Hugging Face classes (hf:...) and a user's own "
                        "nn.Sequential module (path/to/file.py:factory)")
    return found


def ffn_width(family: str, shape: TransformerShape) -> int:
    """The MLP width: the shape's own, else the family default (gpt 4x hidden, llama SwiGLU's)."""
    if shape.ffn:
        return shape.ffn
    return 4 * shape.hidden if family == "gpt" else llama_ffn(shape.hidden)


def model_config(spec: str | ModelSpec, *, seq_len: int) -> ModelConfig:
    """The ModelConfig of `spec` at `seq_len` tokens (a parametric gpt's positions grow to cover it,
    as `build_model` grows them: `frontends.model_spec.family_positions`); family `hf` for an
    `hf:` SPEC (`hf_config`)."""
    model = parsed(spec)
    if model.kind in (ModelSpecKind.HF, ModelSpecKind.HF_FILE):
        return hf_config(model, seq_len=seq_len)
    if model.kind is ModelSpecKind.MODULE:
        from tagplan.export.user_modules import module_config_fields  # imports the user's code and torch

        return ModelConfig(**module_config_fields(model, seq_len))
    family, s = family_shape(model)
    if model.kind is not ModelSpecKind.HF:
        s = family_positions(model, seq_len)
    if family == "gpt" and seq_len > s.max_positions:
        raise SpecError(f"gpt: seq_len={seq_len} exceeds max_positions={s.max_positions}")
    moe = family == "moe"
    return ModelConfig(family=family, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab,
                       ffn=ffn_width(family, s), kv_heads=s.kvh, head_dim=s.dh, max_positions=s.max_positions,
                       tied=s.tied, experts=s.experts if moe else 0, top_k=s.top_k if moe else 0)


def hf_config(spec: ModelSpec, *, seq_len: int) -> ModelConfig:
    """The ModelConfig (family `hf`) of an `hf:` SPEC the torch program runs as the transformers class;
    SpecError for a model type it does not run (`hf_modules.layout_of`) or a sequence too long."""
    from tagplan.export.hf_modules import depth, hf_config_of, layout_of  # transformers: on demand

    config, model_type, _ = hf_config_of(spec)
    gpt2 = layout_of(model_type) == "gpt2"
    hidden = int(config.n_embd if gpt2 else config.hidden_size)
    heads = int(config.n_head if gpt2 else config.num_attention_heads)
    kv_heads = heads if gpt2 else int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    positions = int(config.n_positions if gpt2 else config.max_position_embeddings)
    if gpt2 and seq_len > positions:
        raise SpecError(f"model {spec.text!r}: seq_len={seq_len} exceeds n_positions={positions}")
    ffn = int((config.n_inner or 4 * hidden) if gpt2 else config.intermediate_size)
    return ModelConfig(family="hf", layers=depth(config, model_type), hidden=hidden, heads=heads,
                       vocab=int(config.vocab_size), ffn=ffn, kv_heads=kv_heads, head_dim=head_dim,
                       max_positions=positions, tied=bool(getattr(config, "tie_word_embeddings", False)),
                       hf_spec=spec.text, model_type=model_type)


_HF_SIZE_KEYS = {
    "gpt2": ("n_embd", "n_head", "n_inner", "vocab_size", "n_positions", "resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "decoder": ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "max_position_embeddings", "attention_dropout"),
}


def scaled_down_hf(spec: ModelSpec, *, seq_len: int, heads: int, head_dim: int, vocab: int) -> str:
    """An `hf:` SPEC of the same config class, depth and other overrides (a config.json: its depth and
    tying), `heads * head_dim` wide, `vocab` tokens, no dropout (grouped-query attention keeps a
    ratio as `scaled_down` does)."""
    from tagplan.export.hf_modules import hf_config_of, layout_of, make_hf_config

    c = hf_config(spec, seq_len=seq_len)
    _, _, config_class = hf_config_of(spec)
    default, _ = make_hf_config(config_class, {})
    layout = layout_of(c.model_type)
    if spec.kind is ModelSpecKind.HF_FILE:  # the file's class, depth and tying; other fields take defaults
        keep: list[tuple[str, object]] = [("n_layer" if layout == "gpt2" else "num_hidden_layers", c.layers),
                                          ("tie_word_embeddings", str(c.tied).lower())]
    else:
        keep = [(k, v) for k, v in spec.overrides if k not in _HF_SIZE_KEYS[layout]]
    hidden = heads * head_dim
    size: dict[str, int | float] = (
        {"n_embd": hidden, "n_head": heads, "vocab_size": vocab, "n_positions": seq_len, "resid_pdrop": 0.0,
         "embd_pdrop": 0.0, "attn_pdrop": 0.0} if layout == "gpt2" else
        {"hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim,
         "num_key_value_heads": 1 if c.kv_heads == 1 else heads // 2 if c.kv_heads < c.heads else heads,
         "intermediate_size": 2 * hidden, "vocab_size": vocab, "max_position_embeddings": max(seq_len, 64)})
    if layout == "decoder" and getattr(default, "head_dim", None) is None:
        size.pop("head_dim")  # a class without the key derives it as hidden // heads
    return f"hf:{config_class}?{urlencode([*keep, *size.items()])}"


def scaled_down(spec: str | ModelSpec, *, seq_len: int = 16, heads: int = 4, head_dim: int = 16,
                vocab: int = 128) -> str:
    """A `family?...` SPEC of the same family and layer count, `heads * head_dim` wide, `vocab` tokens.

    Grouped-query attention keeps a ratio: kv_heads becomes 1 if the model has one kv head,
    else `heads // 2` when it has fewer kv heads than heads, else `heads`. gpt positions are
    cut to `seq_len`; the FFN takes the family's default for the new width. An `hf:` SPEC stays
    one of its class (`scaled_down_hf`); a user's module is returned as it is.
    """
    if parsed(spec).kind in (ModelSpecKind.HF, ModelSpecKind.HF_FILE):
        return scaled_down_hf(parsed(spec), seq_len=seq_len, heads=heads, head_dim=head_dim, vocab=vocab)
    if parsed(spec).kind is ModelSpecKind.MODULE:
        return parsed(spec).text  # a user's module runs at the size its factory builds
    family, s = family_shape(spec)
    small = replace(s, hidden=heads * head_dim, heads=heads, vocab=vocab, ffn=0, head_dim=0)
    query: dict[str, int | str] = {"layers": s.layers, "hidden": small.hidden, "heads": heads, "vocab": vocab}
    if family == "gpt":
        query["max_positions"] = seq_len
    else:
        query["kv_heads"] = 1 if s.kvh == 1 else heads // 2 if s.kvh < s.heads else heads
    if family == "moe":  # the same routing (as many experts, as many chosen per token), llama's FFN for the width
        query |= {"experts": s.experts, "top_k": s.top_k, "ffn": llama_ffn(small.hidden)}
    if s.tied != (family == "gpt"):
        query["tied"] = str(s.tied).lower()
    return f"{family}?{urlencode(query)}"
