"""graph_from_module: layers, folding hashes, FLOPs, bytes and parameters of traced modules."""

import pytest
import torch
import transformers  # a run dependency (pyproject): its absence is a broken install, not a skip
from torch import nn

from tagplan.errors import SpecError
from tagplan.frontends.torch_export import graph_from_module
from tagplan.ir.model import ModelGraph, OpKind, PartitionDim
from tagplan.ir.workload import DType

SEQ = 16


def gpt2(n_layer: int = 3, n_embd: int = 64, batch: int = 2, dtype: DType = DType.BF16) -> tuple[ModelGraph, nn.Module]:
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=100, n_positions=64,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.zeros(batch, SEQ, dtype=torch.long)
    return graph_from_module(model, (), {"input_ids": ids}, name="gpt2", family="gpt2", seq_len=SEQ,
                             dtype=dtype), model


@pytest.fixture(scope="module")
def tiny_gpt2() -> tuple[ModelGraph, nn.Module]:
    return gpt2()


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, s, h]
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def test_gpt2_layers_are_embed_blocks_head_and_blocks_fold(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    g, _ = tiny_gpt2
    assert [layer.name for layer in g.layers] == ["embed", "h.0", "h.1", "h.2", "head"]
    hashes = [layer.block for layer in g.layers]
    assert hashes[1] == hashes[2] == hashes[3]
    assert len(set(hashes)) == 3 == len(g.blocks) == g.unique_blocks
    assert [g.block_of(i).kind for i in (0, 1, 4)] == ["embedding", "block", "head"]
    assert all(len(h) == 16 for h in hashes)
    assert all(layer.inputs is None for layer in g.layers)


def test_a_wider_block_hashes_differently(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    wide, _ = gpt2(n_layer=1, n_embd=128)
    assert wide.layers[1].block != tiny_gpt2[0].layers[1].block


def test_gpt2_block_flops_match_the_closed_form(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    g, _ = tiny_gpt2
    s, h = SEQ, 64
    closed = 24 * s * h * h + 4 * s * s * h  # per sample, forward
    assert g.block_of(1).flops == pytest.approx(closed, rel=0.05)
    matmul = sum(op.flops for op in g.block_of(1).ops if op.kind in (OpKind.MATMUL, OpKind.ATTENTION))
    assert matmul == closed  # FlopCounterMode's part is exact


def test_figures_are_per_sample(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    g4, _ = gpt2(batch=4)
    block2, block4 = tiny_gpt2[0].block_of(1), g4.block_of(1)
    assert block4.flops == block2.flops
    assert block4.saved_bytes == block2.saved_bytes
    assert block4.output_bytes == block2.output_bytes == SEQ * 64 * 2  # one [s, h] bf16 residual


def test_params_equal_the_module_and_tied_weights_count_once(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    g, model = tiny_gpt2
    assert g.params == sum(p.numel() for p in model.parameters())
    head = g.block_of(len(g.layers) - 1)
    assert head.params == 2 * 64  # ln_f only: lm_head reuses wte, owned by the embedding layer
    assert g.block_of(0).params == 100 * 64 + 64 * 64  # wte + wpe
    assert head.param_bytes == head.params * 2


def test_dtype_sets_byte_figures_not_flops(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    g32, _ = gpt2(dtype=DType.FP32)
    b16, b32 = tiny_gpt2[0].block_of(1), g32.block_of(1)
    assert b32.flops == b16.flops
    assert b32.param_bytes == 2 * b16.param_bytes
    assert b32.output_bytes == 2 * b16.output_bytes


def test_gpt2_op_names_kinds_and_partition_dims(tiny_gpt2: tuple[ModelGraph, nn.Module]) -> None:
    ops = {op.name: op for op in tiny_gpt2[0].block_of(1).ops}
    attn = ops["attn.scaled_dot_product_attention"]
    assert attn.kind is OpKind.ATTENTION and PartitionDim.HEADS in attn.partition_dims
    fc = ops["mlp.c_fc.addmm"]
    assert fc.kind is OpKind.MATMUL
    assert {PartitionDim.BATCH, PartitionDim.HIDDEN_IN, PartitionDim.HIDDEN_OUT} <= set(fc.partition_dims)
    assert fc.inputs == ("mlp.c_fc.view",) and ops["mlp.c_fc.view"].kind is OpKind.VIEW
    assert ops["mlp.c_fc.view"].flops == ops["mlp.c_fc.view"].bytes_read == 0
    assert ops["ln_1.layer_norm"].kind is OpKind.LAYERNORM
    assert ops["ln_1.layer_norm"].flops == 5 * SEQ * 64
    emb = {op.kind for op in tiny_gpt2[0].block_of(0).ops}
    assert OpKind.EMBEDDING in emb


def test_sequential_mlp_stack_and_saved_bytes() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), *[Block(64) for _ in range(3)], nn.Flatten(), nn.Linear(8 * 64, 10))
        x = torch.zeros(4, 8, 32)
    g = graph_from_module(model, (x,), name="mlp", seq_len=8)
    assert [layer.name for layer in g.layers] == ["0", "1", "2", "3", "5"]  # Flatten (4) folds into 5
    assert g.layers[1].block == g.layers[2].block == g.layers[3].block != g.layers[0].block
    assert g.params == sum(p.numel() for p in model.parameters())
    block = g.block_of(1)
    ops = {op.name: op for op in block.ops}
    assert list(ops) == ["norm.layer_norm", "fc1.linear", "relu", "fc2.linear", "add"]
    act = 8 * 64 * 2  # bf16 [s, h] per sample
    assert ops["norm.layer_norm"].saved_bytes == act  # its input
    assert ops["fc1.linear"].saved_bytes == act  # the norm output
    assert ops["relu"].saved_bytes == 4 * act  # its input, fc1's output
    assert ops["fc2.linear"].saved_bytes == 4 * act  # relu's output
    assert ops["add"].saved_bytes == 0
    assert ops["fc1.linear"].flops == 2 * 8 * 64 * 256
    assert ops["fc1.linear"].param_bytes == (64 * 256 + 256) * 2


class SharedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x.view(2, 4, 8))


def test_a_tensor_saved_by_several_ops_counts_once() -> None:
    model = nn.Sequential(SharedInput()).to("meta")  # one layer, "0"
    g = graph_from_module(model, (torch.zeros(2, 4, 8, device="meta"),), name="m", seq_len=4)
    ops = {op.name: op for op in g.block_of(0).ops}
    assert list(ops) == ["q.linear", "view", "k.linear", "mul"]
    act = 4 * 8 * 2
    assert ops["q.linear"].saved_bytes == act
    assert ops["k.linear"].saved_bytes == 0  # the same storage, seen through a view
    assert ops["mul"].saved_bytes == 2 * act  # both linear outputs


class Flat(nn.Module):
    """No indexed containers: top-level children become layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.proj = nn.Linear(32, 32)
        self.out = nn.Linear(32, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, s]
        return self.out(self.proj(self.emb(ids)))


def test_module_without_containers_gets_one_layer_per_child() -> None:
    with torch.device("meta"):
        model = Flat()
        ids = torch.zeros(3, 8, dtype=torch.long)
    g = graph_from_module(model, (ids,), name="flat", seq_len=8)
    assert [layer.name for layer in g.layers] == ["emb", "proj", "out"]
    assert g.params == sum(p.numel() for p in model.parameters())
    emb = g.block_of(0).ops[0]
    assert emb.kind is OpKind.EMBEDDING and emb.saved_bytes == 8 * 8  # int64 indices per sample
    assert PartitionDim.HIDDEN_OUT in emb.partition_dims


class Join(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.fc(x + skip)


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16), Join()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.layers[0](x)
        return self.layers[2](self.layers[1](a), a)


def test_layer_inputs_name_non_adjacent_sources() -> None:
    g = graph_from_module(Skip().to("meta"), (torch.zeros(2, 4, 16, device="meta"),), name="skip", seq_len=4)
    assert [layer.name for layer in g.layers] == ["layers.0", "layers.1", "layers.2"]
    assert [layer.inputs for layer in g.layers] == [None, None, (0, 1)]
    assert g.block_of(0).output_bytes == 4 * 16 * 2  # `a`, sent to layers 1 and 2, counted once


def test_llama_rotary_higher_order_op_traces() -> None:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.zeros(2, SEQ, dtype=torch.long)
    g = graph_from_module(model, (), {"input_ids": ids}, name="llama", seq_len=SEQ)
    assert [layer.name for layer in g.layers] == ["embed", "layers.0", "layers.1", "head"]
    # the rotary table is computed once, in the embedding's layer: under a set_grad_enabled higher-order op
    # up to transformers 5.23 (which the tracer must follow), as plain cos/sin ops from 5.24
    assert any(op.name.startswith("model.rotary_emb.") for op in g.block_of(0).ops)
    assert g.layers[1].block == g.layers[2].block  # the shared cos/sin table is not an activation edge
    assert g.params == sum(p.numel() for p in model.parameters())


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0]


def test_export_failure_is_a_spec_error_naming_the_module() -> None:
    with pytest.raises(SpecError, match=r"'dd' \(DataDependent\)"):
        graph_from_module(DataDependent(), (torch.zeros(2, 3, device="meta"),), name="dd", seq_len=3)


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


def test_export_error_first_line_is_reported() -> None:
    with pytest.raises(SpecError, match=r"'br' \(Branchy\): torch.export failed: \w+: ") as info:
        graph_from_module(Branchy(), (torch.zeros(2, 3, device="meta"),), name="br", seq_len=3)
    assert "\n" not in str(info.value)


def test_inputs_without_tensors_are_rejected() -> None:
    with pytest.raises(SpecError, match="no tensor"):
        graph_from_module(nn.Identity(), (), name="none", seq_len=1)
