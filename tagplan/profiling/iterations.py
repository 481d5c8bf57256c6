"""Measure real training iterations on this machine: the iteration records a retrained GNN learns from.

Each case builds a GPT (GPT-2 style: learned positions, pre-LN blocks with SDPA attention and a GELU
MLP, tied head) as real torch modules, and times full training iterations of a one-stage plan
on this host's CPU: `micro_batches` forward/backward passes with gradient accumulation (with
`torch.utils.checkpoint` per block when the plan recomputes), then an Adam step, exactly what the
simulator costs for that plan. The record names the model by the analytic `gpt?...` SPEC of the
same shape and the cluster as one node of `cpu_device_spec()`, so that `tagplan` can rebuild both.

Only one-device plans are measured: a CPU offers no second device whose split of the cores would
be a fair stand-in for a GPU. Multi-device records come from users' clusters (`tagplan traces import`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from tagplan.datasets.traces.bundle import IterationRecord
from tagplan.frontends.cpu import cpu_cluster
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, Optimizer, Workload

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

    @property
    def spec(self) -> str:
        """The analytic model SPEC of the same shape."""
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
        x = self.embed(tokens) + self.position(torch.arange(tokens.size(1)))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute and self.training else block(x)
        logits = self.norm(x) @ self.embed.weight.t()
        return functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def measure_iteration_s(case: IterationCase, *, steps: int = 5, warmup: int = 2) -> tuple[float, int]:
    """(median seconds per training iteration, steps timed) of `case` on this CPU, fp32."""
    torch.manual_seed(0)
    model = TinyGPT(case).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    per_micro = case.global_batch // case.micro_batches
    tokens = torch.randint(0, case.vocab, (case.micro_batches, per_micro, case.seq_len))
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        for m in range(case.micro_batches):
            (model(tokens[m]) / case.micro_batches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), steps


def iteration_records(spec: DeviceSpec, cases: Sequence[IterationCase] = QUICK_CASES, *, steps: int = 5,
                      progress: Callable[[str], None] | None = None) -> Iterator[IterationRecord]:
    """Measure each case and yield its record (model SPEC, inline cluster, workload, plan, seconds)."""
    cluster = cpu_cluster(spec)
    for case in cases:
        seconds, timed = measure_iteration_s(case, steps=steps)
        workload = Workload(global_batch=case.global_batch, seq_len=case.seq_len, dtype=DType.FP32,
                            optimizer=Optimizer.ADAM)
        plan = Plan(stages=(Stage(layers=(0, case.layers + 2), devices=(0,), recompute=case.recompute),),
                    micro_batches=case.micro_batches)
        if progress:
            progress(f"iteration {case.spec} batch {case.global_batch} x{case.micro_batches}"
                     f"{' recompute' if case.recompute else ''}: {seconds * 1e3:.1f} ms")
        yield IterationRecord(model=case.spec, cluster=cluster, workload=workload,
                              plan=plan.model_dump(mode="json"), measured_s=seconds, repeats=timed,
                              source="tagplan.profiling.iterations (fp32, torch eager, one process)")
