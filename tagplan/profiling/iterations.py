"""Measure real training iterations on this machine: the iteration records a retrained GNN learns from.

Each case builds a GPT (GPT-2 style: learned positions, pre-LN blocks with SDPA attention and a GELU
MLP, tied head) as real torch modules, and times full training iterations of a one-stage plan
on this host's CPU or one GPU: `micro_batches` forward/backward passes with gradient accumulation
(with `torch.utils.checkpoint` per block when the plan recomputes), then an Adam step, exactly what
the simulator costs for that plan. In bf16 the model keeps fp32 weights and Adam states and runs its
forward and backward under `torch.autocast` (mixed precision, as the simulator's bf16 workload
assumes). The record names the model by the analytic `gpt?...` SPEC of the same shape and the
cluster as one node of the measured device (`cpu_device_spec()` or the GPU's catalog spec), so that
`tagplan` can rebuild both; on a GPU it also carries the peak allocated memory.

Only one-device plans are measured: a CPU offers no second device whose split of the cores would
be a fair stand-in for a GPU, and a one-GPU host none at all. Multi-device records come from users'
clusters (`tagplan traces import`).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from tagplan.datasets.traces.bundle import IterationRecord
from tagplan.errors import SpecError
from tagplan.frontends.cpu import cpu_cluster, gpu_cluster
from tagplan.frontends.families import TransformerShape
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, Optimizer, Workload
from tagplan.profiling.denormals import flushed_denormals
from tagplan.profiling.layers import LlamaBlock, LlamaEmbedding

MAX_POSITIONS = 2048
"""Learned positions, as the analytic gpt family has them."""


@dataclass(frozen=True)
class IterationCase:
    """One measured configuration: model shape, batch and the one-stage plan's options."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    global_batch: int
    micro_batches: int
    recompute: bool = False
    family: Literal["gpt", "llama"] = "gpt"
    kv_heads: int = 0
    """llama: key/value heads (grouped-query attention)."""
    ffn: int = 0
    """llama: SwiGLU width."""

    @property
    def label(self) -> str:
        """The case in a line: SPEC, tokens, batch, micro-batches, recompute."""
        return (f"{self.spec} seq {self.seq_len} batch {self.global_batch} x{self.micro_batches}"
                f"{' recompute' if self.recompute else ''}")

    @property
    def spec(self) -> str:
        """The analytic model SPEC of the same shape."""
        if self.family == "llama":
            return (f"llama?layers={self.layers}&hidden={self.hidden}&heads={self.heads}&kv_heads={self.kv_heads}"
                    f"&ffn={self.ffn}&vocab={self.vocab}")
        return f"gpt?layers={self.layers}&hidden={self.hidden}&heads={self.heads}&vocab={self.vocab}"


