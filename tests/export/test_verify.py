"""The torch program exporter and its verification (tagplan.export.shapes, modules, torch_program, verify).

Tests marked slow run the exported program on 2-4 local gloo processes (a few seconds each on
two busy cores); the rest check the builders, the refusals and the comparison without spawning.
"""

from __future__ import annotations

import json
import math
import py_compile
from pathlib import Path

import pytest
import torch

from tagplan.export import ExportError
from tagplan.export.modules import build_model
from tagplan.export.runtime_launch import RankRun
from tagplan.export.shapes import model_config, scaled_down
from tagplan.export.torch_checks import check_expressible
from tagplan.export.torch_program import PROGRAM_NAME, PROGRAM_SOURCE, write_torch_program
from tagplan.export.verify import ATOL, RTOL, _compare, _judge, predicted_vs_measured, reference, verify
from tagplan.frontends.model_spec import load_model
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import LossKernel

ONE_STAGE = (0, 4)  # embed, two blocks, head
MOE_SPEC = "moe?layers=2&hidden=64&heads=4&kv_heads=2&vocab=128&experts=4&top_k=2&ffn=96"


def _stage(layers: tuple[int, int], devices: tuple[int, ...], **kw: object) -> Stage:
    return Stage(layers=layers, devices=devices, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["gpt?layers=2&hidden=64&heads=4&vocab=128&max_positions=16",
                                  "llama?layers=2&hidden=64&heads=4&kv_heads=2&vocab=128",
                                  "llama?layers=1&hidden=64&heads=4&vocab=100&tied=true", MOE_SPEC])
def test_modules_have_the_analytic_parameter_count_and_layer_list(spec: str) -> None:
    graph = load_model(spec, seq_len=16)
    model = build_model(spec, seq_len=16)
    assert sum(p.numel() for p in model.parameters()) == graph.params
    assert len(model.layers) == len(graph.layers)
    assert model(torch.randint(0, 64, (2, 16))).shape == (2, 16, model.config.vocab)


def test_scaled_down_keeps_family_layers_and_attention_grouping() -> None:
    small = scaled_down("llama3-8b")
    config = model_config(small, seq_len=16)
    assert (config.family, config.layers, config.hidden, config.heads, config.kv_heads, config.vocab) == (
        "llama", 32, 64, 4, 2, 128)
    assert not config.tied
    gpt = model_config(scaled_down("gpt3-175b"), seq_len=16)
    assert (gpt.layers, gpt.max_positions, gpt.tied) == (96, 16, True)


def test_scaled_down_moe_keeps_its_routing_and_takes_a_small_ffn() -> None:
    config = model_config(scaled_down("mixtral-8x7b"), seq_len=16)
    assert (config.family, config.layers, config.hidden, config.experts, config.top_k) == ("moe", 32, 64, 8, 2)
    assert config.ffn == 256  # llama's FFN for 64 wide, not Mixtral's 14336


def test_experts_send_each_token_to_its_top_k_experts_weighted_by_the_renormalised_router() -> None:
    from tagplan.export.modules import Experts

    torch.manual_seed(0)
    experts = Experts(model_config(MOE_SPEC, seq_len=16))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, logits = torch.randn(6, 64), torch.randn(6, 4)
    expected = []
    for token, row in zip(x, logits, strict=True):  # token by token, every expert computed, the top 2 kept
        outputs = [torch.nn.functional.silu(experts.gate[e] @ token) * (experts.up[e] @ token) for e in range(4)]
        outputs = [experts.down[e] @ h for e, h in enumerate(outputs)]
        top = torch.softmax(row, dim=0).topk(2)
        expected.append(sum(w / top.values.sum() * outputs[int(e)] for w, e in zip(top.values, top.indices,
                                                                                     strict=True)))
    assert torch.allclose(experts(x, logits), torch.stack(expected), atol=1e-6)


def test_experts_run_under_16_bit_autocast_as_a_bf16_plan_runs_them() -> None:
    from tagplan.export.modules import MoE

    torch.manual_seed(0)
    moe = MoE(model_config(MOE_SPEC, seq_len=16))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = moe(x)  # 16-bit router logits and expert outputs, summed into the tokens' dtype
    assert low.dtype == torch.float32 and low.shape == (2, 3, 64)
    assert torch.allclose(low, moe(x), rtol=0.05, atol=0.02)


