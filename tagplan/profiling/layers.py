"""Layer profiles: time a model's unique blocks over micro-batch sizes and tp degrees on this device.

What every profile-driven planner collects. Each unique block of a `gpt?...` or `llama?...` SPEC
is built as real torch modules with Megatron's per-device share of a `tp`-way group (heads,
key/value heads, MLP width and vocabulary divided by tp; the all-reduces are not run: the simulator
costs them on the real links), and its forward and backward are timed per micro-batch:
- gpt (the analytic GPT-2 style family): learned positions, pre-LN blocks with SDPA attention and a
  GELU MLP, a LayerNorm head;
- llama: RMSNorm, grouped-query SDPA attention with rotary positions, a SwiGLU MLP, an RMSNorm head.
The record carries the block's structural hash in the analytic model of the same shape, sequence
length and dtype, so the simulator finds it (`cost.calibration.LayerTime`).

Other families' layers come from layer tables (`tagplan traces import`, docs/TRACES.md).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.nn import functional

from tagplan.datasets.traces.bundle import LayerRecord
from tagplan.errors import SpecError
from tagplan.frontends.families import TransformerShape, llama_ffn
from tagplan.frontends.model_spec import load_model
from tagplan.frontends.parametric import parse_shape
from tagplan.ir.workload import DType
from tagplan.profiling.denormals import flushed_denormals

QUICK_MICRO_BATCHES = (1, 2, 4)
QUICK_TPS = (1, 2)
_TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


PROFILED_FAMILIES = ("gpt", "llama")


def profiled_shape(spec: str) -> tuple[str, TransformerShape]:
    """The family and shape of a `gpt?...` or `llama?...` SPEC; SpecError for anything else, and for
    a gpt SPEC whose MLP width, key/value heads or head width differ from GPT's own (the timed GPT
    block has 4 x hidden MLP, full multi-head attention and hidden / heads per head: it would time
    another block than the one its record is keyed to)."""
    family, _, query = spec.partition("?")
    if family not in PROFILED_FAMILIES:
        raise SpecError(f"profile --layers: {spec!r}: only {' and '.join(PROFILED_FAMILIES)}-family SPECs "
                        "(e.g. gpt?layers=..&hidden=..) are built here; import layer tables of other models "
                        "with `tagplan traces import --model SPEC`")
    shape = parse_shape(family, query)
    if family == "gpt":
        own = {"ffn": (shape.ffn, 4 * shape.hidden), "kv_heads": (shape.kv_heads, shape.heads),
               "head_dim": (shape.head_dim, shape.hidden // shape.heads)}
        for key, (value, default) in own.items():
            if value not in (0, default):
                raise SpecError(f"profile --layers: {spec!r}: {key}={value}, but the profiled GPT block has "
                                f"{key}={default}; leave {key} out, or profile a llama?... SPEC")
    return family, shape


def _divides(shape: TransformerShape, family: str, tp: int) -> bool:
    """Whether a tp-way group splits the heads, key/value heads, MLP width and vocabulary evenly."""
    ffn = shape.ffn or (4 * shape.hidden if family == "gpt" else llama_ffn(shape.hidden))
    return not (shape.heads % tp or shape.kvh % tp or shape.vocab % tp or ffn % tp)


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
    def __init__(self, vocab: int, hidden: int, tp: int, *, rms: bool = False) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5) if rms else nn.LayerNorm(hidden)
        self.logits = nn.Linear(hidden, vocab // tp, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.logits(self.norm(x))  # (b, s, vocab/tp)
        return functional.cross_entropy(logits.float().flatten(0, 1), torch.zeros(logits.shape[0] * logits.shape[1],
                                        dtype=torch.long, device=x.device))


class LlamaBlock(nn.Module):
    """One Llama block as one device of a tp-way group holds it (query and key/value heads and the
    SwiGLU width / tp): RMSNorm, GQA attention with rotary positions, RMSNorm, SwiGLU."""

    def __init__(self, shape: TransformerShape, tp: int) -> None:
        super().__init__()
        h, self.head_dim = shape.hidden, shape.dh
        self.heads, self.kv_heads = shape.heads // tp, shape.kvh // tp
        ffn = (shape.ffn or llama_ffn(h)) // tp
        self.input_norm, self.post_attention_norm = nn.RMSNorm(h, eps=1e-5), nn.RMSNorm(h, eps=1e-5)
        self.q = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.gate, self.up, self.down = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False), nn.Linear(
            ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # x: (micro-batch, seq, hidden)
        n = self.input_norm(x)
        q = _rotary(self.q(n).view(b, s, self.heads, self.head_dim).transpose(1, 2))  # (b, heads/tp, s, dh)
        k = _rotary(self.k(n).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2))  # (b, kv_heads/tp, s, dh)
        v = self.v(n).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        m = self.post_attention_norm(x)
        return x + self.down(functional.silu(self.gate(m)) * self.up(m))


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary positions on (b, heads, s, dh): each pair of channels turned by its position's angle."""
    s, dh = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh))
    angle = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)  # (s, dh/2)
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class LlamaEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: int) -> None:
        super().__init__()
        self.vocab = vocab // tp
        self.embed = nn.Embedding(self.vocab, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens % self.vocab)


