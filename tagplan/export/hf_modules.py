"""Hugging Face causal LMs run as the transformers class itself, cut into the planner's layer list.

For an `hf:NAME?key=value` SPEC (or a `config.json`) the exported program builds the model class transformers builds
for that config (`AutoModelForCausalLM.from_config`, e.g. `LlamaForCausalLM`) on the `meta`
device, then materialises only the layers of this rank's stages. Layer `j` of the list is what
the traced graph calls layer `j` (`frontends.hf_auto`): 0 the embedding, 1..L the model's own
decoder layers, L + 1 the final norm and `lm_head`. Each entry is a thin wrapper that calls the
class's own modules the way its base model's `forward` does:

- `decoder` layout (`model.embed_tokens`, `model.layers`, `model.rotary_emb`, `model.norm`,
  `lm_head`; model types in `DECODER_TYPES`): a block computes its position ids, the rotary
  embedding and the causal mask (`transformers.masking_utils.create_causal_mask`, as the base
  model does) and calls the decoder layer;
- `gpt2` layout (`transformer.wte`, `transformer.wpe`, `transformer.drop`, `transformer.h`,
  `transformer.ln_f`, `lm_head`): the embedding adds learned positions; blocks get the mask.

Wrappers keep the class's module paths: the embedding and head mount their modules under their
absolute paths (`model.embed_tokens`, `lm_head`), a block holds its decoder layer as `layer`, so
a traced op `self_attn.q_proj.linear` of layer 3 is module `layer.self_attn.q_proj`
(`op_module_path`): the plan's per-op tensor-parallel strategies find their `nn.Linear`.

Initialisation is tagplan's (every parameter random from the layer's own generator, 1-D weights
around 1 as norm gains), so a program that builds only its stages holds the same numbers as the
single-process reference `reference_model` (the whole class, its own `forward`). A tied head gets
its own copy of the embedding table initialised alike; the program keeps the copies equal.

Only model types whose base `forward` is exactly the sequence above are accepted
(`DECODER_TYPES`, `GPT2_TYPES`); `verify` checks each against the class's own `forward`. GPT-2's
`Conv1D` is not an `nn.Linear`, so its matmuls run whole (tp = 1); Qwen3's per-head q/k norms share
one weight across heads, so it runs at tp = 1 too (`HEAD_NORM_TYPES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tagplan.errors import SpecError
from tagplan.export.hf_types import GPT2_TYPES
from tagplan.frontends.model_spec import ModelSpec, ModelSpecKind

DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types laid out as `model.{embed_tokens, layers, rotary_emb, norm}` + `lm_head` whose base
forward is embed -> (rotary, causal mask) -> layers -> norm (checked by `verify`)."""
INIT_STD = 0.02


def layout_of(model_type: str) -> str:
    """`decoder` or `gpt2`; SpecError naming the accepted model types otherwise."""
    if model_type in DECODER_TYPES:
        return "decoder"
    if model_type in GPT2_TYPES:
        return "gpt2"
    raise SpecError(f"Hugging Face model type {model_type!r}: the torch exporter runs the transformers class for "
                    f"model types {', '.join((*DECODER_TYPES, *GPT2_TYPES))} (and Megatron's exporter only "
                    "hf:LlamaConfig and hf:GPT2Config); describe another model as a tagplan family (gpt?..., "
                    "llama?..., moe?...) to export it")


def make_hf_config(name: str, overrides: dict[str, str]) -> tuple[Any, str]:
    """(config, model type) of an `hf:` name with its overrides: sdpa attention, no cache."""
    from tagplan.frontends.hf_config import make_config, resolve_hf_name

    arch = resolve_hf_name(name)
    config = make_config(arch.config_class, overrides)
    config._attn_implementation = "sdpa"
    return config, arch.model_type


def hf_config_of(spec: ModelSpec) -> tuple[Any, str, str]:
    """(config, model type, config class) of an `hf:` SPEC or a config.json SPEC."""
    from tagplan.frontends.hf_config import read_hf_config, resolve_hf_name

    if spec.kind is ModelSpecKind.HF_FILE:
        config, arch = read_hf_config(spec.name)
        config._attn_implementation = "sdpa"
        return config, arch.model_type, arch.config_class
    config, model_type = make_hf_config(spec.name, dict(spec.overrides))
    return config, model_type, resolve_hf_name(spec.name).config_class


