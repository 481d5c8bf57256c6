"""Which plans each export format runs (tagplan.export.capability.exportable)."""

from __future__ import annotations

import pytest

from tagplan.export import exportable
from tagplan.export.capability import model_refusal
from tagplan.export.checks import ExportError
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model, parse_model_spec
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType, LossKernel, Workload

HETERO = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2),
                                       Stage(layers=(2, 4), devices=(2, 3), dp=2)))


def test_torch_runs_heterogeneous_stages_that_megatron_and_deepspeed_refuse() -> None:
    assert exportable(HETERO, "torch") is None
    assert "stages[1].tp = 1 but stages[0].tp = 2" in (exportable(HETERO, "megatron") or "")
    assert "stages[0].tp = 2: DeepSpeed's pipeline engine has no tensor parallelism" in (
        exportable(HETERO, "deepspeed") or "")


def test_the_global_batch_adds_the_whole_sample_rule() -> None:
    assert exportable(HETERO, "torch", global_batch=8) is None
    reason = exportable(HETERO, "torch", global_batch=6)  # 3 samples per micro-batch over 2 replicas
    assert reason is not None and "stages[1]" in reason and "whole" in reason


def test_a_model_adds_the_model_checks() -> None:
    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    bad = Plan(stages=(Stage(layers=(0, 4), devices=(0, 1), tp=2, sharding={"mlp.fc1": "batch"}),))
    assert "sharding['mlp.fc1']='batch'" in (exportable(bad, "torch", model) or "")
    assert exportable(bad, "torch") is None  # without the model, no op is checked
    uniform = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2),
                                            Stage(layers=(2, 4), devices=(2, 3), tp=2)))
    assert exportable(uniform, "megatron", model) is None
    assert "tensor parallelism" in (exportable(uniform, "deepspeed", model) or "")
    with pytest.raises(ValueError, match="unknown export format"):
        exportable(uniform, "jax")


def test_the_cluster_lets_megatron_and_deepspeed_start_the_pipeline_on_any_node() -> None:
    """The planner's `--exportable` asks with the cluster: a plan whose first stage sits on the second
    node runs (that node is launched first); without the cluster it is refused."""
    cluster = load_cluster("p3.8xlarge:nodes=2")
    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    late = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(4, 5, 6, 7), dp=4),
                                         Stage(layers=(2, 4), devices=(0, 1, 2, 3), dp=4)))
    for fmt in ("megatron", "deepspeed"):
        assert "pipeline rank 0 runs on devices [4, 5, 6, 7]" in (exportable(late, fmt, model) or "")
        assert exportable(late, fmt, model, global_batch=8, cluster=cluster) is None


def test_the_verdicts_name_every_format_and_each_refusal() -> None:
    from tagplan.export.capability import TARGETS, verdicts

    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=5000", seq_len=16)
    said = verdicts(HETERO, model, Workload(global_batch=8, seq_len=16))
    assert list(said) == list(TARGETS)
    assert said["torch"] is None  # the pipeline runtime takes a different (dp, tp) per stage
    assert "stages[1].tp = 1 but stages[0].tp = 2" in (said["megatron"] or "")
    t5 = load_model("t5?layers=2&hidden=64&heads=4&vocab=100", seq_len=16)
    assert "is of family 't5'" in (verdicts(HETERO, t5, Workload(global_batch=8, seq_len=16))["torch"] or "")
    odd = Workload(global_batch=6, seq_len=16)  # 3 samples per micro-batch over 2 replicas: nobody runs it
    assert all(verdicts(HETERO, model, odd).values())
    # a gradient reduction the runtime cannot run is its refusal too (the torch program reduces in fp32 only)
    bf16 = verdicts(HETERO, model, Workload(global_batch=8, seq_len=16, grad_reduce_dtype=DType.BF16))
    assert "grad_reduce_dtype=bf16" in (bf16["torch"] or "")


def test_the_verdicts_of_a_family_model_import_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "from tagplan.export.capability import verdicts\n"
            "from tagplan.frontends.model_spec import load_model, parse_model_spec\n"
            "from tagplan.ir.plan import Plan, Stage\n"
            "spec = 'gpt?layers=2&hidden=64&heads=4&vocab=5000'\n"
            "plan = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), tp=2), "
            "Stage(layers=(2, 4), devices=(2, 3), dp=2)))\n"
            "from tagplan.ir.workload import Workload\n"
            "said = verdicts(plan, load_model(spec, seq_len=16), Workload(global_batch=8, seq_len=16), "
            "spec=parse_model_spec(spec))\n"
            "assert said['torch'] is None, said\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # every `tagplan plan` asks; building the program is what needs torch


