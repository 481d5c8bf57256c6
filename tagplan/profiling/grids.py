"""Which ops and message sizes a profile measures: a quick grid and a full one per device.

Shapes follow what LLM training runs: token counts x hidden sizes for the projections (h -> 3h
for QKV, h -> 4h and 4h -> h for the MLP), square GEMMs to trace the efficiency curve, attention
at head dim 64/128, and the memory-bound ops at [tokens, hidden]. The CPU grids are smaller (a
4096^3 fp32 GEMM takes seconds on a few cores); the quick CPU grid keeps a whole
`profile(quick=True)` near a minute on two busy cores. bf16 matmuls on CPU run (through fp32
conversion when the CPU lacks bf16 instructions) at about 1 GFLOP/s, so only small ones are
measured there.
"""

from __future__ import annotations

from typing import Literal

from tagplan.ir.workload import DType
from tagplan.profiling.ops import OpCase

KB = 1024
MB = 1024 * KB


def matmul(m: int, k: int, n: int, dtype: DType = DType.FP32) -> OpCase:
    """[m,k] x [k,n] with a weight on the right."""
    return OpCase("matmul", {"m": m, "k": k, "n": n}, dtype)


def projections(tokens: int, hidden: int, dtype: DType = DType.FP32) -> list[OpCase]:
    """A transformer layer's linear layers at `tokens` tokens: QKV, attention output, MLP up and down."""
    return [matmul(tokens, hidden, 3 * hidden, dtype), matmul(tokens, hidden, hidden, dtype),
            matmul(tokens, hidden, 4 * hidden, dtype), matmul(tokens, 4 * hidden, hidden, dtype)]


def memory_bound(tokens: int, hidden: int, heads: int, seq: int, dtype: DType = DType.FP32) -> list[OpCase]:
    """Norms, activations and the attention softmax of one layer at `tokens` tokens."""
    return [
        OpCase("layernorm", {"rows": tokens, "hidden": hidden}, dtype),
        OpCase("rmsnorm", {"rows": tokens, "hidden": hidden}, dtype),
        OpCase("softmax", {"rows": heads * seq, "cols": seq}, dtype),
        OpCase("gelu", {"rows": tokens, "cols": 4 * hidden}, dtype),
        OpCase("silu", {"rows": tokens, "cols": 4 * hidden}, dtype),
    ]


def attention(b: int, h: int, s: int, d: int, dtype: DType = DType.FP32, *, causal: bool = False) -> OpCase:
    """scaled_dot_product_attention over [b,h,s,d] q, k, v."""
    return OpCase("attention", {"b": b, "h": h, "s": s, "d": d, "causal": int(causal)}, dtype)


def _cpu_quick() -> list[OpCase]:
    return [
        *(matmul(n, n, n) for n in (128, 256, 512, 1024)),
        matmul(512, 1024, 4096), matmul(512, 4096, 1024), matmul(2048, 1024, 3072),
        matmul(256, 256, 256, DType.BF16),
        OpCase("bmm", {"b": 8, "m": 512, "k": 64, "n": 512}),
        attention(1, 8, 512, 64), attention(1, 8, 512, 64, causal=True), attention(1, 8, 1024, 64),
        *memory_bound(512, 1024, 8, 256),
        *memory_bound(2048, 1024, 8, 512),
        OpCase("embedding", {"vocab": 8192, "hidden": 1024, "tokens": 2048}),
        OpCase("adam", {"params": MB}), OpCase("adam", {"params": 4 * MB}),
    ]


def _cpu_full() -> list[OpCase]:
    cases = [matmul(n, n, n) for n in (128, 256, 512, 1024, 2048)]
    for tokens in (256, 1024):
        for hidden in (768, 1024, 2048):
            cases += projections(tokens, hidden)
    cases += [matmul(n, n, n, DType.BF16) for n in (128, 256, 512)]
    cases += [OpCase("bmm", {"b": 12, "m": s, "k": 64, "n": s}) for s in (256, 512, 1024)]
    cases += [attention(1, 12, s, 64, causal=c) for s in (256, 512, 1024) for c in (False, True)]
    cases += [attention(1, 16, 512, 128)]
    cases += memory_bound(512, 1024, 8, 256)
    cases += memory_bound(2048, 1024, 8, 512)
    cases += memory_bound(2048, 2048, 16, 1024)
    cases += [OpCase("embedding", {"vocab": v, "hidden": 1024, "tokens": 2048}) for v in (8192, 32768)]
    cases += [OpCase("adam", {"params": p}) for p in (MB, 16 * MB, 64 * MB)]
    return cases


def _cuda_quick() -> list[OpCase]:
    half = DType.BF16
    return [
        *(matmul(n, n, n, half) for n in (1024, 4096, 8192)),
        matmul(4096, 4096, 4096, DType.FP16), matmul(4096, 4096, 4096),
        *projections(8192, 4096, half),
        OpCase("bmm", {"b": 32, "m": 2048, "k": 128, "n": 2048}, half),
        attention(4, 32, 2048, 128, half), attention(4, 32, 2048, 128, half, causal=True),
        *memory_bound(8192, 4096, 32, 2048, half),
        OpCase("embedding", {"vocab": 32768, "hidden": 4096, "tokens": 8192}, half),
        OpCase("adam", {"params": 64 * MB}),
    ]


def _cuda_full() -> list[OpCase]:
    cases: list[OpCase] = []
    for dtype in (DType.BF16, DType.FP16, DType.FP32):
        cases += [matmul(n, n, n, dtype) for n in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    for tokens in (2048, 8192, 16384):
        for hidden in (2048, 4096, 8192):
            cases += projections(tokens, hidden, DType.BF16)
    cases += [OpCase("bmm", {"b": 32, "m": s, "k": 128, "n": s}, DType.BF16) for s in (1024, 2048, 4096)]
    for s in (1024, 2048, 4096, 8192):
        cases += [attention(max(1, 8192 // s), 32, s, 128, DType.BF16, causal=c) for c in (False, True)]
    cases += [attention(8, 16, 2048, 64, DType.BF16)]
    for tokens, hidden in ((4096, 2048), (8192, 4096), (16384, 8192)):
        cases += memory_bound(tokens, hidden, 32, 2048, DType.BF16)
    cases += [OpCase("embedding", {"vocab": v, "hidden": 4096, "tokens": 8192}, DType.BF16) for v in (32768, 131072)]
    cases += [OpCase("adam", {"params": p}) for p in (16 * MB, 128 * MB, 512 * MB)]
    return cases


def op_grid(device: Literal["cpu", "cuda"], *, quick: bool) -> list[OpCase]:
    """The ops a profile of `device` measures, each once, in grid order."""
    grids = {("cuda", True): _cuda_quick, ("cuda", False): _cuda_full, ("cpu", True): _cpu_quick,
             ("cpu", False): _cpu_full}
    cases = grids[device, quick]()
    unique: dict[tuple[str, tuple[tuple[str, int], ...], DType], OpCase] = {}
    for case in cases:  # a square GEMM can also be a projection shape
        unique.setdefault((case.op, tuple(sorted(case.dims.items())), case.dtype), case)
    return list(unique.values())


def message_sizes(*, quick: bool) -> list[int]:
    """Collective message sizes in bytes: 4 KB to 16 MB by 16x (quick), else 4 KB to 256 MB by 4x."""
    if quick:
        return [4 * KB * 16**i for i in range(4)]
    return [4 * KB * 4**i for i in range(9)]
