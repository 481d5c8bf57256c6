"""Closed-form op builders: derive one block's ops from its shapes, without tracing.

Every figure is forward, per sample (one sequence of `s` tokens), in the graph's dtype. FLOPs
count a multiply-add as 2 (as FlopCounterMode and the Megatron papers do); memory-bound ops
count one FLOP per output element (five for norms and softmax). `saved_bytes` follows the
convention of the traced front-end: a matmul saves its activation input, attention saves
q, k, v and its output (flash-style, no s x s matrix), norms their input, nonlinear
elementwise ops their input; a tensor saved by several consumers is counted once.

`Op.eager_kernels` are the kernels eager PyTorch dispatches per op under autocast over fp32 weights,
as tagplan's own torch modules run (`profiling.iterations`, the torch program): a projection casts its
weight (and bias) and, when it reads an fp32 tensor (a norm's output, the residual stream, another block's
output: `EAGER_WIDE_BYTES`, the same rule as its cast's bytes), its input, then multiplies; backward two
GEMMs, the gradient casts and the bias sum. Attention is SDPA and its layout copy; a pointwise op one
kernel forward and one per saved input backward; rotary positions as `profiling.layers._rotary` runs
them (the angle table rebuilt per call, the strided multiplies and the interleave: 18 kernels forward
and 11 backward for each of queries and keys); the loss casts, log-softmax and gathers. Counted with
a dispatch mode over those modules (`tests/frontends/test_eager_kernels.py` recounts them).
`Op.eager_cast_kernels` are autocast's casts among them: an fp32 runtime (the CPU testbed) dispatches the rest.

`Op.eager_extra_bytes` are the bytes those eager kernels move beyond the op's own traffic, per sample, in the
graph's dtype's runtime (autocast over fp32 weights for a 16-bit graph, plain fp32 for an fp32 one). Under
autocast the eager program keeps the residual stream in fp32 (the fp32 embedding's output, and every sum with it)
and each norm's output too (`EAGER_WIDE_BYTES`): a norm reads and writes fp32, a projection reading an fp32 tensor
casts it (and casts its gradient back), a residual sum writes fp32 and casts the gradient of its 16-bit summand.
Beyond dtypes: a tensor read by several ops has its gradient summed (a read of both and a write, per extra
reader); a biased projection's backward sums its output gradient; a pointwise op's backward reads the output
gradient and its saved inputs per input; unfused rotary positions run four strided products, a difference, a sum
and a stack forward (9 passes of the rotated tensors' bytes) and their gradients, slices' scatters and sums
backward (16); GPT's fused QKV projection stacks and copies the three gradients into its layout (4 passes of its
output). The loss's own charge already reads the logits and makes fp32 passes. Counted with a dispatch mode over
the same modules on fake tensors (`tests/frontends/test_eager_bytes.py` recounts them).
`Op.eager_uniform_extra_bytes` are the same bytes for an eager program that holds every tensor in the graph's dtype
(16-bit weights: FSDP's MixedPrecision, DeepSpeed's bf16 and fp16 engines, without autocast or with norms in 16
bits): no casts and no fp32 residual stream, the same formulas with every element at the graph's size (for an fp32
graph the two are equal; for a 16-bit one half the fp32 graph's).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from tagplan.ir.model import HASH_EXCLUDED, Block, Op, OpKind, PartitionDim

_TOKEN_DIMS = (PartitionDim.BATCH, PartitionDim.SEQUENCE)
ROTARY_EAGER_KERNELS = (18, 11)
"""(forward, backward) eager kernels of rotary positions on one tensor (queries or keys) as
`profiling.layers._rotary` runs them: the angle table (two aranges, the frequencies, the outer
product, cos, sin and their casts) and the interleaved rotation (four strided multiplies, a
difference, a sum and the stack); backward the multiplies, a negation, the slices' scatter and sums."""
ROTARY_CAST_KERNELS = 2
"""Of `ROTARY_EAGER_KERNELS`' forward, autocast's casts of the cos and sin tables (per tensor)."""
ROTARY_EAGER_PASSES = (9, 16)
"""(forward, backward) passes over the rotated tensors' bytes that `profiling.layers._rotary` makes: four strided
products (each reads and writes half), a difference and a sum (each reads two halves, writes one) and the stack
(reads both halves, writes the whole); backward the products' gradients, two sums, the slices' scatters (a zeroed
whole and a half written) and their sum, a negation and the flattened view's copy."""
EAGER_WIDE_BYTES = 4
"""Bytes of an element the eager program keeps in fp32 whatever it computes in: the residual stream (the fp32
embedding's output and every sum with it) and each norm's output (autocast runs norms in fp32)."""
FUSED_QKV_LAYOUT_PASSES = 4
"""Backward passes over a fused QKV projection's output bytes: its three gradients stacked, then copied into the
projection's layout (each a read and a write)."""