def test_the_workload_a_runtime_runs_reduces_gradients_as_that_runtime_does() -> None:
    from tagplan.export.capability import runtime_workload
    from tagplan.ir.workload import DType, Workload

    bf16, fp16 = Workload(dtype=DType.BF16), Workload(dtype=DType.FP16)
    # the torch program: autocast over fp32 master weights, so fp32 gradients
    assert runtime_workload("torch", bf16).grad_reduce_dtype is DType.FP32
    assert runtime_workload("torch", fp16).grad_reduce_dtype is DType.FP32
    # Megatron forces fp32 reduction with bf16 only; DeepSpeed reduces in the compute dtype
    assert runtime_workload("megatron", bf16).grad_reduce_dtype is DType.FP32
    assert runtime_workload("megatron", fp16).grad_reduce_dtype is None
    assert runtime_workload("deepspeed", bf16).grad_reduce_dtype is None
    # only Megatron-Core overlaps TP collectives with compute
    overlapped = bf16.model_copy(update={"tp_comm_overlap": True})
    assert runtime_workload("megatron", overlapped).tp_comm_overlap is True
    assert runtime_workload("torch", overlapped).tp_comm_overlap is False
    assert runtime_workload("deepspeed", overlapped).tp_comm_overlap is False
    # what the user set stays
    told = bf16.model_copy(update={"grad_reduce_dtype": DType.BF16})
    with pytest.raises(ExportError, match="grad_reduce_dtype=bf16"):  # the torch program reduces in fp32 only
        runtime_workload("torch", told)
    assert runtime_workload("megatron", told).grad_reduce_dtype is DType.BF16
    # Megatron-Core (bias_swiglu_impl) fuses the gated MLP's activation, and so does the torch program
    # (modules._GatedProduct) where it builds the model itself, not for a Hugging Face class or a user module
    from tagplan.frontends.model_spec import parse_model_spec

    assert runtime_workload("megatron", bf16).fused_activation is True
    assert runtime_workload("torch", bf16, parse_model_spec("llama3-8b")).fused_activation is True
    assert runtime_workload("torch", bf16, parse_model_spec("llama?layers=2&hidden=64&heads=2")).fused_activation
    assert runtime_workload("torch", bf16, parse_model_spec("hf:LlamaConfig?hidden_size=64")).fused_activation is False
    assert runtime_workload("torch", bf16).fused_activation is False  # model unknown: as kept op by op
    assert runtime_workload("deepspeed", bf16, parse_model_spec("llama3-8b")).fused_activation is False
    # the torch program runs its modules op by op under autocast over fp32 weights, whatever was asked;
    # Megatron-Core's kernels are fused; DeepSpeed runs the user's modules as the workload says
    assert not bf16.eager and not runtime_workload("megatron", bf16).eager
    assert runtime_workload("torch", bf16).eager and not runtime_workload("deepspeed", bf16).eager
    sixteen = bf16.model_copy(update={"eager": True, "eager_16bit_weights": True})
    assert runtime_workload("torch", sixteen).autocast and not runtime_workload("torch", sixteen).eager_16bit_weights
    assert runtime_workload("deepspeed", sixteen).eager_16bit_weights
    assert not runtime_workload("megatron", sixteen).eager
    # the loss as each runs it: Megatron-Core its own in-place one, or Transformer Engine's fused one where asked (the
    # exporter writes it); the torch program its own fused one where asked, else eager; DeepSpeed the model's, eager
    for asked in LossKernel:
        stated = bf16.model_copy(update={"loss": asked})
        fused = asked is LossKernel.FUSED
        assert runtime_workload("megatron", stated).loss is (LossKernel.FUSED if fused else LossKernel.IN_PLACE)
        assert runtime_workload("torch", stated).loss is (LossKernel.FUSED if fused else LossKernel.EAGER)
        assert runtime_workload("deepspeed", stated).loss is LossKernel.EAGER
    # DeepSpeed's pipeline engine keeps each micro-batch's stage output until its backward; the others free it
    assert runtime_workload("deepspeed", bf16).keeps_stage_outputs
    assert not any(runtime_workload(fmt, bf16).keeps_stage_outputs for fmt in ("torch", "megatron"))
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        runtime_workload("onnx", bf16)


def test_megatron_fp8_runs_set_bf16_and_so_reduce_in_fp32() -> None:
    from tagplan.export.capability import runtime_workload
    from tagplan.ir.workload import DType, Workload

    assert runtime_workload("megatron", Workload(dtype=DType.FP8)).grad_reduce_dtype is DType.FP32
    with pytest.raises(ValueError, match="grad_reduce_dtype 'fp8'"):
        Workload(grad_reduce_dtype=DType.FP8)


def test_each_runtime_says_which_stages_reduce_while_their_backward_runs() -> None:
    from tagplan.export.capability import reduce_overlap
    from tagplan.ir.workload import Workload

    pipelined = Plan(micro_batches=2, stages=(Stage(layers=(0, 2), devices=(0, 1), dp=2, zero=1),
                                              Stage(layers=(2, 4), devices=(2, 3), dp=2, zero=1)))
    single = Plan(micro_batches=2, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), dp=4, zero=1),))
    overlapped, after = Workload(), Workload(grad_reduce_overlap=False)
    assert reduce_overlap("megatron", overlapped) is None  # its arguments follow the workload
    deepspeed = reduce_overlap("deepspeed", overlapped)
    assert deepspeed is not None
    assert deepspeed(pipelined) == {0: False, 1: False}  # the pipeline engine reduces after the flush
    assert deepspeed(single) == {0: True}  # ZeRO's overlap_comm
    assert deepspeed(single.model_copy(update={"stages": (single.stages[0].model_copy(update={"zero": 0}),)})) == {
        0: False}
    told = reduce_overlap("deepspeed", after)
    assert told is not None and told(single) == {0: False}  # written as overlap_comm false
    torch = reduce_overlap("torch", overlapped)
    assert torch is not None
    assert torch(single) == {0: True}  # one pipeline rank: FSDP2/replicate hooks
    assert torch(pipelined) == {0: False, 1: False}  # reduced after the step's program
    with pytest.raises(ValueError, match="unknown export format"):
        reduce_overlap("jax", overlapped)