def skeleton(config: Any) -> nn.Module:
    """The whole transformers model on `meta` (no memory), in training mode."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model.train()


def depth(config: Any, model_type: str) -> int:
    """The number of decoder layers."""
    return int(config.n_layer if layout_of(model_type) == "gpt2" else config.num_hidden_layers)


def _mount(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under the dotted `path` inside `root` (empty containers in between)."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


def _tensor(out: Any) -> torch.Tensor:
    """A decoder layer's hidden states (older transformers return a tuple)."""
    return out[0] if isinstance(out, tuple) else out


class HFEmbedding(nn.Module):
    """Layer 0: the token embedding (plus GPT-2's learned positions and dropout).

    Shapes: tokens (batch, seq) int64 -> (batch, seq, hidden).
    """

    def __init__(self, model: nn.Module, layout: str) -> None:
        super().__init__()
        self.layout = layout
        paths = ("transformer.wte", "transformer.wpe", "transformer.drop") if layout == "gpt2" else (
            "model.embed_tokens",)
        for path in paths:
            _mount(self, path, model.get_submodule(path))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.layout == "gpt2":
            wte, wpe, drop = (self.get_submodule(f"transformer.{name}") for name in ("wte", "wpe", "drop"))
            positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
            x: torch.Tensor = drop(wte(tokens) + wpe(positions))
            return x
        out: torch.Tensor = self.get_submodule("model.embed_tokens")(tokens)
        return out


class HFBlock(nn.Module):
    """Layer i + 1: the class's decoder layer i, called as its base model calls it.

    With `recompute` set the layer keeps only its input and runs again in the backward pass.
    Shapes: x (batch, seq, hidden) -> (batch, seq, hidden).
    """

    recompute: bool = False

    config: Any
    rotary: nn.Module | None

    def __init__(self, model: nn.Module, layout: str, index: int, rotary: nn.Module | None) -> None:
        super().__init__()
        self.layout, self.config = layout, model.config  # a transformers PreTrainedConfig (typed Any here)
        stack = "transformer.h" if layout == "gpt2" else "model.layers"
        self.layer = model.get_submodule(f"{stack}.{index}")
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self._forward, x, use_reentrant=False)
            return out
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        if self.layout == "gpt2":
            return _tensor(self.layer(x, None, mask, position_ids=positions))
        assert self.rotary is not None
        rotary = self.rotary(x, positions)
        return _tensor(self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary))


class HFHead(nn.Module):
    """Layer L + 1: the final norm and `lm_head`. Shapes: (batch, seq, hidden) -> (batch, seq, vocab)."""

    def __init__(self, model: nn.Module, layout: str) -> None:
        super().__init__()
        self.norm_path = "transformer.ln_f" if layout == "gpt2" else "model.norm"
        for path in (self.norm_path, "lm_head"):
            _mount(self, path, model.get_submodule(path))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.get_submodule("lm_head")(self.get_submodule(self.norm_path)(x))
        return out


def _rotary(model: nn.Module, config: Any, layout: str) -> nn.Module | None:
    """A real (not meta) copy of the base model's rotary embedding, buffers computed; None for gpt2."""
    if layout == "gpt2":
        return None
    meta = model.get_submodule("model.rotary_emb")
    return type(meta)(config=config)


def wrap_layer(model: nn.Module, config: Any, model_type: str, index: int) -> nn.Module:
    """Entry `index` of the layer list as a wrapper over `model`'s own modules (module docstring)."""
    layout, n = layout_of(model_type), depth(config, model_type)
    if not 0 <= index < n + 2:
        raise IndexError(f"layer {index} is not in [0, {n + 2})")
    if index == 0:
        return HFEmbedding(model, layout)
    if index == n + 1:
        return HFHead(model, layout)
    return HFBlock(model, layout, index - 1, _rotary(model, config, layout))