def test_moe_stages_with_tensor_parallelism_split_or_keep_experts_and_refuse_other_mixes() -> None:
    graph, config = load_model(MOE_SPEC, seq_len=16), model_config(MOE_SPEC, seq_len=16)
    split = Plan(stages=(_stage((0, 2), (0,)), _stage((2, 4), (1, 2), tp=2)))  # tagplan's defaults: FFN split
    check_expressible(split, graph, config=config)
    whole = {"router": "sequence", "experts.gate": "sequence", "experts.up": "sequence", "experts.down": "sequence"}
    check_expressible(Plan(stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding=whole),)), graph, config=config)
    mixed = {"experts.gate": "column", "experts.up": "sequence", "experts.down": "row"}
    spread = dict.fromkeys(("experts.gate", "experts.up", "experts.down"), "experts")
    plan = Plan(stages=(_stage((0, 2), (0, 1), tp=2, sharding=mixed),
                        _stage((2, 4), (2, 3), tp=2, sharding={**spread, "router": "row"})))
    with pytest.raises(ExportError) as refused:
        check_expressible(plan, graph, config=config)
    message = str(refused.value)
    assert "stages[0] layer 1: experts strategies {'experts.gate': 'column', 'experts.up': 'sequence'" in message
    assert "stages[1] layer 2: experts strategies" in message and "--expert-model-parallel-size" in message
    assert "stages[1] layer 2: router='row': the program runs the router as replicate, sequence, column" in message
    assert message.count("experts strategies") == 2  # one layer's reasons per stage, not a line per op
    odd = "moe?layers=2&hidden=64&heads=4&kv_heads=2&vocab=128&experts=4&top_k=2&ffn=90"
    with pytest.raises(ExportError, match=r"tp=4 must divide the experts' ffn=90"):
        check_expressible(Plan(stages=(_stage(ONE_STAGE, (0, 1, 2, 3), tp=4),)), load_model(odd, seq_len=16),
                          config=model_config(odd, seq_len=16))


_MOE_TOKEN_SPLIT = {"attn.q": "sequence", "attn.k": "sequence", "attn.v": "sequence", "attn.o": "sequence",
                    "router": "sequence"}  # the planner's Mixtral stages: attention on tokens, experts' FFN split


@pytest.mark.slow
def test_moe_experts_split_over_tp_match_one_process_with_and_without_sequence_parallelism() -> None:
    # the planner's layout: sequence parallelism, token-split attention and router, each expert's FFN split;
    # then a tp-2 stage feeding a tp-1 one on the pipeline runtime, ZeRO 3 and recompute on the split stage
    _passes(MOE_SPEC, Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding=_MOE_TOKEN_SPLIT),)))
    # no sequence parallelism: the router's logits for this rank's tokens, gathered
    plain = {"input_norm": "replicate", "post_attention_norm": "replicate", "router": "sequence"}
    _passes(MOE_SPEC, Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), tp=2, zero=3, recompute=True,
                                                           sharding=plain), _stage((2, 4), (2,)))))


@pytest.mark.slow
def test_whole_experts_on_each_ranks_tokens_sum_their_gradients_once() -> None:
    # the three expert weights are one module: listed once among the token-split modules whose gradients sum
    whole = {"router": "sequence", "experts.gate": "sequence", "experts.up": "sequence", "experts.down": "sequence"}
    _passes(MOE_SPEC, Plan(stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding=whole),)))


@pytest.mark.slow
def test_moe_stages_of_uneven_replicas_and_zero3_match_one_process() -> None:
    pipelined = Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), dp=2, zero=1, recompute=True),
                                              _stage((2, 4), (2,))))
    report = verify(MOE_SPEC, pipelined)  # the pipeline runtime: a dp-2 stage hands its samples to a dp-1 one
    assert report.passed, report.message
    report = verify(MOE_SPEC, Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), dp=2, zero=3),)))
    assert report.passed, report.message


