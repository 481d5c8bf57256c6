"""Layer profiles: time a model's unique blocks over micro-batch sizes and tp degrees on this device.

What every profile-driven planner collects. Each unique block of a `gpt?...` SPEC (the analytic
GPT-2 style family: learned positions, pre-LN blocks with SDPA attention and a GELU MLP, tied
head) is built as real torch modules with Megatron's per-device share of a `tp`-way group (heads,
MLP width and vocabulary divided by tp; the all-reduces are not run: the simulator costs them on
the real links), and its forward and backward are timed per micro-batch. The record carries the
block's structural hash in the analytic model of the same shape, sequence length and dtype, so
the simulator finds it (`cost.calibration.LayerTime`).

Only the gpt family is built here; layers of other models come from layer tables
(`tagplan traces import`, docs/TRACES.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from urllib.parse import parse_qsl

import torch
from torch import nn
from torch.nn import functional

from tagplan.datasets.traces.bundle import LayerRecord
from tagplan.errors import SpecError
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.parametric import FAMILY_DEFAULTS
from tagplan.ir.workload import DType

QUICK_MICRO_BATCHES = (1, 2, 4)
QUICK_TPS = (1, 2)
_TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def gpt_shape(spec: str) -> dict[str, int]:
    """layers, hidden, heads, vocab of a `gpt?...` SPEC; SpecError for anything else."""
    family, _, query = spec.partition("?")
    if family != "gpt":
        raise SpecError(f"profile --layers: {spec!r}: only gpt-family SPECs (gpt?layers=..&hidden=..) are built "
                        "here; import layer tables of other models with `tagplan traces import --model SPEC`")
    values = {k: int(v) for k, v in parse_qsl(query)} if query else {}
    default = FAMILY_DEFAULTS["gpt"]
    return {"hidden": values.get("hidden", default.hidden), "heads": values.get("heads", default.heads),
            "vocab": values.get("vocab", default.vocab)}

class _ShardedBlock(nn.Module):
    """One pre-LN GPT block as one device of a tp-way group holds it (heads and MLP width / tp)."""

    def __init__(self, hidden: int, heads: int, tp: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads // tp, hidden // heads
        width = self.heads * self.head_dim
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * width), nn.Linear(width, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden // tp), nn.Linear(4 * hidden // tp, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # x: (micro-batch, seq, hidden)
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads/tp, s, head_dim)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.out(functional.gelu(self.fc(self.ln2(x))))


class _Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, seq_len: int, tp: int) -> None:
        super().__init__()
        self.vocab = vocab // tp
        self.embed, self.position = nn.Embedding(self.vocab, hidden), nn.Embedding(seq_len, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens % self.vocab) + self.position(torch.arange(tokens.size(1), device=tokens.device))


class _Head(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: int) -> None:
        super().__init__()
        self.norm, self.logits = nn.LayerNorm(hidden), nn.Linear(hidden, vocab // tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.logits(self.norm(x))  # (b, s, vocab/tp)
        return functional.cross_entropy(logits.float().flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1],
                                        dtype=torch.long, device=x.device))


def time_block(module: nn.Module, make_input: Callable[[], torch.Tensor], *, repeats: int = 5,
               warmup: int = 2) -> tuple[float, float]:
    """(median forward seconds, median backward seconds) of `module` on fresh inputs."""
    forward, backward = [], []
    cuda = next(module.parameters()).is_cuda
    for step in range(warmup + repeats):
        x = make_input()
        _sync(cuda)
        start = time.perf_counter()
        y = module(x)
        _sync(cuda)
        mid = time.perf_counter()
        y.float().sum().backward()
        _sync(cuda)
        end = time.perf_counter()
        if step >= warmup:
            forward.append(mid - start)
            backward.append(end - mid)
    return statistics.median(forward), statistics.median(backward)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def layer_records(spec: str, *, device: str, device_type: str, seq_len: int = 128, dtype: DType = DType.FP32,
                  micro_batches: Sequence[int] = QUICK_MICRO_BATCHES, tps: Sequence[int] = QUICK_TPS,
                  repeats: int = 5, progress: Callable[[str], None] | None = None) -> Iterator[LayerRecord]:
    """Time every unique block of the gpt `spec` for each (tp, micro-batch) and yield its record.

    `device` is the torch device ("cpu", "cuda"); `device_type` the name records carry (the
    bundle's fingerprint). tp degrees that do not divide the heads are skipped.
    """
    shape = gpt_shape(spec)
    model = load_model(spec, seq_len=seq_len, dtype=dtype)
    hidden, heads, vocab = shape["hidden"], shape["heads"], shape["vocab"]
    torch_dtype = _TORCH_DTYPES.get(dtype, torch.float32)
    for block in model.blocks:
        for tp in tps:
            if heads % tp or vocab % tp:
                continue
            module = _module(block.kind, hidden, heads, vocab, seq_len, tp).to(device=device, dtype=torch_dtype)
            for mb in micro_batches:
                make = _input(block.kind, mb, seq_len, hidden, vocab, device, torch_dtype)
                fwd, bwd = time_block(module, make, repeats=repeats)
                if progress:
                    progress(f"layer {block.kind} tp {tp} micro-batch {mb}: {fwd * 1e3:.2f} + {bwd * 1e3:.2f} ms")
                yield LayerRecord(block_hash=block.hash, block_name=block.kind, model=spec, device=device_type, tp=tp,
                                  micro_batch=mb, seq_len=seq_len, dtype=dtype, forward_s=fwd, backward_s=bwd,
                                  repeats=repeats, source=f"tagplan.profiling.layers ({device}, torch eager)")


def _module(kind: str, hidden: int, heads: int, vocab: int, seq_len: int, tp: int) -> nn.Module:
    if kind == "embedding":
        return _Embedding(vocab, hidden, seq_len, tp)
    if kind == "head":
        return _Head(vocab, hidden, tp)
    return _ShardedBlock(hidden, heads, tp)


def _input(kind: str, mb: int, seq_len: int, hidden: int, vocab: int, device: str,
           dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    if kind == "embedding":
        return lambda: torch.randint(0, vocab, (mb, seq_len), device=device)
    return lambda: torch.randn(mb, seq_len, hidden, device=device, dtype=dtype, requires_grad=True)
