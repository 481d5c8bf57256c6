"""Torch modules of the model families the exporter runs, built from a model SPEC, layer by layer.

The layer list matches `ModelGraph.layers` of the same SPEC one for one (embedding, blocks...,
head), so a plan stage's `layers=(a, b)` is the slice `a:b`, and every module attribute that
holds a matmul or embedding is named after the op the analytic family gives it (`attn.q`,
`mlp.fc1`, `wte`, ...; a moe block's router and experts sit in its `mlp`: `tp_ops`): a stage's per-op
`sharding` finds its module by the op's name. The
shape comes from the SPEC through `tagplan.export.shapes.model_config` (zoo names,
`family?key=value`, `hf:LlamaConfig?...` and `hf:GPT2Config?...`).

- gpt (GPT-2/3): learned positions, pre-LN blocks with separate q/k/v projections, GELU MLP,
  final LayerNorm, head tied to the token embedding (op `lm_head.tied`).
- llama: RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP, untied head.
- moe (Mixtral): llama blocks whose MLP is a bank of SwiGLU experts (`experts.gate`, `experts.up`,
  `experts.down`), each token sent by the `router` to its `top_k` experts and their outputs summed with
  the router's softmax renormalised over the chosen ones; under tensor parallelism each expert's FFN is
  split over the group or every rank runs whole experts (`export.tp_flow.experts_flow`).

Parameter counts equal the analytic graph's exactly (tests pin it). Every layer initializes
itself from its own generator, seeded by `(seed, layer index)`, so a program that builds only
its pipeline stage's layers holds the same numbers as a single process that builds them all.
All parameters are random (biases and norm gains included): a bias added twice shows up.
Hugging Face SPECs (family `hf`) run as the transformers class itself and a user's own
`nn.Sequential` (family `module`) as itself: `build_layer`, `op_paths`, `set_stage_recompute` and
`tied_param_names` hand them to `tagplan.export.hf_modules` and `tagplan.export.user_modules`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional

from tagplan.export import hf_modules, user_modules
from tagplan.export.shapes import ModelConfig, model_config
from tagplan.export.tp_flow import EXPERT_OPS
from tagplan.frontends.model_spec import ModelSpec, parse_model_spec

INIT_STD = 0.02


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

    Head counts and the sequence length are read from the projections' outputs at run time, so a
    tensor-parallel rank holding `heads / tp` query heads and `kv_heads / tp` key/value heads runs
    unchanged, and so does one whose projections read a part of the sequence and hand back every token.

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
        q, k, v = self.q(x), self.k(x), self.v(x)  # (b, s, width): a token-split projection hands back all tokens
        b, s, _ = q.shape
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, heads, s, dh)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_heads, s, dh)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_heads, s, dh)
        if self.rotary:
            q, k = rotate(q), rotate(k)
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.size(1) != k.size(1))
        return self.o(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, hidden)


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, half-split form) of x (batch, heads, seq, dh)."""
    dh, seq = x.size(-1), x.size(-2)
    inv = base ** (-torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh)  # (dh / 2)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)  # (seq, dh / 2)
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