def test_shares_that_give_fractions_of_samples_are_refused(gpt_spec: str, tmp_path: Path) -> None:
    plan = Plan(stages=(_stage(ONE_STAGE, (0, 1), dp=2, batch_shares=(0.7, 0.3)),))
    with pytest.raises(ExportError, match=r"global_batch=4: stages\[0\]: .*2\.8, 1\.2 samples each; every "
                                          r"replica needs a whole number"):
        write_torch_program(gpt_spec, plan, tmp_path, seq_len=16, global_batch=4)
    assert not (tmp_path / "plan.json").exists()
    write_torch_program(gpt_spec, plan, tmp_path, seq_len=16, global_batch=10)  # 7 and 3 samples
    cfg = json.loads((tmp_path / "plan.json").read_text())
    assert cfg["runtime"] == "pipeline" and cfg["ranks"][1]["device"] == 1


def test_every_inexpressible_feature_is_listed(gpt_spec: str) -> None:
    plan = Plan(schedule="1f1b", micro_batches=1, stages=(
        _stage((0, 2), (0, 1), tp=2, sharding={"mlp.fc1": "batch", "mlp.fc2": "sequence", "attn.qq": "column"}),
        _stage((2, 4), (2, 3), dp=2)))
    with pytest.raises(ExportError) as err:
        check_expressible(plan, load_model(gpt_spec))
    message = str(err.value)
    assert "stages[0].sharding['mlp.fc1']='batch': the program runs a gpt, llama or moe matmul as column, row, " \
           "replicate or sequence" in message
    assert "sharding['mlp.fc2']" not in message  # a token-split matmul runs (export.tp_flow)
    assert "names op 'attn.qq', which no layer of the model has" in message
    shared = {"mlp.fc1": "column", "final_norm": "sequence"}  # one dict for both stages, as `simulate` takes it
    check_expressible(Plan(schedule="1f1b", micro_batches=2, stages=(
        _stage((0, 2), (0, 1), tp=2, sharding=shared), _stage((2, 4), (2, 3), tp=2, sharding=shared))),
        load_model(gpt_spec))
    assert "dp=2" not in message and "micro_batches" not in message  # the pipeline runtime runs those


def test_heads_must_split_over_tp() -> None:
    spec = "llama?layers=2&hidden=64&heads=4&kv_heads=1&vocab=128"
    plan = Plan(stages=(_stage(ONE_STAGE, (0, 1), tp=2),))
    with pytest.raises(ExportError, match="tp=2 must divide heads=4 and kv_heads=1"):
        check_expressible(plan, load_model(spec), config=model_config(spec, seq_len=16))


def test_written_program_carries_resolved_megatron_strategies(gpt_spec: str, tmp_path: Path) -> None:
    plan = Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), tp=2, recompute=True),
                                         _stage((2, 4), (2, 3), tp=2, zero=3)))
    train = write_torch_program(gpt_spec, plan, tmp_path, seq_len=16, global_batch=4)
    assert train == tmp_path / PROGRAM_NAME == tmp_path / "train.py"
    assert train.read_text() == PROGRAM_SOURCE.read_text() and PROGRAM_SOURCE.name == "runtime_train.py"
    py_compile.compile(str(train), doraise=True)
    cfg = json.loads((tmp_path / "plan.json").read_text())
    assert cfg["mesh"] == {"pp": 2, "dp": 1, "tp": 2} and cfg["sequence_parallel"] is True
    assert cfg["stages"][0]["strategies"]["0"] == {"wte": "row", "wpe": "sequence"}
    assert cfg["stages"][0]["strategies"]["1"]["attn.q"] == "column"
    assert cfg["stages"][0]["strategies"]["1"]["attn.o"] == "row"
    assert cfg["stages"][1]["strategies"]["3"] == {"lm_head.tied": "column"}
    assert cfg["stages"][0]["strategies"]["1"]["attn.sdpa"] == "heads"  # what q, k and v hand on to
    assert cfg["tied_split_alike"] is True  # a row-split table and a column-split head hold matching pieces
    assert cfg["loss_split"] == "vocab"  # the column head's logits stay split over the vocabulary
    assert cfg["stages"][1]["zero"] == 0  # dp == 1: nothing to shard over
    assert cfg["runtime"] == "mesh" and cfg["dtype"] == "fp32" and cfg["optimizer"] == "adam"
    with pytest.raises(ExportError, match="global_batch=5: micro_batches=2 does not divide"):
        write_torch_program(gpt_spec, plan, tmp_path, seq_len=16, global_batch=5)