def test_the_torch_program_runs_fused_attention_on_every_device() -> None:
    from tagplan.export.capability import runtime_workload
    from tagplan.ir.workload import Workload

    assert runtime_workload("torch", Workload()).fused_attention is True
    assert runtime_workload("megatron", Workload()).fused_attention is None  # each device's own
    assert runtime_workload("torch", Workload(fused_attention=False)).fused_attention is False  # said outright


def test_a_format_refuses_a_model_family_it_cannot_build_whatever_the_plan() -> None:
    t5 = load_model("t5?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    gpt = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    assert "model family 't5' is not exported" in (model_refusal("megatron", t5) or "")
    assert "of family 't5'" in (model_refusal("torch", t5, parse_model_spec("t5?layers=2&hidden=64&heads=4&vocab=128"))
                                or "")
    assert "family 't5'" in (model_refusal("torch", t5) or "")  # no SPEC: the graph's own family
    assert model_refusal("deepspeed", t5) is None  # its config describes the parallelism, not the model
    fp8 = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16, dtype=DType.FP8)
    assert "dtype fp8: DeepSpeed's config has no quantized GEMMs" in (model_refusal("deepspeed", fp8) or "")  # at once
    assert all(model_refusal(fmt, gpt) is None for fmt in ("torch", "megatron", "deepspeed"))
    moe = "moe?layers=2&hidden=64&heads=4&kv_heads=2&vocab=128&experts=4&top_k=2&ffn=96"
    assert model_refusal("torch", load_model(moe, seq_len=16), parse_model_spec(moe)) is None  # at tp 1
    with pytest.raises(ValueError, match="unknown export format"):
        model_refusal("jax", gpt)


def test_the_torch_verdict_holds_every_check_its_exporter_makes() -> None:
    """What `export --format torch` refuses, the verdict refuses too: a sequence that does not split over a
    sequence-parallel stage's tp ranks, and a quantized recipe (the program runs bf16/fp16 autocast)."""
    from tagplan.export.capability import verdicts

    plan = Plan(micro_batches=1, stages=(Stage(layers=(0, 4), devices=(0, 1, 2, 3), tp=4),))
    odd = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=18)
    assert "seq_len=18 does not split over stages[0].tp=4" in (exportable(plan, "torch", odd) or "")
    even = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16)
    assert exportable(plan, "torch", even) is None
    fp8 = load_model("gpt?layers=2&hidden=64&heads=4&vocab=128", seq_len=16, dtype=DType.FP8)
    found = verdicts(plan, fp8, Workload(global_batch=4, seq_len=16, dtype=DType.FP8))
    assert "dtype fp8: the torch program runs bf16/fp16 autocast" in (found["torch"] or "")
    assert verdicts(plan, even, Workload(global_batch=4, seq_len=16))["torch"] is None


def test_where_no_format_runs_the_best_plan_a_note_names_the_fastest_reported_plan_one_does() -> None:
    from dataclasses import replace

    from tagplan.export.capability import runnable_note
    from tagplan.search.planner import plan
    from tagplan.search.problem import PlanProblem

    model = load_model("gpt?layers=4&hidden=256&heads=4&vocab=500", seq_len=128)
    result = plan(PlanProblem(model, load_cluster("p3.8xlarge"), Workload(global_batch=8, seq_len=128),
                              max_evaluations=40))
    assert len(result.pareto) >= 2
    refused = {"torch": "no", "megatron": "no"}
    times = [c.report.iteration_time_s for c in result.pareto]
    order = sorted(range(len(times)), key=times.__getitem__)
    slow, fast = order[-1], order[1]  # the fastest plan stays refused
    pareto = tuple({"torch": "no", "megatron": None} if i in (slow, fast) else refused for i in range(len(times)))
    judged = replace(result, exporters=refused, pareto_exporters=pareto, baseline_exporters={})
    note = runnable_note(judged, "--exportable")
    assert note is not None and note.startswith(f"the fastest reported plan a format runs is pareto {fast}: "
                                                f"{times[fast]:.4g} s as costed here")
    assert note.endswith("under megatron; --exportable megatron searches for the fastest plan megatron runs, costed "
                         "as its runtime runs it")
    assert "--exportable" not in (runnable_note(judged) or "")  # the service has no such option
    none_runs = replace(judged, pareto_exporters=tuple(refused for _ in times))
    assert runnable_note(none_runs) == "no reported plan runs under torch, megatron"
    assert runnable_note(replace(judged, exporters={"torch": None, "megatron": "no"})) is None  # the best one runs
