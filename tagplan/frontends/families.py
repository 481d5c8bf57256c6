"""Parametric model families derived in closed form: one block per distinct shape, replicated.

A 1T-parameter model builds in milliseconds because each unique block is derived once and
every layer refers to it by structural hash. The shapes follow the published architectures:
GPT (GPT-2/3: learned positions, pre-LN, GELU MLP, tied head), Llama (RMSNorm, SwiGLU, GQA,
rotary positions applied to queries and keys, untied head), BERT (post-LN encoder, pooler, tied
MLM head), T5 (RMSNorm, relu FFN, relative position bias in the first block of each stack, tied
head), MoE (Llama-style with top-k routed SwiGLU experts, as Mixtral), ViT (patch embedding,
class token, pre-LN encoder, classifier).
"""

from __future__ import annotations

from dataclasses import dataclass

from tagplan.frontends.analytic import FUSED_QKV_LAYOUT_PASSES, BlockBuilder
from tagplan.ir.model import Block, Layer, ModelGraph
from tagplan.ir.workload import DType


@dataclass(frozen=True)
class TransformerShape:
    """Shape of a transformer family member; unused fields are ignored by a family."""

    layers: int
    hidden: int
    heads: int
    vocab: int = 50257
    ffn: int = 0  # 0: the family default (4h for GPT/BERT/ViT, Llama's 8h/3 rounded to 256)
    kv_heads: int = 0  # 0: same as heads (no grouped-query attention)
    head_dim: int = 0  # 0: hidden // heads
    max_positions: int = 2048
    tied: bool = True
    experts: int = 8
    top_k: int = 2
    dec_layers: int = 0  # T5 decoder stack; 0: same as layers
    patch: int = 14
    image: int = 224
    classes: int = 1000

    @property
    def dh(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def kvh(self) -> int:
        """Key/value heads."""
        return self.kv_heads or self.heads


def _attention(b: BlockBuilder, x: str, shape: TransformerShape, *, bias: bool, prefix: str = "attn",
               kv_src: str | None = None, rotary: bool = False, fused_qkv: bool = False, causal: bool = False) -> str:
    """Attention's projections, positions, SDPA and output projection; `fused_qkv`: the eager program
    projects queries, keys and values in one GEMM (GPT-2's c_attn), whose kernels count on the query's."""
    h, dh, heads, kvh = shape.hidden, shape.dh, shape.heads, shape.kvh
    q = b.linear(f"{prefix}.q", x, h, heads * dh, bias=bias)
    kv_in = kv_src or x
    k = b.linear(f"{prefix}.k", kv_in, h, kvh * dh, bias=bias, fused=fused_qkv)
    v = b.linear(f"{prefix}.v", kv_in, h, kvh * dh, bias=bias, fused=fused_qkv)
    if rotary:  # the rotated queries and keys are what attention reads (and keeps)
        qk = b.rotary(f"{prefix}.rotary", (q, k), heads + kvh, dh)
        a = b.attention(f"{prefix}.sdpa", (qk, v), heads, kvh, dh, causal=causal)
    else:
        a = b.attention(f"{prefix}.sdpa", (q, k, v), heads, kvh, dh, causal=causal)
    if fused_qkv:  # backward stacks the three gradients and copies them into the fused projection's layout
        layout = FUSED_QKV_LAYOUT_PASSES * b.seq_len * (heads + 2 * kvh) * dh * b.nbytes
        copy = (0.0, float(layout))
        b.ops[-1] = b.ops[-1].model_copy(update={"eager_extra_bytes": copy, "eager_uniform_extra_bytes": copy})
    return b.linear(f"{prefix}.o", a, heads * dh, h, bias=bias)


def _gelu_mlp(b: BlockBuilder, x: str, h: int, ffn: int, *, act: str = "gelu") -> str:
    up = b.linear("mlp.fc1", x, h, ffn, bias=act == "gelu")
    a = b.elementwise(f"mlp.{act}", (up,), ffn, saves_input=True)
    return b.linear("mlp.fc2", a, ffn, h, bias=act == "gelu")


def _swiglu(b: BlockBuilder, x: str, h: int, ffn: int, prefix: str = "mlp", *,
            tokens: int | None = None, experts: int = 0) -> str:
    gate = b.linear(f"{prefix}.gate", x, h, ffn, tokens=tokens, experts=experts)
    up = b.linear(f"{prefix}.up", x, h, ffn, tokens=tokens, experts=experts)
    act = b.elementwise(f"{prefix}.silu", (gate,), ffn, saves_input=True, tokens=tokens)
    prod = b.elementwise(f"{prefix}.mul", (act, up), ffn, saves_input=True, tokens=tokens)
    return b.linear(f"{prefix}.down", prod, ffn, h, tokens=tokens, experts=experts)


def gpt_block(shape: TransformerShape, seq: int, nbytes: int, *, causal: bool = True) -> Block:
    """Pre-LN GPT block: LN, QKV, attention (causal unless `causal` False), proj, residual, LN, GELU MLP, residual."""
    b, h = BlockBuilder("block", seq, nbytes), shape.hidden
    x = "input"
    a = _attention(b, b.norm("ln_1", x, h), shape, bias=True, fused_qkv=True, causal=causal)
    r = b.elementwise("residual_1", (x, a), h, saves_input=False)
    m = _gelu_mlp(b, b.norm("ln_2", r, h), h, shape.ffn or 4 * h)
    b.elementwise("residual_2", (r, m), h, saves_input=False)
    return b.build(h)


def llama_block(shape: TransformerShape, seq: int, nbytes: int, *, moe: bool = False) -> Block:
    """Llama block (RMSNorm, GQA attention, SwiGLU); with `moe`, top-k routed SwiGLU experts."""
    b, h = BlockBuilder("moe_block" if moe else "block", seq, nbytes), shape.hidden
    x = "input"
    a = _attention(b, b.norm("input_norm", x, h, bias=False), shape, bias=False, rotary=True, causal=True)
    r = b.elementwise("residual_1", (x, a), h, saves_input=False)
    n = b.norm("post_attention_norm", r, h, bias=False)
    ffn = shape.ffn or llama_ffn(h)
    if moe:
        b.linear("router", n, h, shape.experts)
        d = b.all_to_all("dispatch", n, h, shape.top_k)
        routed = seq * shape.top_k
        y = _swiglu(b, d, h, ffn, "experts", tokens=routed, experts=shape.experts)
        m = b.all_to_all("combine", y, h, shape.top_k)
        _expert_loop_kernels(b, shape.experts)
    else:
        m = _swiglu(b, n, h, ffn)
    b.elementwise("residual_2", (r, m), h, saves_input=False)
    return b.build(h)


def _expert_loop_kernels(b: BlockBuilder, experts: int) -> None:
    """The eager kernels of an expert bank run as tagplan's torch program runs it (`export.modules.Experts`: one
    expert after another, each on the tokens routed to it). Per expert: its three GEMMs, SwiGLU's activation and
    product (the `experts.*` ops' own counts, once per expert, gate's and up's casts of the gathered fp32 tokens
    among them); routing its tokens (a comparison, `nonzero` and a gather: `dispatch`); and adding its
    weighted output back (a gather of the routing weights, a product, a cast back to fp32 and an `index_add`:
    `combine`), with their backwards. Once per block: the router's softmax, top-k and renormalisation, the
    output buffer, and the three banks' gradients stacked from their experts' (`dispatch`). Counted from the
    module under a dispatch mode (tests/frontends/test_eager_kernels.py); on CUDA each expert's `nonzero` also
    waits for the GPU, which this count does not cost."""
    per_expert = {"dispatch": ((3, 8), (0, 0)), "combine": ((4, 4), (1, 0))}
    once = {"dispatch": (5, 10)}
    for i, op in enumerate(b.ops):
        if op.name in per_expert:
            (fwd, bwd), casts = per_expert[op.name]
            fixed = once.get(op.name, (0, 0))
            b.ops[i] = op.model_copy(update={
                "eager_kernels": (fixed[0] + experts * fwd, fixed[1] + experts * bwd),
                "eager_cast_kernels": (experts * casts[0], experts * casts[1])})
        elif op.name.startswith("experts.") and op.eager_kernels is not None:
            b.ops[i] = op.model_copy(update={
                "eager_kernels": (experts * op.eager_kernels[0], experts * op.eager_kernels[1]),
                "eager_cast_kernels": (experts * op.eager_cast_kernels[0], experts * op.eager_cast_kernels[1])})


def llama_ffn(h: int) -> int:
    ffn = int(2 * 4 * h / 3)
    return 256 * ((ffn + 255) // 256)


def bert_block(shape: TransformerShape, seq: int, nbytes: int) -> Block:
    """Post-LN BERT encoder block."""
    b, h = BlockBuilder("block", seq, nbytes), shape.hidden
    x = "input"
    a = _attention(b, x, shape, bias=True)
    n1 = b.norm("attention_norm", b.elementwise("residual_1", (x, a), h, saves_input=False), h)
    m = _gelu_mlp(b, n1, h, shape.ffn or 4 * h)
    b.norm("output_norm", b.elementwise("residual_2", (n1, m), h, saves_input=False), h)
    return b.build(h)


def t5_block(shape: TransformerShape, seq: int, nbytes: int, *, decoder: bool, first: bool) -> Block:
    """T5 block: RMSNorm, self-attention (+ cross-attention in the decoder), relu FFN."""
    kind = ("decoder" if decoder else "encoder") + ("_first" if first else "")
    b, h = BlockBuilder(kind, seq, nbytes), shape.hidden
    x = "input"
    if first:
        b.add_params("relative_attention_bias", 32 * shape.heads)
    a = _attention(b, b.norm("self_norm", x, h, bias=False), shape, bias=False, prefix="self", causal=decoder)
    x = b.elementwise("residual_self", (x, a), h, saves_input=False)
    if decoder:
        c = _attention(b, b.norm("cross_norm", x, h, bias=False), shape, bias=False, prefix="cross",
                       kv_src="encoder_output")
        x = b.elementwise("residual_cross", (x, c), h, saves_input=False)
    m = _gelu_mlp(b, b.norm("ff_norm", x, h, bias=False), h, shape.ffn or 4 * h, act="relu")
    b.elementwise("residual_ff", (x, m), h, saves_input=False)
    return b.build(h)


def vit_block(shape: TransformerShape, seq: int, nbytes: int) -> Block:
    """ViT encoder block (pre-LN, GELU MLP): the GPT block shape without causal masking."""
    return gpt_block(shape, seq, nbytes, causal=False)


def token_embedding(shape: TransformerShape, seq: int, nbytes: int, *, positions: int = 0,
                    token_types: int = 0, norm: bool = False) -> Block:
    """Token embedding, optionally with learned positions, token types and a LayerNorm."""
    b, h = BlockBuilder("embedding", seq, nbytes), shape.hidden
    x = b.embedding("wte", shape.vocab, h)
    if positions:
        x = b.elementwise("add_positions", (x, b.embedding("wpe", positions, h)), h, saves_input=False)
    if token_types:
        b.add_params("token_type_embeddings", token_types * h, x)
    if norm:
        b.norm("embedding_norm", x, h)
    return b.build(h)


def lm_head(shape: TransformerShape, seq: int, nbytes: int, *, norm_bias: bool | None,
            tied: bool, transform: bool = False) -> Block:
    """Final norm (None: none), optional dense transform, vocabulary projection and loss."""
    b, h = BlockBuilder("head", seq, nbytes), shape.hidden
    x = "input"
    if transform:
        x = b.norm("transform_norm", b.linear("transform", x, h, h, bias=True), h)
    if norm_bias is not None:
        x = b.norm("final_norm", x, h, bias=norm_bias)
    logits = b.linear("lm_head", x, h, shape.vocab)
    if tied:  # the weight is the embedding's: count its bytes there, once
        op = b.ops[-1]
        logits = "lm_head.tied"  # the loss reads the renamed op's logits
        b.ops[-1] = op.model_copy(update={"param_bytes": 0.0, "shared_param_bytes": op.param_bytes, "name": logits})
        b.params -= h * shape.vocab
    b.softmax_loss("cross_entropy", logits, shape.vocab)
    return b.build(1, output_tokens=1)


def assemble(name: str, family: str, seq: int, dtype: DType, layers: list[tuple[str, Block]],
             inputs: dict[int, tuple[int, ...]] | None = None) -> ModelGraph:
    """A ModelGraph over the unique blocks of `layers` (name, block) in order."""
    blocks = {blk.hash: blk for _, blk in layers}
    links = inputs or {}
    return ModelGraph(
        name=name, family=family, seq_len=seq, dtype=dtype, blocks=tuple(blocks.values()),
        layers=tuple(Layer(name=n, block=blk.hash, inputs=links.get(i)) for i, (n, blk) in enumerate(layers)),
    )