def test_a_wrong_gradient_fails_and_names_its_parameter(gpt_spec: str) -> None:
    small = scaled_down(gpt_spec)
    loss, grads = reference(small, seq_len=16, global_batch=4, micro_batches=2)
    same = _judge(dict(grads), grads, loss, loss, atol=1e-6, rtol=1e-4, times={}, stages={})
    assert same.passed and same.max_abs_error == 0.0
    bad = dict(grads)
    bad["layers.2.mlp.fc2.bias"] = 2 * grads["layers.2.mlp.fc2.bias"]  # a bias added on both tp ranks
    report = _judge(bad, grads, loss, loss, atol=1e-6, rtol=1e-4, times={}, stages={})
    assert not report.passed and report.worst_parameter == "layers.2.mlp.fc2.bias"
    assert "OUTSIDE tolerance" in report.message and "layers.2.mlp.fc2.bias" in report.message


@pytest.mark.slow
def test_tp2_x_dp2_matches_one_process(gpt_spec: str) -> None:
    """GPT-2's vocabulary (50,257) does not split evenly over two ranks: the scaled-down model keeps that (127
    tokens), and the vocabulary-parallel loss reads the whole vocabulary, not a part times the ranks."""
    report = verify(gpt_spec, Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1, 2, 3), dp=2, tp=2),)))
    assert "vocab=127" in report.model_spec
    assert report.passed, report.message
    assert report.max_abs_error < 1e-6 and report.loss == pytest.approx(report.reference_loss, rel=1e-6)
    assert sorted(report.step_time_s) == [0, 1, 2, 3]


@pytest.mark.slow
def test_two_stage_1f1b_matches_and_is_timed(gpt_spec: str, cpu_device: DeviceSpec) -> None:
    plan = Plan(schedule="1f1b", micro_batches=2, stages=(_stage((0, 2), (4,)), _stage((2, 4), (7,))))
    report = verify(gpt_spec, plan)  # the tied head's copy on stage 1 is summed with the embedding's
    assert report.passed, report.message
    assert report.rank_stages == {0: (0,), 1: (1,)}
    comparison = predicted_vs_measured(report, cpu_device)
    assert comparison.predicted_s > 0 and comparison.measured_s == max(report.step_time_s.values())
    assert comparison.ratio == pytest.approx(comparison.measured_s / comparison.predicted_s)


@pytest.mark.slow
def test_fsdp_zero3_with_tp2_and_recompute_matches(gpt_spec: str) -> None:
    plan = Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1, 2, 3), dp=2, tp=2, zero=3, recompute=True),))
    report = verify(gpt_spec, plan)
    assert report.passed, report.message


def test_a_run_stopped_at_its_time_limit_says_so_rather_than_blaming_a_peer(tmp_path: Path) -> None:
    # ranks stopped for time leave their peers failing on closed connections: the limit is the cause
    dump = tmp_path / "verify"
    dump.mkdir()
    (dump / "error_rank1.json").write_text(json.dumps({"rank": 1, "time": 1.0, "op": "layers.3.mlp.experts (row)",
                                                       "error": "Connection closed by peer"}))
    step = {"step": 0, "time_s": 9.0, "stages": [0]}
    runs = [RankRun(0, None, (step,), "", timed_out=True), RankRun(1, 1, (), "closed")]
    report = _compare(dump, runs, 1.0, {}, atol=ATOL, rtol=RTOL)
    assert not report.passed and report.worst_parameter == "(time limit)"
    assert "did not finish within its time limit: 1 of 2 ranks were still running (1 had reported a step)" \
        in report.message and "--timeout-s" in report.message
    runs[0] = RankRun(0, None, (), "")  # stopped after the peer's failure: the peer's error is the cause
    assert "failed on rank 1 in layers.3.mlp.experts (row)" in _compare(dump, runs, 1.0, {}, atol=ATOL,
                                                                        rtol=RTOL).message