def time_block(module: nn.Module, make_input: Callable[[], torch.Tensor], *, repeats: int = 5,
               warmup: int = 2) -> tuple[float, float]:
    """(median forward seconds, median backward seconds) of `module` on fresh inputs."""
    forward, backward = [], []
    cuda = next(module.parameters()).is_cuda
    with flushed_denormals("cuda" if cuda else "cpu"):  # as a GPU computes them (profiling.denormals)
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
    """Time every unique block of the gpt or llama `spec` for each (tp, micro-batch) and yield its record.

    `device` is the torch device ("cpu", "cuda"); `device_type` the name records carry (the
    bundle's fingerprint). tp degrees that do not divide the heads, key/value heads, MLP width and
    vocabulary are skipped.
    """
    family, shape = profiled_shape(spec)
    for name, values in (("micro_batches", micro_batches), ("tps", tps)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            flag = "--" + name.replace("_", "-")
            raise SpecError(f"profile --layers: {name} ({flag}) = {list(values)!r}: give one or more whole numbers "
                            ">= 1")
    if not any(_divides(shape, family, tp) for tp in tps):
        ffn = shape.ffn or (4 * shape.hidden if family == "gpt" else llama_ffn(shape.hidden))
        raise SpecError(f"profile --layers: tps (--tps) = {list(tps)!r}: none splits {spec!r} evenly (heads "
                        f"{shape.heads}, key/value heads {shape.kvh}, MLP width {ffn}, vocabulary {shape.vocab}); "
                        "give tp degrees dividing them")
    model = load_model(spec, seq_len=seq_len, dtype=dtype)
    torch_dtype = _TORCH_DTYPES.get(dtype, torch.float32)
    for block in model.blocks:
        for tp in tps:
            if not _divides(shape, family, tp):
                continue
            module = _module(family, block.kind, shape, seq_len, tp).to(device=device, dtype=torch_dtype)
            for mb in micro_batches:
                make = _input(block.kind, mb, seq_len, shape.hidden, shape.vocab, device, torch_dtype)
                fwd, bwd = time_block(module, make, repeats=repeats)
                if progress:
                    progress(f"layer {block.kind} tp {tp} micro-batch {mb}: {fwd * 1e3:.2f} + {bwd * 1e3:.2f} ms")
                yield LayerRecord(block_hash=block.hash, block_name=block.kind, model=spec, device=device_type, tp=tp,
                                  micro_batch=mb, seq_len=seq_len, dtype=dtype, forward_s=fwd, backward_s=bwd,
                                  repeats=repeats, source=f"tagplan.profiling.layers ({device}, torch eager)")


def _module(family: str, kind: str, shape: TransformerShape, seq_len: int, tp: int) -> nn.Module:
    llama = family == "llama"
    if kind == "embedding":
        return LlamaEmbedding(shape.vocab, shape.hidden, tp) if llama else _Embedding(shape.vocab, shape.hidden,
                                                                                         seq_len, tp)
    if kind == "head":
        return _Head(shape.vocab, shape.hidden, tp, rms=llama)
    return LlamaBlock(shape, tp) if llama else _ShardedBlock(shape.hidden, shape.heads, tp)


def _input(kind: str, mb: int, seq_len: int, hidden: int, vocab: int, device: str,
           dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    if kind == "embedding":
        return lambda: torch.randint(0, vocab, (mb, seq_len), device=device)
    return lambda: torch.randn(mb, seq_len, hidden, device=device, dtype=dtype, requires_grad=True)