@dataclass
class BlockBuilder:
    """Accumulates ops of one block; `build` freezes them into a `Block` with a structural hash."""

    kind: str
    seq_len: int
    nbytes: int
    ops: list[Op] = field(default_factory=list)
    params: int = 0
    _saved: set[str] = field(default_factory=set)
    _wide: set[str] = field(default_factory=lambda: {"input"})
    _readers: dict[str, int] = field(default_factory=dict)

    def _add(self, op: Op, params: int = 0) -> str:
        self.ops.append(op)
        self.params += params
        return op.name

    def _save_once(self, key: str, nbytes: float) -> float:
        if key in self._saved:
            return 0.0
        self._saved.add(key)
        return nbytes

    def _eager_size(self, src: str, wide: int = EAGER_WIDE_BYTES) -> int:
        """Bytes of an element of `src` as the eager program holds it: `wide` for the residual stream and norm
        outputs, and for what comes from outside the block (another block's output is one of those, an encoder's
        its final norm's), else the graph's. `wide` is `EAGER_WIDE_BYTES` under autocast over fp32 weights, the
        graph's own size for a program in one dtype (`_uniform`)."""
        if src in self._wide or not any(op.name == src for op in self.ops):
            return wide
        return self.nbytes

    def _read_before(self, src: str) -> bool:
        """Records a reader of `src`; True when an earlier op read it too, so that this reader's gradient is added to
        the earlier one's in the backward (`_fan_in_bytes`)."""
        seen = self._readers.get(src, 0)
        self._readers[src] = seen + 1
        return seen > 0

    def _fan_in_bytes(self, src: str, elems: float, summed: bool, wide: int = EAGER_WIDE_BYTES) -> float:
        """Backward bytes of adding a reader's gradient of `src` (`elems` elements) to an earlier reader's: both
        read, the sum written; 0 for its first reader (`summed` False, from `_read_before`)."""
        return 3.0 * elems * self._eager_size(src, wide) if summed else 0.0

    @property
    def _uniform(self) -> int:
        """The element size of every tensor in an eager program held in the graph's dtype (16-bit weights)."""
        return self.nbytes

    def linear(self, name: str, src: str, d_in: int, d_out: int, *, bias: bool = False,
               tokens: int | None = None, experts: int = 0, fused: bool = False) -> str:
        """A dense projection of `tokens` (default `seq_len`) rows from `d_in` to `d_out`.

        With `experts` = E > 0 it is a bank of E expert projections over the routed tokens:
        the FLOPs are those of `tokens` rows, the parameters those of all E experts.
        `fused`: the eager program computes it in the previous projection's GEMM (no kernels of its own).
        """
        # autocast's casts: forward the weight's, the bias's and an fp32 input's; backward those the eager count
        # holds beyond the two GEMMs and the bias's sum (the H200 traces' per-block totals, not one per cast)
        casts = (1 + int(bias) + int(self._eager_size(src) == EAGER_WIDE_BYTES), 2 + int(bias))
        eager_kernels = (1 + casts[0], 2 + int(bias) + casts[1])  # the GEMM; two GEMMs and the bias's sum
        if fused:
            casts = eager_kernels = (0, 0)
        t = self.seq_len if tokens is None else tokens
        summed = not fused and self._read_before(src)

        def extra(wide: int) -> tuple[float, float]:
            """Autocast's cast of an fp32 input and its gradient's cast back; a second reader's gradient sum."""
            if fused:
                return 0.0, 0.0
            size = self._eager_size(src, wide)
            cast = (size + self.nbytes) * t * d_in if size != self.nbytes else 0.0
            return cast, cast + self._fan_in_bytes(src, t * d_in, summed, wide)
        params = (d_in * d_out + (d_out if bias else 0)) * max(experts, 1)
        dims = (*_TOKEN_DIMS, PartitionDim.HIDDEN_OUT, PartitionDim.HIDDEN_IN)
        return self._add(Op(
            name=name, kind=OpKind.MATMUL, flops=2.0 * t * d_in * d_out,
            bytes_read=(t * d_in + params) * self.nbytes, bytes_written=t * d_out * self.nbytes,
            param_bytes=params * self.nbytes, saved_bytes=self._save_once(src, t * d_in * self.nbytes),
            output_shape=(1, t, d_out), partition_dims=(*dims, PartitionDim.EXPERTS) if experts else dims,
            inputs=(src,) if src else (), eager_kernels=eager_kernels, eager_cast_kernels=casts,
            eager_extra_bytes=extra(EAGER_WIDE_BYTES), eager_uniform_extra_bytes=extra(self._uniform),
            eager_bias_bytes=float(self.nbytes * t * d_out) if bias else 0.0,
        ), params)

    def attention(self, name: str, srcs: tuple[str, ...], heads: int, kv_heads: int, head_dim: int,
                  *, kv_len: int | None = None, causal: bool = False) -> str:
        """Scaled dot-product attention: QK^T and AV, each 2 * s * s_kv * heads * head_dim FLOPs, every query
        against every key (`causal`: under a causal mask, which a fused kernel's cost discounts)."""
        s, skv = self.seq_len, self.seq_len if kv_len is None else kv_len
        q_bytes = s * heads * head_dim * self.nbytes
        kv_bytes = 2 * skv * kv_heads * head_dim * self.nbytes
        flops = 4.0 * s * skv * heads * head_dim + 5.0 * s * skv * heads  # matmuls + softmax
        saved = sum(self._save_once(src, 0.0) for src in srcs) + q_bytes + kv_bytes + q_bytes
        self._saved.add(name)  # its output is saved here: the output projection must not count it again
        return self._add(Op(
            name=name, kind=OpKind.ATTENTION, flops=flops, bytes_read=q_bytes + kv_bytes,
            bytes_written=q_bytes, saved_bytes=saved, output_shape=(1, s, heads * head_dim),
            score_elements=float(s * skv * heads),
            partition_dims=(*_TOKEN_DIMS, PartitionDim.HEADS), inputs=srcs, eager_kernels=(2, 2), causal=causal,
        ))

    def rotary(self, name: str, srcs: tuple[str, ...], heads: int, head_dim: int) -> str:
        """Rotary position embedding of `heads` query and key heads: x * cos + rotate_half(x) * sin, reading
        each element and the position's cos and sin tables and writing the rotated copy (3 FLOPs an element).
        Its backward needs only the tables, so it keeps no activation of its own; attention keeps the rotated
        queries and keys. It splits by heads, as attention does."""
        s = self.seq_len
        elems = s * heads * head_dim
        own, rotated = (2 * elems + 2 * s * head_dim) * self.nbytes, elems * self.nbytes
        extra = (ROTARY_EAGER_PASSES[0] * rotated - own, ROTARY_EAGER_PASSES[1] * rotated - 2 * own)
        return self._add(Op(
            name=name, kind=OpKind.ELEMENTWISE, flops=3.0 * elems, eager_extra_bytes=extra,
            eager_uniform_extra_bytes=extra,
            bytes_read=(elems + 2 * s * head_dim) * self.nbytes, bytes_written=elems * self.nbytes,
            output_shape=(1, s, heads * head_dim), partition_dims=(*_TOKEN_DIMS, PartitionDim.HEADS), inputs=srcs,
            eager_kernels=(ROTARY_EAGER_KERNELS[0] * len(srcs), ROTARY_EAGER_KERNELS[1] * len(srcs)),
            eager_cast_kernels=(ROTARY_CAST_KERNELS * len(srcs), 0),
        ))

    def norm(self, name: str, src: str, width: int, *, bias: bool = True) -> str:
        """LayerNorm (bias=True) or RMSNorm (bias=False) over `width` features."""
        elems = self.seq_len * width
        params = width * (2 if bias else 1)
        own, summed = 2.0 * elems * self.nbytes, self._read_before(src)

        def extra(wide: int) -> tuple[float, float]:
            """Eager reads its input and writes `wide`; backward reads the gradient and the input, writes the
            input's; autocast runs norms in fp32, so a 16-bit input is cast up first and its gradient cast back."""
            size = self._eager_size(src, wide)
            cast = (size + wide) * elems if size != wide else 0.0
            return (cast + 2 * wide * elems - own,
                    cast + 3 * wide * elems - 2 * own + self._fan_in_bytes(src, elems, summed, wide))

        autocast, uniform = extra(EAGER_WIDE_BYTES), extra(self._uniform)
        self._wide.add(name)
        return self._add(Op(
            eager_extra_bytes=autocast, eager_uniform_extra_bytes=uniform,
            name=name, kind=OpKind.LAYERNORM, flops=5.0 * elems,
            bytes_read=elems * self.nbytes + params * self.nbytes, bytes_written=elems * self.nbytes,
            param_bytes=params * self.nbytes, saved_bytes=self._save_once(src, elems * self.nbytes),
            output_shape=(1, self.seq_len, width), partition_dims=_TOKEN_DIMS, inputs=(src,), eager_kernels=(1, 1),
        ), params)

    def elementwise(self, name: str, srcs: tuple[str, ...], width: int, *, saves_input: bool,
                    tokens: int | None = None) -> str:
        """A pointwise op over `tokens x width` elements reading each of `srcs` once."""
        t = self.seq_len if tokens is None else tokens
        elems = t * width
        saved = sum(self._save_once(src, elems * self.nbytes) for src in srcs) if saves_input else 0.0
        own = (len(srcs) + 1) * elems * self.nbytes
        summed = [self._read_before(src) for src in srcs]

        def extra(wide: int) -> tuple[float, float]:
            sizes = [self._eager_size(src, wide) for src in srcs]
            out = max(sizes)  # type promotion: a sum with the fp32 residual stream is fp32
            if saves_input:  # each input's gradient reads the output's gradient and the saved inputs, writes its own
                backward = float(sum(out + sum(sizes) + (size if len(srcs) == 1 else 0) for size in sizes) * elems)
            else:  # a sum passes its gradient on, cast for a narrower summand
                backward = float(sum(out + size for size in sizes if size != out) * elems)
            backward += sum(self._fan_in_bytes(src, elems, s, wide) for src, s in zip(srcs, summed, strict=True))
            return (sum(sizes) + out) * elems - own, backward - 2 * own

        autocast, uniform = extra(EAGER_WIDE_BYTES), extra(self._uniform)
        if max(self._eager_size(src) for src in srcs) == EAGER_WIDE_BYTES:
            self._wide.add(name)
        return self._add(Op(
            eager_extra_bytes=autocast, eager_uniform_extra_bytes=uniform,
            name=name, kind=OpKind.ELEMENTWISE, flops=float(elems),
            bytes_read=len(srcs) * elems * self.nbytes, bytes_written=elems * self.nbytes,
            saved_bytes=saved, output_shape=(1, t, width),
            partition_dims=(*_TOKEN_DIMS, PartitionDim.HIDDEN_OUT), inputs=srcs,
            eager_kernels=(1, len(srcs) if saves_input else 1),
        ))

    def embedding(self, name: str, rows: int, width: int, *, tokens: int | None = None,
                  owns_params: bool = True) -> str:
        """A table lookup of `tokens` rows from a `rows x width` table."""
        t = self.seq_len if tokens is None else tokens
        params = rows * width if owns_params else 0
        self._wide.add(name)  # eager looks its rows up in the fp32 table: they read and write fp32
        return self._add(Op(
            eager_extra_bytes=(2.0 * (EAGER_WIDE_BYTES - self.nbytes) * t * width, 0.0),
            eager_uniform_extra_bytes=(0.0, 0.0),
            name=name, kind=OpKind.EMBEDDING, flops=0.0,
            bytes_read=t * width * self.nbytes + t * 8, bytes_written=t * width * self.nbytes,
            param_bytes=params * self.nbytes, saved_bytes=t * 8.0, output_shape=(1, t, width),
            partition_dims=(*_TOKEN_DIMS, PartitionDim.HIDDEN_OUT), eager_kernels=(1, 1),
        ), params)

    def softmax_loss(self, name: str, src: str, classes: int, *, tokens: int | None = None) -> str:
        """Softmax cross-entropy over `classes` logits per token, computed in fp32 as frameworks do.

        PyTorch and Megatron upcast the logits and make several passes (max, exp, sum, log,
        gather): we charge one read of the logits plus three fp32 passes, and the fp32 softmax
        kept for the backward (which is the largest activation of a big-vocabulary model).
        """
        t = self.seq_len if tokens is None else tokens
        elems = t * classes
        return self._add(Op(
            name=name, kind=OpKind.SOFTMAX, flops=5.0 * elems, bytes_read=elems * (self.nbytes + 2 * 4.0),
            bytes_written=elems * 4.0 + t * 4.0, saved_bytes=elems * 4.0, output_shape=(1, t),
            partition_dims=(*_TOKEN_DIMS, PartitionDim.HIDDEN_OUT), inputs=(src,), eager_kernels=(3, 3),
            eager_cast_kernels=(1, 1),
        ))

    def all_to_all(self, name: str, src: str, width: int, top_k: int) -> str:
        """Expert dispatch or combine: each token's activation goes to `top_k` experts. Eager, the routed copies
        keep their source's dtype (the fp32 norm output's, for the experts to cast), and a source read twice has
        its gradients summed."""
        volume = self.seq_len * width * top_k * self.nbytes
        if self._eager_size(src) == EAGER_WIDE_BYTES:
            self._wide.add(name)
        elems, summed = self.seq_len * width, self._read_before(src)
        return self._add(Op(
            eager_extra_bytes=(0.0, self._fan_in_bytes(src, elems, summed)),
            eager_uniform_extra_bytes=(0.0, self._fan_in_bytes(src, elems, summed, self._uniform)),
            name=name, kind=OpKind.ALL_TO_ALL, flops=0.0, bytes_read=volume, bytes_written=volume,
            output_shape=(1, self.seq_len * top_k, width),
            partition_dims=(*_TOKEN_DIMS, PartitionDim.EXPERTS), inputs=(src,),
        ))

    def add_params(self, name: str, count: int, src: str = "") -> str:
        """Parameters used outside a modelled matmul (tables, class tokens, extra experts).

        The op costs no FLOPs; it reads its weights once per micro-batch, charged here per sample.
        """
        return self._add(Op(
            name=name, kind=OpKind.OTHER, flops=0.0, bytes_read=count * self.nbytes,
            bytes_written=0.0, param_bytes=count * self.nbytes, output_shape=(count,),
            inputs=(src,) if src else (),
        ), count)

    def build(self, output_width: int, *, output_tokens: int | None = None) -> Block:
        """Freeze into a Block whose hash covers every op field, so equal shapes hash equal."""
        t = self.seq_len if output_tokens is None else output_tokens
        digest = hashlib.sha256(f"{self.kind}|{output_width}|{t}".encode())
        for op in self.ops:
            digest.update(op.model_dump_json(exclude=set(HASH_EXCLUDED)).encode())
        return Block(
            hash=digest.hexdigest()[:16], kind=self.kind, ops=tuple(self.ops), params=self.params,
            output_bytes=float(t * output_width * self.nbytes),
        )