@pytest.mark.slow
def test_gpipe_two_stages_of_zero1_replicas_match(gpt_spec: str) -> None:
    plan = Plan(schedule="gpipe", micro_batches=2, stages=(_stage((0, 2), (0, 1), dp=2, zero=1),
                                                           _stage((2, 4), (2, 3), dp=2, zero=1)))
    report = verify(gpt_spec, plan)  # FSDP2 without resharding; tied copies summed across stages
    assert report.passed, report.message


@pytest.mark.slow
def test_interleaved_llama_with_recompute_matches(llama_spec: str) -> None:
    plan = Plan(schedule="interleaved_1f1b", micro_batches=2, stages=tuple(
        _stage((i, i + 1), (i % 2,), recompute=True) for i in range(4)))
    report = verify(llama_spec, plan)
    assert report.passed, report.message
    assert report.rank_stages == {0: (0, 2), 1: (1, 3)}


@pytest.mark.slow
def test_swapped_column_and_row_sharding_runs_with_the_conversions_the_model_charges(gpt_spec: str) -> None:
    # fc1 row slices its whole input and reduces its partial sums for fc2, which gathers nothing and
    # hands the stream an all-to-all of its hidden-split output (export.tp_flow)
    plan = Plan(stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding={"mlp.fc1": "row", "mlp.fc2": "column"}),))
    _passes(gpt_spec, plan)


def test_a_rank_that_fails_is_reported_with_the_op_it_was_in(tmp_path: Path) -> None:
    (tmp_path / "error_rank1.json").write_text(json.dumps(
        {"rank": 1, "time": 2.0, "op": "layers.1.mlp.fc1 (row)", "error": "RuntimeError: shapes cannot be multiplied"}))
    (tmp_path / "error_rank0.json").write_text(json.dumps(
        {"rank": 0, "time": 3.0, "op": "layers.2.attn.q (column)", "error": "peer lost"}))
    runs = [RankRun(0, 1, (), ""), RankRun(1, 1, (), ""), RankRun(2, -9, (), "Killed\n")]
    report = _compare(tmp_path, runs, 1.0, {}, atol=ATOL, rtol=RTOL)
    assert not report.passed and math.isinf(report.max_abs_error)
    assert report.worst_parameter == "layers.1.mlp.fc1 (row)"  # the first error, not its peer's
    assert "failed on rank 1 in layers.1.mlp.fc1 (row): RuntimeError" in report.message
    assert "rank 2 exited with code -9: Killed" in report.message  # a rank that died without a record


# --- the pipeline runtime: stages of different (dp, tp), whole-sample shares ---------------------


def _passes(spec: str, plan: Plan) -> None:
    report = verify(spec, plan)
    assert report.passed, report.message
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-6)


@pytest.mark.slow
def test_dp2_then_dp1_on_three_processes_matches(gpt_spec: str) -> None:
    _passes(gpt_spec, Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), dp=2), _stage((2, 4), (2,)))))


@pytest.mark.slow
def test_tp2_then_tp1_matches(gpt_spec: str) -> None:
    _passes(gpt_spec, Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), tp=2), _stage((2, 4), (2,)))))


@pytest.mark.slow
def test_uneven_shares_three_to_one_match(gpt_spec: str) -> None:
    _passes(gpt_spec, Plan(stages=(_stage(ONE_STAGE, (0, 1), dp=2, batch_samples=(3, 1)),)))


@pytest.mark.slow
def test_uneven_layer_split_from_tp2_to_uneven_replicas_matches(gpt_spec: str) -> None:
    plan = Plan(schedule="gpipe", micro_batches=2, stages=(_stage((0, 3), (0, 1), tp=2),
                                                           _stage((3, 4), (2, 3), dp=2, batch_samples=(3, 1))))
    _passes(gpt_spec, plan)


@pytest.mark.slow
def test_interleaved_chunks_of_different_meshes_with_recompute_match(llama_spec: str) -> None:
    plan = Plan(schedule="interleaved_1f1b", micro_batches=2, stages=(
        _stage((0, 1), (0, 1), tp=2, recompute=True), _stage((1, 2), (2,), recompute=True),
        _stage((2, 3), (0, 1), dp=2, recompute=True), _stage((3, 4), (2,))))
    _passes(llama_spec, plan)


