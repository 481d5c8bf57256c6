"""Torch modules of the model families the exporter runs, built from a model SPEC, layer by layer.

The layer list matches `ModelGraph.layers` of the same SPEC one for one (embedding, blocks...,
head), so a plan stage's `layers=(a, b)` is the slice `a:b`, and every module attribute that
holds a matmul or embedding is named after the op the analytic family gives it (`attn.q`,
`mlp.fc1`, `wte`, ...): a stage's per-op `sharding` finds its module by the op's name.

- gpt (GPT-2/3): learned positions, pre-LN blocks with separate q/k/v projections, GELU MLP,
  final LayerNorm, head tied to the token embedding (op `lm_head.tied`).
- llama: RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP, untied head.

Parameter counts equal the analytic graph's exactly (tests pin it). Every layer initializes
itself from its own generator, seeded by `(seed, layer index)`, so a program that builds only
its pipeline stage's layers holds the same numbers as a single process that builds them all.
All parameters are random (biases and norm gains included): a bias added twice shows up.
A user's own module (`module.path:factory`) is not supported yet.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import urlencode

import torch
from torch import nn
from torch.nn import functional

from tagplan.errors import SpecError
from tagplan.frontends.families import TransformerShape, _llama_ffn
from tagplan.frontends.parametric import parse_shape
from tagplan.frontends.zoo import ZOO, resolve_zoo_name

SUPPORTED_FAMILIES = ("gpt", "llama")
INIT_STD = 0.02


@dataclass(frozen=True)
class ModelConfig:
    """The shape of one exportable model: family plus the transformer shape fields it reads."""

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


HF_FAMILIES = {"LlamaConfig": "llama", "GPT2Config": "gpt"}
"""Hugging Face configs built as the tagplan family of the same shape (same layers, parameter counts)."""


def family_shape(spec: str) -> tuple[str, TransformerShape]:
    """(family, shape) of a zoo name, a `family?key=value` SPEC, or `hf:LlamaConfig?...` /
    `hf:GPT2Config?...` (built as the llama / gpt family of the same shape: the program's modules
    are tagplan's, not Hugging Face's classes); SpecError for other families."""
    if spec.strip().startswith("hf:"):
        return hf_family_shape(spec.strip()[3:])
    family, _, query = spec.strip().partition("?")
    if family in SUPPORTED_FAMILIES:
        return family, parse_shape(family, query)
    key = resolve_zoo_name(spec.strip())
    if key is not None and ZOO[key].family in SUPPORTED_FAMILIES:
        return ZOO[key].family, ZOO[key].shape
    raise SpecError(f"model {spec!r}: the torch exporter builds the {' and '.join(SUPPORTED_FAMILIES)} families "
                    "(zoo names or FAMILY?key=value); other families and user modules are not supported yet")


def hf_family_shape(rest: str) -> tuple[str, TransformerShape]:
    """The family and shape of a Hugging Face config `Class?key=value&...` (overrides as `load_model` takes)."""
    from urllib.parse import parse_qsl

    from tagplan.frontends.huggingface import _make_config

    cls, _, query = rest.partition("?")
    if cls not in HF_FAMILIES:
        raise SpecError(f"model 'hf:{rest}': the torch exporter builds {', '.join(sorted(HF_FAMILIES))} "
                        f"(as the {' and '.join(sorted(set(HF_FAMILIES.values())))} families); not {cls}")
    config = _make_config(cls, dict(parse_qsl(query, keep_blank_values=True)))
    if cls == "LlamaConfig":
        return "llama", TransformerShape(
            layers=config.num_hidden_layers, hidden=config.hidden_size, heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads or config.num_attention_heads, ffn=config.intermediate_size,
            vocab=config.vocab_size, max_positions=config.max_position_embeddings,
            tied=bool(config.tie_word_embeddings))
    return "gpt", TransformerShape(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head,
                                   ffn=config.n_inner or 4 * config.n_embd, vocab=config.vocab_size,
                                   max_positions=config.n_positions)


def model_config(spec: str, *, seq_len: int) -> ModelConfig:
    """The ModelConfig of `spec` at `seq_len` tokens (gpt positions grow to cover it, as `load_model` does)."""
    family, s = family_shape(spec)
    positions = s.max_positions
    head, _, query = spec.strip().partition("?")
    if head == "gpt" and "max_positions" not in query:  # as `load_model` grows a parametric gpt's table
        positions = max(positions, seq_len)
    if family == "gpt" and seq_len > positions:
        raise SpecError(f"gpt: seq_len={seq_len} exceeds max_positions={positions}")
    ffn = s.ffn or (4 * s.hidden if family == "gpt" else _llama_ffn(s.hidden))
    return ModelConfig(family=family, layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab, ffn=ffn,
                       kv_heads=s.kvh, head_dim=s.dh, max_positions=positions, tied=s.tied)


def scaled_down(spec: str, *, seq_len: int = 16, heads: int = 4, head_dim: int = 16, vocab: int = 128) -> str:
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


def layer_generator(seed: int, index: int) -> torch.Generator:
    """The generator layer `index` initializes from (independent of which process builds it)."""
    return torch.Generator().manual_seed(seed * 100_003 + index)


def _normal(tensor: torch.Tensor, generator: torch.Generator, mean: float = 0.0) -> None:
    with torch.no_grad():
        tensor.normal_(mean, INIT_STD, generator=generator)


def _init_module(module: nn.Module, generator: torch.Generator) -> None:
    """Every parameter random in registration order: weights N(0, 0.02), norm gains N(1, 0.02)."""
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            norm = isinstance(sub, nn.LayerNorm | nn.RMSNorm) and name == "weight"
            _normal(p, generator, 1.0 if norm else 0.0)


class Attention(nn.Module):
    """Causal multi-head attention with separate q, k, v, o projections (optionally GQA and rotary).

    Head counts are read from the projections' output widths at run time, so a tensor-parallel
    rank holding `heads / tp` query heads and `kv_heads / tp` key/value heads runs unchanged.

    Shapes: x (batch, seq, hidden) -> (batch, seq, hidden).
    """

    def __init__(self, c: ModelConfig, *, bias: bool, rotary: bool) -> None:
        super().__init__()
        self.head_dim, self.rotary = c.head_dim, rotary
        self.q = nn.Linear(c.hidden, c.heads * c.head_dim, bias=bias)
        self.k = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=bias)
        self.v = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=bias)
        self.o = nn.Linear(c.heads * c.head_dim, c.hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, dh)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_heads, s, dh)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_heads, s, dh)
        if self.rotary:
            q, k = rotate(q), rotate(k)
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))
        return self.o(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, hidden)


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, half-split form) of x (batch, heads, seq, dh)."""
    dh, seq = x.size(-1), x.size(-2)
    inv = base ** (-torch.arange(0, dh, 2, dtype=torch.float32) / dh)  # (dh / 2)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)  # (seq, dh / 2)
    cos, sin = angles.cos().repeat(1, 2).to(x.dtype), angles.sin().repeat(1, 2).to(x.dtype)  # (seq, dh)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class GeluMLP(nn.Module):
    """fc2(gelu(fc1(x))). Shapes: (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c.hidden, c.ffn), nn.Linear(c.ffn, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(functional.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020). Shapes: (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then + mlp(norm2(.)).

    With `recompute` set (by the exported program) the block keeps only its input and runs its
    forward again in the backward pass (non-reentrant `torch.utils.checkpoint`).

    Shapes: x (batch, seq, hidden) -> (batch, seq, hidden).
    """

    recompute: bool = False

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        gpt = c.family == "gpt"
        self.norm_names = ("ln_1", "ln_2") if gpt else ("input_norm", "post_attention_norm")
        for name in self.norm_names:
            self.add_module(name, nn.LayerNorm(c.hidden) if gpt else nn.RMSNorm(c.hidden, eps=1e-5))
        self.attn = Attention(c, bias=gpt, rotary=not gpt)
        self.mlp: nn.Module = GeluMLP(c) if gpt else SwiGLU(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            out: torch.Tensor = torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=False)
            return out
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        norm1, norm2 = (getattr(self, n) for n in self.norm_names)
        x = x + self.attn(norm1(x))
        return x + self.mlp(norm2(x))


