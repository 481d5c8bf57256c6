"""Whole models of the parametric families, and the `family?key=value&...` spec grammar.

`gpt?layers=96&hidden=12288&heads=96&vocab=50257` builds GPT-3 175B; keys not given take the
family's defaults (see `FAMILY_DEFAULTS`). A key the family's builder does not read (`FAMILY_KEYS`),
or a key given twice, is refused. Every builder derives each distinct block once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields, replace
from urllib.parse import parse_qsl

from tagplan.errors import SpecError, unknown
from tagplan.frontends.analytic import BlockBuilder
from tagplan.frontends.families import (
    TransformerShape,
    assemble,
    bert_block,
    gpt_block,
    llama_block,
    lm_head,
    t5_block,
    token_embedding,
    vit_block,
)
from tagplan.ir.model import Block, ModelGraph
from tagplan.ir.workload import DType


def build_gpt(name: str, shape: TransformerShape, seq: int, dtype: DType) -> ModelGraph:
    """GPT-2/3: learned positions, pre-LN blocks, final LayerNorm, head tied to the embedding."""
    n = dtype.nbytes
    emb = token_embedding(shape, seq, n, positions=shape.max_positions)
    blk = gpt_block(shape, seq, n)
    head = lm_head(shape, seq, n, norm_bias=True, tied=shape.tied)
    layers = [("embed", emb), *[(f"h.{i}", blk) for i in range(shape.layers)], ("head", head)]
    return assemble(name, "gpt", seq, dtype, layers)


def build_llama(name: str, shape: TransformerShape, seq: int, dtype: DType, *, moe: bool = False) -> ModelGraph:
    """Llama (or Mixtral-style MoE with `moe`): RMSNorm, GQA, SwiGLU, untied head by default."""
    n = dtype.nbytes
    emb = token_embedding(shape, seq, n)
    blk = llama_block(shape, seq, n, moe=moe)
    head = lm_head(shape, seq, n, norm_bias=False, tied=shape.tied)
    layers = [("embed", emb), *[(f"layers.{i}", blk) for i in range(shape.layers)], ("head", head)]
    return assemble(name, "moe" if moe else "llama", seq, dtype, layers)


def build_bert(name: str, shape: TransformerShape, seq: int, dtype: DType) -> ModelGraph:
    """BERT for pre-training: embeddings (+positions, token types, LN), post-LN blocks, MLM head."""
    n = dtype.nbytes
    emb = token_embedding(shape, seq, n, positions=shape.max_positions, token_types=2, norm=True)
    blk = bert_block(shape, seq, n)
    pb = BlockBuilder("head", seq, n)
    pb.linear("pooler", "input", shape.hidden, shape.hidden, bias=True, tokens=1)
    pb.add_params("mlm_bias", shape.vocab)
    head = lm_head(shape, seq, n, norm_bias=None, tied=shape.tied, transform=True)
    head = _merge("head", [head, pb.build(shape.hidden)])
    layers = [("embed", emb), *[(f"layer.{i}", blk) for i in range(shape.layers)], ("head", head)]
    return assemble(name, "bert", seq, dtype, layers)


def build_t5(name: str, shape: TransformerShape, seq: int, dtype: DType) -> ModelGraph:
    """T5 encoder-decoder; decoder blocks read the encoder output (layer inputs say so)."""
    n, enc_n, dec_n = dtype.nbytes, shape.layers, shape.dec_layers or shape.layers
    emb = token_embedding(shape, seq, n)
    enc0, enc = t5_block(shape, seq, n, decoder=False, first=True), t5_block(shape, seq, n, decoder=False, first=False)
    fb = BlockBuilder("encoder_final", seq, n)
    fb.norm("encoder_final_norm", "input", shape.hidden, bias=False)
    fb.embedding("decoder_embed", shape.vocab, shape.hidden, owns_params=False)
    fb.ops[-1] = fb.ops[-1].model_copy(update={"shared_param_bytes": shape.vocab * shape.hidden * n})
    dec0, dec = t5_block(shape, seq, n, decoder=True, first=True), t5_block(shape, seq, n, decoder=True, first=False)
    head = lm_head(shape, seq, n, norm_bias=False, tied=shape.tied)
    layers = [("shared_embed", emb), *[(f"encoder.block.{i}", enc0 if i == 0 else enc) for i in range(enc_n)],
              ("encoder.final", fb.build(shape.hidden)),
              *[(f"decoder.block.{i}", dec0 if i == 0 else dec) for i in range(dec_n)], ("head", head)]
    enc_out = enc_n + 1  # the encoder.final layer carries the encoder output forward
    links: dict[int, tuple[int, ...]] = {enc_out + 1 + i: (enc_out + i, enc_out) for i in range(1, dec_n)}
    return assemble(name, "t5", seq, dtype, layers, links)


def build_vit(name: str, shape: TransformerShape, seq: int, dtype: DType) -> ModelGraph:
    """ViT: conv patch embedding + class token + positions, pre-LN blocks, LN + classifier."""
    n, h = dtype.nbytes, shape.hidden
    patches = (shape.image // shape.patch) ** 2
    tokens = patches + 1
    pb = BlockBuilder("embedding", tokens, n)
    x = pb.linear("patch_embed", "pixels", 3 * shape.patch**2, h, bias=True, tokens=patches)
    pb.add_params("cls_token", h, x)
    pb.add_params("position_embeddings", tokens * h, x)
    blk = vit_block(shape, tokens, n)
    hb = BlockBuilder("head", tokens, n)
    y = hb.norm("final_norm", "input", h)
    hb.softmax_loss("cross_entropy", hb.linear("classifier", y, h, shape.classes, bias=True, tokens=1),
                    shape.classes, tokens=1)
    layers = [("embed", pb.build(h)), *[(f"layer.{i}", blk) for i in range(shape.layers)],
              ("head", hb.build(1, output_tokens=1))]
    return assemble(name, "vit", tokens, dtype, layers)


def _merge(kind: str, blocks: list[Block]) -> Block:
    b = BlockBuilder(kind, 1, 1)
    for blk in blocks:
        b.ops.extend(blk.ops)
        b.params += blk.params
    out = b.build(1)
    return out.model_copy(update={"output_bytes": blocks[-1].output_bytes})


Builder = Callable[[str, TransformerShape, int, DType], ModelGraph]

FAMILIES: dict[str, Builder] = {
    "gpt": build_gpt,
    "llama": build_llama,
    "bert": build_bert,
    "t5": build_t5,
    "moe": lambda name, shape, seq, dtype: build_llama(name, shape, seq, dtype, moe=True),
    "vit": build_vit,
}

FAMILY_DEFAULTS: dict[str, TransformerShape] = {
    "gpt": TransformerShape(layers=12, hidden=768, heads=12, vocab=50257, max_positions=2048),
    "llama": TransformerShape(layers=32, hidden=4096, heads=32, vocab=32000, tied=False),
    "bert": TransformerShape(layers=24, hidden=1024, heads=16, vocab=30522, max_positions=512),
    "t5": TransformerShape(layers=24, hidden=1024, heads=32, head_dim=128, ffn=16384, vocab=32128),
    "moe": TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                            tied=False, experts=8, top_k=2),
    "vit": TransformerShape(layers=32, hidden=1280, heads=16, vocab=0, patch=14, image=224),
}

# The spec keys each family's builder reads (each key sets the TransformerShape field of its name);
# a key the builder ignores would build a model other than the one asked for, so it is refused.
_ATTENTION_KEYS = ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn")
FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "gpt": (*_ATTENTION_KEYS, "vocab", "tied", "max_positions"),
    "llama": (*_ATTENTION_KEYS, "vocab", "tied"),
    "bert": (*_ATTENTION_KEYS, "vocab", "tied", "max_positions"),
    "t5": (*_ATTENTION_KEYS, "dec_layers", "vocab", "tied"),
    "moe": (*_ATTENTION_KEYS, "vocab", "tied", "experts", "top_k"),
    "vit": (*_ATTENTION_KEYS, "patch", "image", "classes"),
}
_ALL_KEYS = tuple(f.name for f in fields(TransformerShape))
_POSITIVE = {"layers", "hidden", "heads", "vocab", "experts", "top_k", "patch", "image", "classes",
             "max_positions", "dec_layers"}
_ZERO_MEANS = {"ffn": "the family's default width", "kv_heads": "as many as heads", "head_dim": "hidden // heads"}


def parse_shape(family: str, query: str) -> TransformerShape:
    """The family's default shape updated by `key=value&...`; SpecError naming the key and value for a
    key the family does not read, a key given twice, a bad value or an inconsistent shape."""
    updates: dict[str, int | bool] = {}
    for key, raw in parse_qsl(query, keep_blank_values=True):
        _check_key(family, key)
        if key in updates:
            raise SpecError(f"{family}: key {key!r} is given twice; give each key once")
        updates[key] = _coerce(key, raw)
    shape = replace(FAMILY_DEFAULTS[family], **updates)  # type: ignore[arg-type]
    _check_shape(family, shape, set(updates))
    return shape


def _check_key(family: str, key: str) -> None:
    accepted = FAMILY_KEYS[family]
    if key in accepted:
        return
    if key not in _ALL_KEYS:
        raise unknown(f"key for family {family!r}", key, accepted)
    readers = [f for f, keys in FAMILY_KEYS.items() if key in keys]
    raise SpecError(f"{family}: key {key!r} is not read by the {family} family (only by {', '.join(readers)}); "
                    f"{family} accepts {', '.join(accepted)}")


def _coerce(key: str, raw: str) -> int | bool:
    if key == "tied":
        if raw.lower() not in {"true", "false", "1", "0"}:
            raise SpecError(f"tied={raw!r}: expected true or false")
        return raw.lower() in {"true", "1"}
    if not re.fullmatch(r"-?\d{1,12}", raw.strip()):  # int() would also take "1_000"
        raise SpecError(f"{key}={raw!r}: expected a whole number")
    value = int(raw)
    if value < 0 or (value == 0 and key in _POSITIVE):
        hint = " (leave dec_layers out for as many decoder layers as encoder layers)" if key == "dec_layers" else ""
        accepted = "positive" if key in _POSITIVE else f">= 0; 0 means {_ZERO_MEANS[key]}"
        raise SpecError(f"{key}={value}: must be {accepted}{hint}")
    return value


def _check_shape(family: str, shape: TransformerShape, given: set[str]) -> None:
    """SpecError for sizes that do not fit together; a value the SPEC did not set is named as the family default."""
    def named(key: str, value: int) -> str:
        return f"{key}={value}" if key in given else f"{key}={value} (the {family} default)"

    if not shape.head_dim and shape.hidden % shape.heads:
        raise SpecError(f"{family}: {named('hidden', shape.hidden)} is not divisible by "
                        f"{named('heads', shape.heads)}; give head_dim explicitly or choose heads dividing hidden")
    if shape.heads % shape.kvh:
        fits = max(d for d in range(1, shape.kvh + 1) if shape.heads % d == 0)
        raise SpecError(f"{family}: {named('heads', shape.heads)} is not divisible by "
                        f"{named('kv_heads', shape.kvh)}; set kv_heads to a divisor of heads (e.g. kv_heads={fits})")
    if shape.top_k > shape.experts:
        raise SpecError(f"{family}: {named('top_k', shape.top_k)} exceeds {named('experts', shape.experts)}")
    if family == "vit" and shape.image % shape.patch:
        raise SpecError(f"vit: {named('image', shape.image)} is not divisible by {named('patch', shape.patch)}")


def shape_fields() -> list[str]:
    """All TransformerShape field names (for documentation)."""
    return [f.name for f in fields(TransformerShape)]
