"""Random models for datasets: the parametric transformer families and a ResNet-like CNN.

A model is drawn as a `ModelRecipe` (family, shape, sequence length, dtype): a few hundred bytes
of JSON that `build_model` turns back into the exact `ModelGraph`, in closed form and without
torch. Transformers get 2-48 blocks and a hidden width of 256-8192 (multiples of 128, half the
time uniform and half log-uniform; 64- or 128-wide heads); the CNN (`build_cnn`) is the
non-transformer family: a stem, N residual blocks (basic or bottleneck) over 3-4 resolution
stages, and a classifier.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from pydantic import Field

from tagplan.frontends.analytic import BlockBuilder
from tagplan.frontends.families import TransformerShape, assemble
from tagplan.frontends.parametric import FAMILIES
from tagplan.ir.base import Record
from tagplan.ir.model import Block, ModelGraph, Op, OpKind, PartitionDim
from tagplan.ir.workload import DType

TRANSFORMER_FAMILIES: tuple[str, ...] = ("gpt", "llama", "bert", "t5", "moe", "vit")
FAMILY_NAMES: tuple[str, ...] = (*TRANSFORMER_FAMILIES, "cnn")
"""Every family `random_recipe` draws from, in a fixed order (the draw depends on it)."""

_SEQ_LENS = (128, 256, 512, 1024, 2048, 4096)
_VIT_IMAGES = ((224, 14), (224, 16), (256, 16), (336, 14), (384, 16), (448, 14))  # (image, patch)
_VOCABS = {"gpt": (50257,), "llama": (32000, 128256), "bert": (30522,), "t5": (32128,), "moe": (32000,)}
_DTYPES = ((DType.BF16, 0.85), (DType.FP16, 0.10), (DType.FP32, 0.05))
_CONV_DIMS = (PartitionDim.BATCH, PartitionDim.HIDDEN_OUT, PartitionDim.HIDDEN_IN)


class ModelRecipe(Record):
    """What `build_model` needs to rebuild one drawn model exactly."""

    family: str = Field(min_length=1, description="one of FAMILY_NAMES")
    name: str = Field(min_length=1)
    seq_len: int = Field(gt=0, description="tokens per sample (vit and cnn: fixed by the image, recorded)")
    dtype: DType = DType.BF16
    shape: dict[str, int | bool] = Field(description="TransformerShape or CNNShape fields")


@dataclass(frozen=True)
class CNNShape:
    """A ResNet-like CNN: `blocks` residual blocks split over `stages` stages as ResNet-50's 3:4:6:3."""

    blocks: int
    width: int  # channels of the first stage (inner width of a bottleneck block)
    image: int = 224  # square input, pixels per side
    stages: int = 4
    bottleneck: bool = False
    classes: int = 1000

    @property
    def small_stem(self) -> bool:
        """CIFAR-style stem (3x3 conv, stride 1, no pooling) for images of 64 pixels or less."""
        return self.image <= 64

    @property
    def positions(self) -> int:
        """Positions (pixels of the feature map) of the first residual stage."""
        return self.image**2 if self.small_stem else (self.image // 4) ** 2


class _ConvBuilder(BlockBuilder):
    """BlockBuilder with convolutions and pooling; activations are (positions, channels) matrices."""

    def conv(self, name: str, src: str, c_in: int, c_out: int, kernel: int, *, positions_in: int,
             positions_out: int) -> str:
        """A `kernel x kernel` convolution as an implicit GEMM: 2 * P_out * C_in * k^2 * C_out FLOPs."""
        params = c_in * kernel * kernel * c_out
        return self._add(Op(
            name=name, kind=OpKind.CONV, flops=2.0 * positions_out * c_in * kernel * kernel * c_out,
            bytes_read=(positions_in * c_in + params) * self.nbytes,
            bytes_written=positions_out * c_out * self.nbytes, param_bytes=params * self.nbytes,
            saved_bytes=self._save_once(src, positions_in * c_in * self.nbytes),
            output_shape=(1, positions_out, c_out), partition_dims=_CONV_DIMS, inputs=(src,),
        ), params)

    def pool(self, name: str, src: str, channels: int, *, positions_in: int, positions_out: int,
             window: int) -> str:
        """Max or average pooling: one FLOP per window element of each output."""
        return self._add(Op(
            name=name, kind=OpKind.REDUCTION, flops=float(window * positions_out * channels),
            bytes_read=positions_in * channels * self.nbytes, bytes_written=positions_out * channels * self.nbytes,
            saved_bytes=self._save_once(src, positions_in * channels * self.nbytes),
            output_shape=(1, positions_out, channels),
            partition_dims=(PartitionDim.BATCH, PartitionDim.HIDDEN_OUT), inputs=(src,),
        ))


def _stage_blocks(shape: CNNShape) -> list[int]:
    """Residual blocks per stage: ResNet-50's 3:4:6:3 proportions, at least one each."""
    weights = (3, 4, 6, 3)[: shape.stages] if shape.stages <= 4 else (1,) * shape.stages
    counts = [1] * shape.stages
    for _ in range(shape.blocks - shape.stages):
        # give the next block to the stage furthest below its share
        i = min(range(shape.stages), key=lambda k: (counts[k] / weights[k], -weights[k], k))
        counts[i] += 1
    return counts


def _residual(shape: CNNShape, c_in: int, inner: int, p_in: int, p_out: int, nbytes: int) -> tuple[Block, int]:
    """One residual block from `c_in` channels at `p_in` positions to `p_out`; returns (block, c_out)."""
    c_out = 4 * inner if shape.bottleneck else inner
    project = c_in != c_out or p_in != p_out
    b = _ConvBuilder("down_block" if project else "block", p_out, nbytes)
    x = "input"
    if shape.bottleneck:  # ResNet v1: the stride is on the first 1x1
        y = b.elementwise("relu1", (b.norm("bn1", b.conv("conv1", x, c_in, inner, 1, positions_in=p_in,
                                                          positions_out=p_out), inner),), inner, saves_input=True)
        y = b.elementwise("relu2", (b.norm("bn2", b.conv("conv2", y, inner, inner, 3, positions_in=p_out,
                                                          positions_out=p_out), inner),), inner, saves_input=True)
        y = b.norm("bn3", b.conv("conv3", y, inner, c_out, 1, positions_in=p_out, positions_out=p_out), c_out)
    else:
        y = b.elementwise("relu1", (b.norm("bn1", b.conv("conv1", x, c_in, c_out, 3, positions_in=p_in,
                                                          positions_out=p_out), c_out),), c_out, saves_input=True)
        y = b.norm("bn2", b.conv("conv2", y, c_out, c_out, 3, positions_in=p_out, positions_out=p_out), c_out)
    if project:
        x = b.norm("shortcut_bn", b.conv("shortcut", x, c_in, c_out, 1, positions_in=p_in, positions_out=p_out),
                   c_out)
    b.elementwise("relu_out", (b.elementwise("residual", (x, y), c_out, saves_input=False),), c_out,
                  saves_input=True)
    return b.build(c_out), c_out


def build_cnn(name: str, shape: CNNShape, dtype: DType) -> ModelGraph:
    """A ResNet-like CNN: stem (conv, BN, ReLU, pool), residual stages halving the resolution, classifier.

    Activations are (positions, channels) per sample; the graph's `seq_len` is the number of
    positions the first stage works on.
    """
    n, side = dtype.nbytes, shape.image
    stem_side, p0 = (side if shape.small_stem else side // 2), shape.positions
    sb = _ConvBuilder("stem", stem_side**2, n)
    kernel = 3 if shape.small_stem else 7
    x = sb.conv("conv", "pixels", 3, shape.width, kernel, positions_in=side * side, positions_out=stem_side**2)
    x = sb.elementwise("relu", (sb.norm("bn", x, shape.width),), shape.width, saves_input=True)
    if not shape.small_stem:
        sb.pool("maxpool", x, shape.width, positions_in=stem_side**2, positions_out=p0, window=9)
    layers = [("stem", sb.build(shape.width, output_tokens=p0))]
    c, p = shape.width, p0
    for s, count in enumerate(_stage_blocks(shape)):
        inner = shape.width * 2**s
        for i in range(count):
            p_out = p // 4 if s > 0 and i == 0 else p
            block, c = _residual(shape, c, inner, p, p_out, n)
            layers.append((f"stage{s + 1}.{i}", block))
            p = p_out
    hb = _ConvBuilder("head", p, n)
    pooled = hb.pool("avgpool", "input", c, positions_in=p, positions_out=1, window=p)
    logits = hb.linear("fc", pooled, c, shape.classes, bias=True, tokens=1)
    hb.softmax_loss("cross_entropy", logits, shape.classes, tokens=1)
    layers.append(("head", hb.build(1, output_tokens=1)))
    return assemble(name, "cnn", p0, dtype, layers)


def build_model(recipe: ModelRecipe) -> ModelGraph:
    """The ModelGraph a recipe describes (the same graph every time, in closed form)."""
    if recipe.family == "cnn":
        return build_cnn(recipe.name, CNNShape(**recipe.shape), recipe.dtype)  # type: ignore[arg-type]
    builder = FAMILIES.get(recipe.family)
    if builder is None:
        raise ValueError(f"unknown model family {recipe.family!r}; known: {', '.join(FAMILY_NAMES)}")
    return builder(recipe.name, TransformerShape(**recipe.shape), recipe.seq_len, recipe.dtype)  # type: ignore[arg-type]


def random_recipe(rng: random.Random, *, families: tuple[str, ...] = FAMILY_NAMES) -> ModelRecipe:
    """A model drawn with `rng`: a uniform family, then its depth, width, sequence and dtype."""
    family = rng.choice(families)
    dtype = rng.choices([d for d, _ in _DTYPES], weights=[w for _, w in _DTYPES])[0]
    if family == "cnn":
        shape = _random_cnn_shape(rng)
        name = f"cnn-b{shape.blocks}-w{shape.width}-i{shape.image}{'-bottleneck' if shape.bottleneck else ''}"
        return ModelRecipe(family=family, name=name, seq_len=shape.positions, dtype=dtype, shape=asdict(shape))
    tshape, seq = _random_transformer_shape(rng, family)
    name = f"{family}-l{tshape.layers}-h{tshape.hidden}-s{seq}"
    return ModelRecipe(family=family, name=name, seq_len=seq, dtype=dtype, shape=asdict(tshape))


def random_model(rng: random.Random) -> tuple[str, ModelGraph]:
    """(family, graph) of a model drawn with `rng` (see `random_recipe`)."""
    recipe = random_recipe(rng)
    return recipe.family, build_model(recipe)


def _random_hidden(rng: random.Random) -> int:
    """A multiple of 128 in [256, 8192]: half the time uniform, half log-uniform (more small models)."""
    if rng.random() < 0.5:
        return 128 * rng.randint(2, 64)
    return min(max(128 * round(2 ** rng.uniform(8, 13) / 128), 256), 8192)


def _random_transformer_shape(rng: random.Random, family: str) -> tuple[TransformerShape, int]:
    """(shape, seq_len) for a transformer family; depth counts blocks (T5: encoder + decoder)."""
    depth, hidden = rng.randint(2, 48), _random_hidden(rng)
    heads = hidden // rng.choice((64, 128))
    seq = rng.choice(_SEQ_LENS[:3] if family == "bert" else _SEQ_LENS)
    vocab = rng.choice(_VOCABS.get(family, (0,)))
    shape = TransformerShape(layers=depth, hidden=hidden, heads=heads, vocab=vocab, max_positions=seq)
    if family in ("llama", "moe"):
        kv = rng.choice([k for k in (heads, heads // 4, heads // 8) if k >= 1 and heads % k == 0])
        shape = TransformerShape(layers=depth, hidden=hidden, heads=heads, vocab=vocab, kv_heads=kv, tied=False,
                                 experts=rng.choice((4, 8, 16)) if family == "moe" else 8,
                                 top_k=rng.choice((1, 2)) if family == "moe" else 2)
    elif family == "t5":
        half = max(depth // 2, 1)
        shape = TransformerShape(layers=half, dec_layers=half, hidden=hidden, heads=heads, vocab=vocab)
    elif family == "vit":
        image, patch = rng.choice(_VIT_IMAGES)
        shape = TransformerShape(layers=depth, hidden=hidden, heads=heads, vocab=0, image=image, patch=patch)
        seq = (image // patch) ** 2 + 1
    return shape, seq


def _random_cnn_shape(rng: random.Random) -> CNNShape:
    image = rng.choice((32, 64, 128, 224))
    blocks = rng.randint(2, 48)
    stages = min(3 if image <= 64 else 4, blocks)
    return CNNShape(blocks=blocks, width=rng.choice((16, 32, 64, 96, 128, 192, 256)), image=image, stages=stages,
                    bottleneck=rng.random() < 0.5, classes=rng.choice((10, 100, 1000)))