class Embedding(nn.Module):
    """Token embedding `wte`, plus learned positions `wpe` when `max_positions` is set.

    Shapes: tokens (batch, seq) int64 -> (batch, seq, hidden).
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.max_positions, c.hidden) if c.family == "gpt" else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.size(1), device=tokens.device))
        return x


class Head(nn.Module):
    """Final norm and vocabulary projection `lm_head` (the loss is the caller's).

    Shapes: x (batch, seq, hidden) -> logits (batch, seq, vocab).
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        gpt = c.family == "gpt"
        self.final_norm = nn.LayerNorm(c.hidden) if gpt else nn.RMSNorm(c.hidden, eps=1e-5)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.tied = c.tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.final_norm(x))


def tp_ops(config: ModelConfig, index: int) -> dict[str, str]:
    """Analytic op name -> module path inside layer `index`, for the ops tensor parallelism splits."""
    if index == 0:
        return {"wte": "wte", "wpe": "wpe"} if config.family == "gpt" else {"wte": "wte"}
    if index == config.num_layers - 1:
        return {"lm_head.tied" if config.tied else "lm_head": "lm_head"}
    mlp = ("mlp.fc1", "mlp.fc2") if config.family == "gpt" else ("mlp.gate", "mlp.up", "mlp.down")
    return {name: name for name in ("attn.q", "attn.k", "attn.v", "attn.o", *mlp)}


def build_layer(config: ModelConfig, index: int, *, seed: int) -> nn.Module:
    """Layer `index` of the layer list (0: embedding, last: head), initialized from its own generator.

    A tied head gets its own copy of the embedding table, initialized identically: the caller
    either shares it (`build_model`) or keeps the copies equal by summing their gradients.
    """
    if not 0 <= index < config.num_layers:
        raise IndexError(f"layer {index} is not in [0, {config.num_layers})")
    if index == 0:
        layer: nn.Module = Embedding(config)
    elif index == config.num_layers - 1:
        layer = Head(config)
    else:
        layer = Block(config)
    _init_module(layer, layer_generator(seed, index))
    if isinstance(layer, Head) and config.tied:
        _normal(layer.lm_head.weight, layer_generator(seed, 0))  # the embedding's first draw: wte
    return layer


class LanguageModel(nn.Module):
    """The whole model in one process (the reference the exported program is checked against).

    `layers` is the layer list; with a tied head the head's weight *is* the embedding's.
    Shapes: tokens (batch, seq) int64 -> logits (batch, seq, vocab).
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(build_layer(config, i, seed=seed) for i in range(config.num_layers))
        head, embed = self.layers[-1], self.layers[0]
        if config.tied and isinstance(head, Head) and isinstance(embed, Embedding):
            head.lm_head.weight = embed.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.layers:
            x = layer(x)
        return x


def build_model(spec: str, *, seq_len: int, seed: int = 0) -> LanguageModel:
    """The whole model `spec` names, as one module, at `seq_len` tokens."""
    return LanguageModel(model_config(spec, seq_len=seq_len), seed=seed)