@pytest.mark.slow
def test_readme_tour_plan_shrunk_matches() -> None:
    """The tour's shape (tensor parallelism on the first stage, data parallelism after it) on 4 processes."""
    plan = Plan(micro_batches=2, stages=(_stage((0, 8), (0, 1), tp=2), _stage((8, 26), (2, 3), dp=2)))
    _passes("gpt3-1.3b", plan)


def test_a_partial_recompute_checkpoints_the_stages_first_blocks_only(llama_spec: str) -> None:
    from tagplan.export.modules import Block, set_stage_recompute

    model = build_model(scaled_down(llama_spec), seq_len=16)  # embedding, two blocks, head
    set_stage_recompute(model.layers, True, 1)
    assert [getattr(layer, "recompute", None) for layer in model.layers] == [None, True, False, None]
    set_stage_recompute(model.layers, True, None)
    assert [layer.recompute for layer in model.layers if isinstance(layer, Block)] == [True, True]
    set_stage_recompute(model.layers, False, None)
    assert not any(layer.recompute for layer in model.layers if isinstance(layer, Block))


@pytest.mark.slow
def test_a_partial_recompute_runs_and_matches(llama_spec: str, tmp_path: Path) -> None:
    plan = Plan(schedule="1f1b", micro_batches=2, stages=(_stage((0, 2), (0,), recompute=True, recompute_layers=1),
                                                          _stage((2, 4), (1,), recompute=True, recompute_layers=1)))
    write_torch_program(llama_spec, plan, tmp_path, seq_len=16, global_batch=4)
    assert [s["recompute_layers"] for s in json.loads((tmp_path / "plan.json").read_text())["stages"]] == [1, 1]
    report = verify(llama_spec, plan)
    assert report.passed, report.message


# --- token-split (sequence) matmuls and tied tables split unalike -----------------------------------

_SEQUENCE_MLP = {"attn.o": "sequence", "mlp.fc1": "sequence", "mlp.fc2": "sequence"}


@pytest.mark.slow
def test_token_split_output_projection_and_mlp_match_on_one_mesh(gpt_spec: str) -> None:
    # attn.o takes its heads' output by an all-to-all; the MLP runs on this rank's tokens with whole
    # weights, so it gathers nothing, and its weight gradients are summed over tp once per step
    _passes(gpt_spec, Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding=_SEQUENCE_MLP),)))


@pytest.mark.slow
def test_token_split_projections_feed_split_heads_without_sequence_parallelism(gpt_spec: str) -> None:
    # q, k and v read a slice of the whole stream and hand attention its heads (all-to-all); fc2 reads
    # fc1's hidden split by an all-to-all and hands back the whole stream
    whole = {"ln_1": "replicate", "ln_2": "replicate", "final_norm": "replicate"}
    sharding = {**whole, "attn.q": "sequence", "attn.k": "sequence", "attn.v": "sequence", "mlp.fc2": "sequence"}
    _passes(gpt_spec, Plan(stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding=sharding),)))


@pytest.mark.slow
def test_llama_token_split_stage_then_tp1_on_the_pipeline_runtime(llama_spec: str) -> None:
    sharding = {"attn.o": "sequence", "mlp.gate": "sequence", "mlp.up": "column", "mlp.down": "sequence"}
    _passes(llama_spec, Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), tp=2, sharding=sharding),
                                                      _stage((2, 4), (2,)))))


@pytest.mark.slow
def test_tied_table_split_unalike_across_pipeline_ranks_sums_whole_tables(gpt_spec: str, tmp_path: Path) -> None:
    # the table split by hidden columns on stage 0, the head by vocabulary rows on stage 1 (the mesh runtime)
    plan = Plan(schedule="gpipe", micro_batches=2, stages=(
        _stage((0, 2), (0, 1), tp=2, sharding={"wte": "column"}),
        _stage((2, 4), (2, 3), tp=2, sharding={"lm_head.tied": "column"})))
    write_torch_program(gpt_spec, plan, tmp_path, seq_len=16, global_batch=4)
    cfg = json.loads((tmp_path / "plan.json").read_text())
    assert cfg["runtime"] == "mesh" and cfg["tied_split_alike"] is False
    _passes(gpt_spec, plan)