QUICK_CASES = tuple(
    IterationCase(layers, hidden, hidden // 64, 2048, seq, batch, micro, recompute)
    for layers, hidden, seq, batch, micro, recompute in (
        (2, 128, 64, 8, 1, False), (2, 128, 64, 8, 2, False), (2, 128, 64, 8, 2, True),
        (4, 256, 128, 8, 1, False), (4, 256, 128, 8, 4, False), (4, 256, 128, 8, 4, True),
        (2, 256, 256, 4, 1, False), (6, 192, 64, 16, 2, False), (6, 192, 64, 16, 4, True),
        (3, 384, 128, 4, 2, False), (3, 384, 128, 4, 2, True), (8, 128, 128, 8, 1, False),
    )
)
"""Small shapes that time in about a minute on two cores, spanning compute-, memory- and overhead-bound."""

CUDA_VOCAB = 50304
"""GPT-2's vocabulary padded to a multiple of 128, as Megatron pads it."""

CUDA_CASES = tuple(
    IterationCase(layers, hidden, hidden // 64 if hidden < 2048 else hidden // 128, CUDA_VOCAB, seq, batch, micro,
                  recompute)
    for layers, hidden, seq, batch, micro, recompute in (
        # GPT-2 small: overhead- and memory-bound
        (12, 768, 1024, 8, 1, False), (12, 768, 1024, 16, 1, False), (12, 768, 1024, 32, 1, False),
        (12, 768, 1024, 32, 4, False), (12, 768, 1024, 32, 8, False), (12, 768, 1024, 32, 4, True),
        (12, 768, 2048, 8, 1, False), (12, 768, 2048, 16, 4, True),
        # GPT-2 medium
        (24, 1024, 1024, 8, 1, False), (24, 1024, 1024, 16, 2, False), (24, 1024, 1024, 32, 4, False),
        (24, 1024, 1024, 32, 4, True), (24, 1024, 2048, 16, 8, False),
        # GPT-2 large / 1.3B: compute-bound
        (36, 1280, 1024, 16, 2, False), (36, 1280, 1024, 16, 2, True),
        (24, 2048, 2048, 8, 1, False), (24, 2048, 2048, 8, 2, False), (24, 2048, 2048, 16, 4, False),
        (24, 2048, 2048, 16, 4, True), (24, 2048, 2048, 16, 16, False), (24, 2048, 1024, 32, 4, False),
        # 2.7B and wide-shallow
        (32, 2560, 2048, 8, 2, False), (32, 2560, 2048, 8, 2, True), (32, 2560, 2048, 16, 8, False),
        (4, 4096, 2048, 16, 2, False), (4, 4096, 4096, 8, 2, False), (8, 4096, 2048, 8, 8, True),
        # deep-narrow and few tokens: launch-bound
        (48, 512, 512, 8, 1, False), (48, 512, 512, 8, 8, False), (24, 1024, 256, 4, 4, False),
    )
)
"""One-GPU cases (a few minutes on an H100/H200): GPT-2 small to 2.7B shapes and extremes, bf16."""

CUDA_LLAMA_CASES = tuple(
    IterationCase(layers, hidden, heads, vocab, seq, batch, micro, recompute, "llama", kv_heads, ffn)
    for layers, hidden, heads, kv_heads, ffn, vocab, seq, batch, micro, recompute in (
        # Llama-3-8B blocks, 8 of them
        (8, 4096, 32, 8, 14336, 128256, 4096, 4, 1, False), (8, 4096, 32, 8, 14336, 128256, 4096, 4, 4, False),
        (8, 4096, 32, 8, 14336, 128256, 4096, 4, 4, True), (8, 4096, 32, 8, 14336, 128256, 8192, 2, 2, False),
        # Llama-3.2-1B and -3B shapes
        (16, 2048, 32, 8, 8192, 128256, 2048, 8, 1, False), (16, 2048, 32, 8, 8192, 128256, 2048, 8, 2, False),
        (16, 2048, 32, 8, 8192, 128256, 2048, 8, 8, False), (16, 2048, 32, 8, 8192, 128256, 2048, 8, 2, True),
        (28, 3072, 24, 8, 8192, 128256, 2048, 8, 2, False), (28, 3072, 24, 8, 8192, 128256, 2048, 8, 2, True),
        # small: host-bound
        (12, 768, 12, 4, 2048, 32000, 1024, 16, 1, False), (12, 768, 12, 4, 2048, 32000, 1024, 16, 4, False),
        (12, 768, 12, 4, 2048, 32000, 1024, 16, 16, False), (12, 768, 12, 4, 2048, 32000, 1024, 16, 4, True),
    )
)
"""One-GPU Llama cases (GQA, rotary, SwiGLU, untied head), bf16: a family the GPT cases' fit never sees."""


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.out(functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-2 style language model of the given shape (tied head)."""

    def __init__(self, case: IterationCase) -> None:
        super().__init__()
        self.recompute = case.recompute
        self.embed = nn.Embedding(case.vocab, case.hidden)
        self.position = nn.Embedding(max(case.seq_len, MAX_POSITIONS), case.hidden)
        self.blocks = nn.ModuleList(_Block(case.hidden, case.heads) for _ in range(case.layers))
        self.norm = nn.LayerNorm(case.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and self.training else block(x)
        logits = self.norm(x) @ self.embed.weight.t()
        return functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


class TinyLlama(nn.Module):
    """A Llama language model of the given shape (RMSNorm, GQA with rotary positions, SwiGLU, untied head)."""

    def __init__(self, case: IterationCase) -> None:
        super().__init__()
        shape = TransformerShape(layers=case.layers, hidden=case.hidden, heads=case.heads, kv_heads=case.kv_heads,
                                 ffn=case.ffn, vocab=case.vocab)
        self.recompute = case.recompute
        self.embed = LlamaEmbedding(case.vocab, case.hidden, tp=1)
        self.blocks = nn.ModuleList(LlamaBlock(shape, tp=1) for _ in range(case.layers))
        self.norm = nn.RMSNorm(case.hidden, eps=1e-5)
        self.head = nn.Linear(case.hidden, case.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and self.training else block(x)
        logits = self.head(self.norm(x))
        return functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def training_step(case: IterationCase, *, device: str = "cpu", dtype: DType = DType.FP32) -> Callable[[], None]:
    """One training iteration of `case` on `device` as a callable (the model, Adam and a fixed batch built
    once, weights where they live): `micro_batches` forward/backward passes under autocast in bf16/fp16
    (fp32 weights and Adam states), then the optimizer step, the device drained at the end."""
    autocast = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16}.get(dtype)
    if dtype != DType.FP32 and autocast is None:
        raise SpecError(f"dtype {dtype.value!r}: real iterations run in fp32, bf16 or fp16")
    cuda = device.startswith("cuda")
    torch.manual_seed(0)
    with torch.device(device):  # weights initialised where they live (a 2.7B model is slow to init on a CPU)
        model = (TinyLlama(case) if case.family == "llama" else TinyGPT(case)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    per_micro = case.global_batch // case.micro_batches
    tokens = torch.randint(0, case.vocab, (case.micro_batches, per_micro, case.seq_len), device=device)

    def step() -> None:
        for m in range(case.micro_batches):
            with torch.autocast(device_type=torch.device(device).type, dtype=autocast or torch.float32,
                                enabled=autocast is not None):
                loss = model(tokens[m]) / case.micro_batches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    return step


@dataclass(frozen=True)
class IterationTiming:
    """A case's measured iteration: median seconds of the timed steps and, on a GPU, the peak bytes
    the caching allocator handed out and the peak it reserved from the device (allocated plus its
    cache and fragmentation: what runs out first)."""

    median_s: float
    steps: int
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None


def measure_iteration(case: IterationCase, *, steps: int = 5, warmup: int = 2, device: str = "cpu",
                        dtype: DType = DType.FP32) -> IterationTiming:
    """Time `case` on `device` ("cpu" or "cuda"), in fp32 or mixed precision (`dtype` bf16/fp16)."""
    cuda = device.startswith("cuda")
    step = training_step(case, device=device, dtype=dtype)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    with flushed_denormals(device):  # a CPU's subnormal assists are not the step's cost (profiling.denormals)
        for i in range(warmup + steps):
            start = time.perf_counter()
            step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    allocated = int(torch.cuda.max_memory_allocated()) if cuda else None
    reserved = int(torch.cuda.max_memory_reserved()) if cuda else None
    del step
    if cuda:
        torch.cuda.empty_cache()
    return IterationTiming(statistics.median(times), steps, allocated, reserved)


def out_of_memory_note(cases: Sequence[IterationCase]) -> str:
    """The manifest-notes suffix naming the cases a device had no memory for ("" for none)."""
    return "".join(f"; out of memory: {c.label}" for c in cases)


def case_workload_plan(case: IterationCase, dtype: DType) -> tuple[Workload, Plan]:
    """What the simulator costs for `case`: the eager Adam workload and the one-stage plan over its
    embedding, blocks and head (layers 0 .. layers + 2) on device 0."""
    workload = Workload(global_batch=case.global_batch, seq_len=case.seq_len, dtype=dtype, optimizer=Optimizer.ADAM,
                        eager=True)
    plan = Plan(stages=(Stage(layers=(0, case.layers + 2), devices=(0,), recompute=case.recompute),),
                micro_batches=case.micro_batches)
    return workload, plan


def iteration_records(spec: DeviceSpec, cases: Sequence[IterationCase] = QUICK_CASES, *, steps: int = 5,
                      device: str = "cpu", dtype: DType = DType.FP32,
                      progress: Callable[[str], None] | None = None,
                      out_of_memory: list[IterationCase] | None = None) -> Iterator[IterationRecord]:
    """Measure each case on `device` (described by `spec`) and yield its record (model SPEC, inline
    cluster, workload, plan, seconds; peak memory on a GPU). A case the device has no memory for is
    skipped, said through `progress` and appended to `out_of_memory` (a smaller GPU than the one the
    cases were sized on runs the rest); without that list the error propagates."""
    cuda = device.startswith("cuda")
    cluster = gpu_cluster(spec) if cuda else cpu_cluster(spec)
    where = f"{spec.name}, one GPU" if cuda else "one process"
    for case in cases:
        try:
            timing = measure_iteration(case, steps=steps, device=device, dtype=dtype)
        except torch.OutOfMemoryError:
            if out_of_memory is None:
                raise
            gc.collect()  # the failed step's tensors, held by the traceback until here
            if cuda:
                torch.cuda.empty_cache()
            out_of_memory.append(case)
            if progress:
                progress(f"iteration {case.label}: out of memory, skipped")
            continue
        workload, plan = case_workload_plan(case, dtype)
        if progress:
            allocated, reserved = timing.peak_allocated_bytes, timing.peak_reserved_bytes
            memory = "" if allocated is None or reserved is None else \
                f", peak {allocated / 2**30:.1f} GiB ({reserved / 2**30:.1f} reserved)"
            progress(f"iteration {case.label}: {timing.median_s * 1e3:.1f} ms{memory}")
        yield IterationRecord(model=case.spec, cluster=cluster, workload=workload,
                              plan=plan.model_dump(mode="json"), measured_s=timing.median_s, repeats=timing.steps,
                              peak_memory_bytes=timing.peak_allocated_bytes,
                              peak_reserved_bytes=timing.peak_reserved_bytes,
                              source=f"tagplan.profiling.iterations ({dtype.value}, torch eager, {where})")