def init_parameters(module: nn.Module, generator: torch.Generator, skip: set[int]) -> None:
    """Every parameter (not in `skip`, by id) random in registration order: 1-D weights N(1, 0.02)
    (norm gains), the rest N(0, 0.02)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in skip:
                continue
            gain = p.dim() == 1 and name.rsplit(".", 1)[-1] == "weight"
            p.normal_(1.0 if gain else 0.0, INIT_STD, generator=generator)


def tied_names(config: Any, model_type: str) -> tuple[str, str] | None:
    """(embedding table, head weight) as layer-list parameter names when the head is tied, else None."""
    if not getattr(config, "tie_word_embeddings", False):
        return None
    table = "transformer.wte" if layout_of(model_type) == "gpt2" else "model.embed_tokens"
    return f"layers.0.{table}.weight", f"layers.{depth(config, model_type) + 1}.lm_head.weight"


_SKELETONS: dict[int, tuple[Any, nn.Module, set[int]]] = {}
"""id(config) -> (config, its meta skeleton, the layer indices taken from it); configs are unhashable."""


def _skeleton_for(config: Any, index: int) -> nn.Module:
    """One meta skeleton per config for the layers a process builds (their modules are disjoint, so
    each materialises its own part): building a 32-layer model's stage builds the whole class once,
    not once per layer. A layer asked for again gets a fresh skeleton (its modules are taken)."""
    held = _SKELETONS.get(id(config))
    if held is None or held[0] is not config or index in held[2]:
        held = _SKELETONS[id(config)] = (config, skeleton(config), set())
    held[2].add(index)
    return held[1]


def build_hf_layer(config: Any, model_type: str, index: int, *, seed: int,
                   generator: Callable[[int, int], torch.Generator]) -> nn.Module:
    """Layer `index` alone, materialised on the CPU and initialised from `generator(seed, index)`.

    A tied head gets its own table, drawn as the embedding's first draw (`generator(seed, 0)`).
    """
    model = _skeleton_for(config, index)
    n = depth(config, model_type)
    tied = tied_names(config, model_type) is not None and index == n + 1
    if tied:
        head = model.get_submodule("lm_head")
        assert isinstance(head.weight, torch.Tensor)
        head.weight = nn.Parameter(torch.empty_like(head.weight))
    layer = wrap_layer(model, config, model_type, index)
    layer.to_empty(device="cpu")
    if isinstance(layer, HFBlock) and layer.rotary is not None:
        layer.rotary = _rotary(model, config, layout_of(model_type))  # its buffers, computed again
    init_parameters(layer, generator(seed, index), set())
    if tied:
        with torch.no_grad():
            weight = layer.get_submodule("lm_head").weight
            assert isinstance(weight, torch.Tensor)
            weight.normal_(0.0, INIT_STD, generator=generator(seed, 0))
    return layer


class HFReference(nn.Module):
    """The whole transformers model in one process, initialised as the program's layers are;
    `forward` is the class's own. Parameters are renamed to layer-list names by `layer_names`.

    Shapes: tokens (batch, seq) int64 -> logits (batch, seq, vocab).
    """

    def __init__(self, config: Any, model_type: str, *, seed: int,
                 generator: Callable[[int, int], torch.Generator]) -> None:
        super().__init__()
        self.model = skeleton(config).to_empty(device="cpu")  # meta -> cpu makes new parameters: unties
        layout = layout_of(model_type)
        tied = tied_names(config, model_type)
        if tied is not None:
            table = self.model.get_submodule(tied[0].removeprefix("layers.0.").removesuffix(".weight"))
            self.model.get_submodule("lm_head").weight = table.weight
        if layout == "decoder":
            self.model.get_submodule("model").add_module("rotary_emb", _rotary(self.model, config, layout))
        self.n = depth(config, model_type)
        wrappers = [wrap_layer(self.model, config, model_type, j) for j in range(self.n + 2)]
        seen: set[int] = set()
        for j, wrapper in enumerate(wrappers):
            init_parameters(wrapper, generator(seed, j), seen)
            seen |= {id(p) for p in wrapper.parameters()}
        self.names: dict[int, str] = {}
        for j, wrapper in enumerate(wrappers):  # a tied table keeps the embedding's name
            for name, p in wrapper.named_parameters():
                self.names.setdefault(id(p), f"layers.{j}.{name}")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits
        return logits

    def layer_grads(self) -> dict[str, torch.Tensor]:
        """Gradient by layer-list parameter name (a tied table under the embedding's name)."""
        out: dict[str, torch.Tensor] = {}
        for p in self.model.parameters():
            if p.grad is not None and id(p) in self.names:
                out.setdefault(self.names[id(p)], p.grad.detach().clone())
        return out


def op_module_path(op: str, index: int, num_layers: int) -> str:
    """The module inside layer `index`'s wrapper that a traced op name belongs to: the op's module
    path (its name without the trailing aten op), under `layer.` for a block."""
    module = op.rsplit(".", 1)[0]
    return module if index in (0, num_layers - 1) else f"layer.{module}"