@pytest.mark.slow
def test_vocabulary_parallel_loss_on_a_last_stage_of_its_own_tp_matches(llama_spec: str, tmp_path: Path) -> None:
    # the pipeline runtime: tp 1 then a tp-2 last stage whose column head keeps half the vocabulary per rank
    plan = Plan(micro_batches=2, stages=(_stage((0, 2), (0,)), _stage((2, 4), (1, 2), tp=2)))
    write_torch_program(llama_spec, plan, tmp_path, seq_len=16, global_batch=4)
    cfg = json.loads((tmp_path / "plan.json").read_text())
    assert cfg["runtime"] == "pipeline" and cfg["loss_split"] == "vocab"
    _passes(llama_spec, plan)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [True, False])
def test_token_split_head_computes_each_ranks_share_of_the_loss(gpt_spec: str, sp: bool, tmp_path: Path) -> None:
    # the tied head on this rank's tokens with the whole table (its gradient summed over tp and then with the
    # embedding's row-split copy, whole tables): the loss is each rank's tokens' share, summed
    norms = {} if sp else {"ln_1": "replicate", "ln_2": "replicate", "final_norm": "replicate"}
    sharding = {**norms, "lm_head.tied": "sequence"}
    plan = Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding=sharding),))
    write_torch_program(gpt_spec, plan, tmp_path, seq_len=16, global_batch=4)
    cfg = json.loads((tmp_path / "plan.json").read_text())
    assert cfg["loss_split"] == "tokens" and cfg["tied_split_alike"] is False
    _passes(gpt_spec, plan)


@pytest.mark.slow
def test_token_split_head_on_a_pipelined_last_stage_matches(llama_spec: str) -> None:
    plan = Plan(schedule="gpipe", micro_batches=2, stages=(
        _stage((0, 2), (0, 1), tp=2), _stage((2, 4), (2, 3), tp=2, sharding={"lm_head": "sequence"})))
    _passes(llama_spec, plan)  # the mesh runtime: torch's pipelining schedule calls the loss


def test_token_split_matmuls_need_a_sequence_the_tp_ranks_split_evenly(gpt_spec: str, tmp_path: Path) -> None:
    norms = {"ln_1": "replicate", "ln_2": "replicate", "final_norm": "replicate"}
    plan = Plan(stages=(_stage(ONE_STAGE, (0, 1, 2), tp=3, sharding={**norms, "mlp.fc1": "sequence"}),))
    with pytest.raises(ExportError, match=r"seq_len=16 does not split over stages\[0\]\.tp=3 ranks: matmuls "
                                          r"\['mlp.fc1'\] are token-split"):
        write_torch_program("gpt?layers=2&hidden=48&heads=3&vocab=128&max_positions=16", plan, tmp_path, seq_len=16,
                            global_batch=3)


@pytest.mark.slow
def test_the_planners_best_plan_on_a_mixed_cluster_runs_and_matches_one_process() -> None:
    # the planner's own answer on three V100 nodes and a T4 node (bench/planner.py's case): stages of
    # different tp and dp, token-split matmuls, a tied table split unalike; 12 gloo processes
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.ir.workload import Workload
    from tagplan.search.planner import plan
    from tagplan.search.problem import PlanProblem

    model = load_model("gpt3-1.3b", seq_len=1024)
    best = plan(PlanProblem(model, load_cluster("p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1"),
                            Workload(global_batch=32, seq_len=1024), max_evaluations=400, budget_s=30)).best.plan
    assert len({(s.tp, s.dp) for s in best.stages}) > 1  # heterogeneous, as the planner answers today
    check_expressible(best, model)
    _passes("gpt3-1.3b", best)


@pytest.mark.slow
def test_a_row_heads_partial_logits_are_reduce_scattered_over_the_tokens_for_the_loss(llama_spec: str,
                                                                                       tmp_path: Path) -> None:
    # as cost.sharding.loss_layout charges: partial sums reduce-scattered, each rank its tokens' share
    plan = Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), tp=2, sharding={"lm_head": "row"}),))
    write_torch_program(llama_spec, plan, tmp_path, seq_len=16, global_batch=4)
    assert json.loads((tmp_path / "plan.json").read_text())["loss_split"] == "tokens"
    _passes(llama_spec, plan)


