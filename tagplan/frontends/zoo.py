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


def _gpt3(layers: int, hidden: int, heads: int, params: float, exact: bool = False) -> ZooEntry:
    return ZooEntry("gpt", TransformerShape(layers=layers, hidden=hidden, heads=heads, head_dim=hidden // heads,
                                            vocab=50257, max_positions=2048), 2048, params, exact)


def _llama(layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int, params: float,
           seq: int) -> ZooEntry:
    shape = TransformerShape(layers=layers, hidden=hidden, heads=heads, kv_heads=kv, ffn=ffn, vocab=vocab, tied=False)
    return ZooEntry("llama", shape, seq, params)


ZOO: dict[str, ZooEntry] = {
    # GPT-3 paper, Table 2.1 (n_ctx 2048, vocab 50257; 13B uses d_model 5140 with 40 heads of 128).
    "gpt3-125m": _gpt3(12, 768, 12, 125e6),
    "gpt3-350m": _gpt3(24, 1024, 16, 350e6),
    "gpt3-760m": _gpt3(24, 1536, 16, 760e6),
    "gpt3-1.3b": _gpt3(24, 2048, 24, 1.3e9),
    "gpt3-2.7b": _gpt3(32, 2560, 32, 2.7e9),
    "gpt3-6.7b": _gpt3(32, 4096, 32, 6.7e9),
    "gpt3-13b": ZooEntry("gpt", TransformerShape(layers=40, hidden=5140, heads=40, head_dim=128, vocab=50257,
                                                 max_positions=2048), 2048, 13e9, False),
    "gpt3-175b": _gpt3(96, 12288, 96, 174.6e9, exact=True),
    # Llama 2 (Touvron et al. 2023) and Llama 3 (Meta 2024) model cards.
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 6.74e9, 4096),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 13.02e9, 4096),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 68.98e9, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8.03e9, 8192),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 70.55e9, 8192),
    # BERT-large with pooler and MLM head (the pre-training model, 336M as Hugging Face counts it).
    "bert-large": ZooEntry("bert", TransformerShape(layers=24, hidden=1024, heads=16, vocab=30522,
                                                    max_positions=512), 512, 336e6),
    # T5 v1.0 (Raffel et al. 2020): 3B and 11B, 24 + 24 blocks, d_kv 128.
    "t5-3b": ZooEntry("t5", TransformerShape(layers=24, hidden=1024, heads=32, head_dim=128, ffn=16384,
                                             vocab=32128), 512, 2.85e9),
    "t5-11b": ZooEntry("t5", TransformerShape(layers=24, hidden=1024, heads=128, head_dim=128, ffn=65536,
                                              vocab=32128), 512, 11.3e9),
    # Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active.
    "mixtral-8x7b": ZooEntry("moe", TransformerShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                                                     vocab=32000, tied=False, experts=8, top_k=2), 4096, 46.7e9),
    # ViT-H/14 (Dosovitskiy et al. 2021): 632M parameters at 224 x 224.
    "vit-h-14": ZooEntry("vit", TransformerShape(layers=32, hidden=1280, heads=16, vocab=0, patch=14,
                                                 image=224, classes=1000), 257, 632e6),
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
