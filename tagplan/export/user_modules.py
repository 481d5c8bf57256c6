"""A user's own language model (`path/to/file.py:factory`, `package.module:factory`) in the torch program.

The program runs the user's module itself, not a look-alike, under one contract:
- the factory's module is an `nn.Sequential` whose children are the planner's layers one for one
  (the traced graph names them `0`, `1`, ...; `check_layers`): a plan stage's `layers=(a, b)` is
  children `a:b`;
- its example input is one tensor of token ids (batch, seq); every child but the last hands the
  next one (batch, seq, hidden) floats of one `hidden`, and the last returns logits
  (batch, seq, vocab): the program trains it with next-token cross-entropy on synthetic tokens;
- children share no parameter (a tied head is not expressed).
The module is built on `meta` and only this rank's children are materialised and initialised
(tagplan's rule: every parameter random from the layer's own generator, 1-D weights around 1).
Buffers a child computes in `__init__` (position tables, masks) would be lost by that, so a
child with buffers takes them from one real (CPU) build of the module.

Each child is wrapped as `ModuleLayer` (`layer.<path>`), so a traced op `3`'s `attn.q.linear`
is module `layer.attn.q` in layer 3: tensor parallelism splits its `nn.Linear`/`nn.Embedding`
modules as the plan says; the user's forward must then work on its rank's share of the heads
(`verify` runs it and says when it does not). `recompute` checkpoints a whole child.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tagplan.errors import SpecError
from tagplan.export.hf_modules import init_parameters
from tagplan.frontends.model_spec import ModelSpec


def _name(spec: ModelSpec) -> str:
    return f"{spec.name}:{spec.attr}"


def instantiate(spec: ModelSpec, *, real: bool = False) -> tuple[nn.Sequential, torch.Tensor]:
    """(the user's nn.Sequential, its example token ids), on `meta` unless `real`. SpecError when
    the module is not an nn.Sequential or its input is not one integer tensor (batch, seq)."""
    from tagplan.frontends.user_module import instantiate as build

    assert spec.attr is not None
    model, inputs = build(spec.name, spec.attr, device="cpu" if real else "meta")
    if not isinstance(model, nn.Sequential):
        raise SpecError(f"model {_name(spec)!r}: the torch program runs a user's module that is an nn.Sequential of "
                        f"its layers (embedding, blocks..., head); {type(model).__name__} is not (see docs/MODELS.md)")
    tokens = inputs[0] if isinstance(inputs, tuple | list) and len(inputs) == 1 else inputs
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise SpecError(f"model {_name(spec)!r}: the torch program feeds token ids: the example input must be one "
                        "integer tensor (batch, seq)")
    return model, tokens


def shapes(spec: ModelSpec, seq_len: int) -> tuple[int, int, int]:
    """(children, hidden, vocab) from running the meta module child by child on (2, seq_len) tokens.
    SpecError naming the child whose output is not (batch, seq, width) with one hidden width."""
    model, tokens = instantiate(spec)
    x = torch.zeros(2, seq_len, dtype=tokens.dtype, device="meta")
    widths = []
    for i, child in enumerate(model):
        x = child(x)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape[:2]) != (2, seq_len):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise SpecError(f"model {_name(spec)!r}: child {i} returns {shape}; the torch program passes one "
                            f"(batch, seq, width) tensor between layers (batch 2, seq {seq_len})")
        widths.append(int(x.shape[2]))
    if len(set(widths[:-1])) > 1:
        raise SpecError(f"model {_name(spec)!r}: the children hand on widths {widths[:-1]}; the pipeline sends one "
                        "hidden width between every pair of layers")
    if len(model) < 2:
        raise SpecError(f"model {_name(spec)!r}: an nn.Sequential of {len(model)} child; the program needs an "
                        "embedding and a head at least")
    return len(model), widths[0], widths[-1]


def check_layers(spec: ModelSpec, layer_names: list[str]) -> None:
    """SpecError unless the traced graph's layers are the Sequential's children one for one."""
    model, _ = instantiate(spec)
    if layer_names != [str(i) for i in range(len(model))]:
        raise SpecError(f"model {_name(spec)!r}: the planner's layers {layer_names[:6]} are not the nn.Sequential's "
                        f"{len(model)} children one for one (a child without parameters or FLOPs joins its neighbour); "
                        "the program runs one child per layer")
    ids = [{id(p) for p in child.parameters()} for child in model]
    for i, a in enumerate(ids):
        for j in range(i + 1, len(ids)):
            if a & ids[j]:
                raise SpecError(f"model {_name(spec)!r}: children {i} and {j} share a parameter (a tied head); the "
                                "program does not express shared parameters between layers of a user's module")


class ModuleLayer(nn.Module):
    """One child of the user's Sequential as a layer of the list; `recompute` checkpoints it."""

    recompute: bool = False

    def __init__(self, child: nn.Module) -> None:
        super().__init__()
        self.layer = child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            out: torch.Tensor = checkpoint(self.layer, x, use_reentrant=False)
            return out
        y: torch.Tensor = self.layer(x)
        return y


@functools.cache
def _real_buffers(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every buffer of one real CPU build of the module, by name (built once, only when needed)."""
    model, _ = instantiate(spec, real=True)
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _materialise(model: nn.Sequential, spec: ModelSpec, index: int, generator: torch.Generator) -> ModuleLayer:
    layer = ModuleLayer(model[index])
    layer.to_empty(device="cpu")
    init_parameters(layer, generator, set())
    buffers = dict(layer.layer.named_buffers())
    if buffers:
        real = _real_buffers(spec)
        with torch.no_grad():
            for name, b in buffers.items():
                b.copy_(real[f"{index}.{name}"])
    return layer


def build_module_layer(spec: ModelSpec, index: int, *, seed: int,
                       generator: Callable[[int, int], torch.Generator]) -> ModuleLayer:
    """Child `index` alone, materialised on the CPU and initialised from `generator(seed, index)`."""
    model, _ = instantiate(spec)
    if not 0 <= index < len(model):
        raise IndexError(f"layer {index} is not in [0, {len(model)})")
    return _materialise(model, spec, index, generator(seed, index))


class ModuleReference(nn.Module):
    """The user's whole module in one process, initialised as the program's layers are; `forward`
    is the module's own. Shapes: tokens (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, spec: ModelSpec, *, seed: int, generator: Callable[[int, int], torch.Generator]) -> None:
        super().__init__()
        model, _ = instantiate(spec)
        self.layers = nn.ModuleList(_materialise(model, spec, j, generator(seed, j)) for j in range(len(model)))
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model(tokens)
        return out

    def layer_grads(self) -> dict[str, torch.Tensor]:
        """Gradient by layer-list parameter name (`layers.{index}.layer.path`)."""
        return {f"layers.{name}": p.grad.detach().clone() for name, p in self.layers.named_parameters()
                if p.grad is not None}


def op_module_path(op: str) -> str:
    """The module inside a layer's wrapper that a traced op name (`attn.q.linear`) belongs to."""
    return f"layer.{op.rsplit('.', 1)[0]}"


def module_config_fields(spec: ModelSpec, seq_len: int) -> dict[str, Any]:
    """The ModelConfig fields of a user's module (family `module`)."""
    children, hidden, vocab = shapes(spec, seq_len)
    return {"family": "module", "layers": children - 2, "hidden": hidden, "heads": 0, "vocab": vocab, "ffn": 0,
            "kv_heads": 0, "head_dim": 0, "max_positions": seq_len, "tied": False, "model_spec": spec.text}
