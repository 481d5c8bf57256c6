"""Named models with their published shapes (GPT-3 paper Table 2.1, Llama 2/3, BERT, T5, ...)."""

from __future__ import annotations

from typing import NamedTuple

from tagplan.errors import unknown
from tagplan.frontends.families import TransformerShape
from tagplan.frontends.parametric import FAMILIES
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType


class ZooEntry(NamedTuple):
    """A named model: family, shape, default sequence length, published parameter count.

    `exact` is False where the publication gives only a rounded size class (GPT-3's "350M" is
    355M parameters at its published shape); those counts are checked within 2%, the rest 1%.
    """

    family: str
    shape: TransformerShape
    seq_len: int
    published_params: float
    exact: bool = True


def _gpt3(*, layers: int, hidden: int, heads: int, params: float, exact: bool = False) -> ZooEntry:
    shape = TransformerShape(layers=layers, hidden=hidden, heads=heads, head_dim=hidden // heads, vocab=50257,
                             max_positions=2048)
    return ZooEntry(family="gpt", shape=shape, seq_len=2048, published_params=params, exact=exact)


def _llama(*, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, params: float,
           seq_len: int) -> ZooEntry:
    shape = TransformerShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                             tied=False)
    return ZooEntry(family="llama", shape=shape, seq_len=seq_len, published_params=params)


ZOO: dict[str, ZooEntry] = {
    # GPT-3 paper, Table 2.1 (n_ctx 2048, vocab 50257; 13B uses d_model 5140 with 40 heads of 128).
    "gpt3-125m": _gpt3(layers=12, hidden=768, heads=12, params=125e6),
    "gpt3-350m": _gpt3(layers=24, hidden=1024, heads=16, params=350e6),
    "gpt3-760m": _gpt3(layers=24, hidden=1536, heads=16, params=760e6),
    "gpt3-1.3b": _gpt3(layers=24, hidden=2048, heads=24, params=1.3e9),
    "gpt3-2.7b": _gpt3(layers=32, hidden=2560, heads=32, params=2.7e9),
    "gpt3-6.7b": _gpt3(layers=32, hidden=4096, heads=32, params=6.7e9),
    "gpt3-13b": ZooEntry(family="gpt", shape=TransformerShape(layers=40, hidden=5140, heads=40, head_dim=128,
                                                              vocab=50257, max_positions=2048),
                         seq_len=2048, published_params=13e9, exact=False),
    "gpt3-175b": _gpt3(layers=96, hidden=12288, heads=96, params=174.6e9, exact=True),
    # Llama 2 (Touvron et al. 2023) and Llama 3 (Meta 2024) model cards.
    "llama2-7b": _llama(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
                        params=6.74e9, seq_len=4096),
    "llama2-13b": _llama(layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000,
                         params=13.02e9, seq_len=4096),
    "llama2-70b": _llama(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
                         params=68.98e9, seq_len=4096),
    "llama3-8b": _llama(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                        params=8.03e9, seq_len=8192),
    "llama3-70b": _llama(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
                         params=70.55e9, seq_len=8192),
    # BERT-large with pooler and MLM head (the pre-training model, 336M as Hugging Face counts it).
    "bert-large": ZooEntry(family="bert", shape=TransformerShape(layers=24, hidden=1024, heads=16, vocab=30522,
                                                                 max_positions=512),
                           seq_len=512, published_params=336e6),
    # T5 v1.0 (Raffel et al. 2020): 3B and 11B, 24 + 24 blocks, d_kv 128.
    "t5-3b": ZooEntry(family="t5", shape=TransformerShape(layers=24, hidden=1024, heads=32, head_dim=128, ffn=16384,
                                                          vocab=32128),
                      seq_len=512, published_params=2.85e9),
    "t5-11b": ZooEntry(family="t5", shape=TransformerShape(layers=24, hidden=1024, heads=128, head_dim=128, ffn=65536,
                                                           vocab=32128),
                       seq_len=512, published_params=11.3e9),
    # Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ZooEntry(family="moe", shape=TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8,
                                                                  ffn=14336, vocab=32000, tied=False, experts=8,
                                                                  top_k=2),
                             seq_len=4096, published_params=46.7e9),
    # ViT-H/14 (Dosovitskiy et al. 2021): 632M parameters at 224 x 224.
    "vit-h-14": ZooEntry(family="vit", shape=TransformerShape(layers=32, hidden=1280, heads=16, vocab=0, patch=14,
                                                              image=224, classes=1000),
                         seq_len=257, published_params=632e6),
}

ALIASES = {"vit-h/14": "vit-h-14", "llama-2-7b": "llama2-7b", "llama-2-13b": "llama2-13b",
           "llama-2-70b": "llama2-70b", "llama-3-8b": "llama3-8b", "llama-3-70b": "llama3-70b",
           "gpt-3-175b": "gpt3-175b", "mixtral-8x7B": "mixtral-8x7b"}


def zoo_names() -> list[str]:
    """Names accepted by `build_zoo`."""
    return list(ZOO)


def resolve_zoo_name(name: str) -> str | None:
    """The canonical zoo name for `name` (case-insensitive, aliases), or None."""
    key = name.lower()
    key = {k.lower(): v for k, v in ALIASES.items()}.get(key, key)
    return key if key in ZOO else None


def build_zoo(name: str, *, seq_len: int | None = None, dtype: DType = DType.BF16) -> ModelGraph:
    """The zoo model `name` at `seq_len` (default: its published context); SpecError if unknown."""
    key = resolve_zoo_name(name)
    if key is None:
        raise unknown("model", name, zoo_names())
    entry = ZOO[key]
    seq = entry.seq_len if seq_len is None or entry.family == "vit" else seq_len
    return FAMILIES[entry.family](key, entry.shape, seq, dtype)