class _GatedProduct(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for the backward (which recomputes silu), as
    Megatron-Core's fused SwiGLU does: the memory model's `Workload.fused_activation`."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return functional.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors  # silu's own backward kernel, as unfused autograd runs it
        return torch.ops.aten.silu_backward(grad * up, gate), grad * functional.silu(gate)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020), the activation and product fused (`_GatedProduct`).
    Shapes: (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(c.hidden, c.ffn, bias=False)
        self.up = nn.Linear(c.hidden, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_GatedProduct.apply(self.gate(x), self.up(x)))


class Experts(nn.Module):
    """A bank of SwiGLU experts, each token run by the `top_k` experts the router's logits choose (Mixtral).

    Weights `gate` and `up` (experts, ffn, hidden) and `down` (experts, hidden, ffn), the analytic ops
    `experts.gate`, `experts.up` and `experts.down`; the activation and product fused as `SwiGLU`'s. The chosen
    experts' outputs are summed weighted by the router's softmax renormalised over them; no token is dropped
    (no capacity limit), so a token's output does not depend on the other tokens of its batch. Under tensor
    parallelism the weights are DTensors split along the FFN (`runtime_parallel.ExpertsParallel`) and each
    rank computes with its own piece: its output is then a partial sum over the FFN.
    Shapes: x (..., hidden), logits (..., experts) -> (..., hidden).
    """

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.top_k = c.top_k
        self.gate = nn.Parameter(torch.empty(c.experts, c.ffn, c.hidden))
        self.up = nn.Parameter(torch.empty(c.experts, c.ffn, c.hidden))
        self.down = nn.Parameter(torch.empty(c.experts, c.hidden, c.ffn))

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        # each bank split into its experts once: indexing the bank per expert would give each expert's backward
        # a zero-filled gradient of the whole bank to add up (experts x the bank's bytes per micro-batch)
        gate, up, down = (local(p).unbind(0) for p in (self.gate, self.up, self.down))
        tokens, scores = x.flatten(0, -2), logits.flatten(0, -2)
        weights, chosen = functional.softmax(scores, dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(len(gate)):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                routed = tokens[rows]
                hidden = _GatedProduct.apply(functional.linear(routed, gate[e]), functional.linear(routed, up[e]))
                routed_out = functional.linear(hidden, down[e]) * weights[rows, slot, None]
                out = out.index_add(0, rows, routed_out.to(out.dtype))  # autocast computes in 16 bits
        return out.view_as(x)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` (a DTensor's local tensor, sharing its storage: e.g. a weight split over a
    tensor-parallel group), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


class MoE(nn.Module):
    """A block's mixture of experts: the `router`'s logits choose each token's experts in `experts`.
    Shapes: (batch, seq, hidden) -> (batch, seq, hidden)."""

    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        self.experts = Experts(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


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
        self.mlp: nn.Module = MoE(c) if c.family == "moe" else GeluMLP(c) if gpt else SwiGLU(c)

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
    attention = {name: name for name in ("attn.q", "attn.k", "attn.v", "attn.o")}
    if config.family == "moe":  # the router, and one module holding the three expert weights
        return {**attention, "router": "mlp.router", **dict.fromkeys(EXPERT_OPS, "mlp.experts")}
    mlp = ("mlp.fc1", "mlp.fc2") if config.family == "gpt" else ("mlp.gate", "mlp.up", "mlp.down")
    return {**attention, **{name: name for name in mlp}}


def op_paths(config: ModelConfig, index: int, ops: Iterable[str]) -> dict[str, str]:
    """Op name -> module path inside layer `index` for the `ops` a stage's strategies name: the
    analytic names of `tp_ops` for gpt and llama, the traced op's own module for family `hf`."""
    if config.family == "hf":
        return {op: hf_modules.op_module_path(op, index, config.num_layers) for op in ops}
    if config.family == "module":
        return {op: user_modules.op_module_path(op) for op in ops}
    return tp_ops(config, index)


def tied_param_names(config: ModelConfig) -> tuple[str, str] | None:
    """(embedding table, tied head weight) as parameter names of a stage (`layers.{index}.path`);
    None when the head is not tied."""
    if not config.tied:
        return None
    if config.family == "hf":
        return hf_modules.tied_names(hf_config_object(config), config.model_type)
    return "layers.0.wte.weight", f"layers.{config.num_layers - 1}.lm_head.weight"


def set_recompute(layer: nn.Module, on: bool) -> bool:
    """Checkpoint a transformer block's forward (embedding and head are kept); whether `layer` is such a block."""
    if isinstance(layer, Block | hf_modules.HFBlock | user_modules.ModuleLayer):
        layer.recompute = on
        return True
    return False


def set_stage_recompute(layers: Iterable[nn.Module], recompute: bool, count: int | None) -> None:
    """Checkpoint a stage's blocks where it recomputes (`recompute`): all of them, or its first `count`
    (`Stage.recompute_layers`), in layer order."""
    left = count
    for layer in layers:
        on = recompute and (left is None or left > 0)
        if set_recompute(layer, on) and on and left is not None:
            left -= 1


def hf_config_object(config: ModelConfig) -> Any:
    """The transformers config of a family `hf` ModelConfig."""
    return _hf_config(config.hf_spec)


@functools.cache
def _hf_config(spec: str) -> Any:
    return hf_modules.hf_config_of(parse_model_spec(spec))[0]


def build_layer(config: ModelConfig, index: int, *, seed: int) -> nn.Module:
    """Layer `index` of the layer list (0: embedding, last: head), initialized from its own generator.

    A tied head gets its own copy of the embedding table, initialized identically: the caller
    either shares it (`build_model`) or keeps the copies equal by summing their gradients.
    Family `hf`: the transformers class's own modules (`hf_modules.build_hf_layer`).
    """
    if not 0 <= index < config.num_layers:
        raise IndexError(f"layer {index} is not in [0, {config.num_layers})")
    if config.family == "hf":
        return hf_modules.build_hf_layer(hf_config_object(config), config.model_type, index, seed=seed,
                                         generator=layer_generator)
    if config.family == "module":
        return user_modules.build_module_layer(parse_model_spec(config.model_spec), index, seed=seed,
                                               generator=layer_generator)
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


Reference = LanguageModel | hf_modules.HFReference | user_modules.ModuleReference
"""A whole model in one process (tokens -> logits), parameters initialised as the program's layers."""


def build_model(spec: str | ModelSpec, *, seq_len: int, seed: int = 0) -> Reference:
    """The whole model `spec` names, as one module, at `seq_len` tokens (family `hf`: the transformers
    class itself, `hf_modules.HFReference`; a user's module: `user_modules.ModuleReference`)."""
    config = model_config(spec, seq_len=seq_len)
    if config.family == "hf":
        return hf_modules.HFReference(hf_config_object(config), config.model_type, seed=seed,
                                      generator=layer_generator)
    if config.family == "module":
        return user_modules.ModuleReference(parse_model_spec(config.model_spec), seed=seed, generator=layer_generator)
    return LanguageModel(config, seed=seed)


def grads_by_layer(model: Reference) -> dict[str, torch.Tensor]:
    """Gradient by layer-list parameter name (`layers.{index}.path`) after a backward."""
    if isinstance(model, hf_modules.HFReference | user_modules.ModuleReference):
        return model.layer_grads()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