@pytest.mark.slow
def test_the_fused_loss_matches_one_process_over_a_vocabulary_split_and_a_pipeline(gpt_spec: str,
                                                                                    tmp_path: Path) -> None:
    """plan.json's "loss": "fused" runs `runtime_loss.FusedCrossEntropy`: a head split by vocabulary over tp (its
    collectives in the forward) and a pipeline's last stage both match the one-process eager reference."""
    split = Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), tp=2),))
    report = verify(gpt_spec, split, loss=LossKernel.FUSED, keep_dir=tmp_path / "split")
    assert report.passed, report.message
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-6)
    written = json.loads((tmp_path / "split" / "plan.json").read_text())
    assert written["loss"] == "fused" and written["loss_split"] == "vocab"
    pipeline = Plan(schedule="1f1b", micro_batches=2, stages=(_stage((0, 2), (0,)), _stage((2, 4), (1,))))
    report = verify(gpt_spec, pipeline, loss=LossKernel.FUSED)
    assert report.passed, report.message
    # stages of unlike tp run the program's own pipeline runtime, its last stage's vocabulary split over two
    # ranks; GPT-2's 50,257 tokens do not split evenly over them, nor does the scaled-down model's 127
    uneven = Plan(schedule="1f1b", micro_batches=2, stages=(_stage((0, 2), (0,)), _stage((2, 4), (1, 2), tp=2)))
    report = verify(gpt_spec, uneven, loss=LossKernel.FUSED, keep_dir=tmp_path / "uneven")
    assert report.passed, report.message
    written = json.loads((tmp_path / "uneven" / "plan.json").read_text())
    assert written["runtime"] == "pipeline" and written["loss_split"] == "vocab"
    assert "vocab=127" in report.model_spec
    # two stages of tp 2 run the mesh runtime's pipelining schedule, whose last stage declares its uneven part
    mesh = Plan(schedule="1f1b", micro_batches=2, stages=(_stage((0, 2), (0, 1), tp=2), _stage((2, 4), (2, 3), tp=2)))
    for loss in (LossKernel.EAGER, LossKernel.FUSED):
        report = verify(gpt_spec, mesh, loss=loss, keep_dir=tmp_path / f"mesh-{loss.value}")
        assert report.passed, report.message
        assert json.loads((tmp_path / f"mesh-{loss.value}" / "plan.json").read_text())["runtime"] == "mesh"


@pytest.mark.slow
def test_two_launches_on_one_port_at_once_each_meet_in_their_own_store(gpt_spec: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two local launches that picked the same free port at once: the ranks meet through a store file of their
    launch (TAGPLAN_RENDEZVOUS), not the TCP store on the port, so neither takes the other's ranks."""
    from concurrent.futures import ThreadPoolExecutor

    from tagplan.export import runtime_launch

    monkeypatch.setattr(runtime_launch, "free_port", lambda: 29517)
    plan = Plan(micro_batches=2, stages=(_stage(ONE_STAGE, (0, 1), dp=2),))
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda _: verify(gpt_spec, plan), range(2)))
    for report in reports:
        assert report.passed, report.message


def test_verify_keeps_a_vocabulary_split_uneven_where_the_model_has_one() -> None:
    from tagplan.export.verify import _vocab_for

    gpt2 = model_config("gpt3-1.3b", seq_len=16)  # 50,257 tokens: tp 2 splits them unevenly
    assert gpt2.vocab % 2 == 1
    one, two = _stage((0, 4), (0,)), _stage((0, 4), (0, 1), tp=2)
    assert _vocab_for(gpt2, Plan(micro_batches=1, stages=(one,))) == 128
    assert _vocab_for(gpt2, Plan(micro_batches=1, stages=(two,))) == 127
    llama = model_config("llama2-7b", seq_len=16)  # 32,000: every tp here divides it
    assert _vocab_for(llama, Plan(micro_batches=1, stages=(two,))) == 128
