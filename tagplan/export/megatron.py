"""Megatron-LM arguments for a plan: the `pretrain_gpt.py` flags that run the same parallel layout.

Megatron-LM runs one (tp, dp) mesh for the whole model, ranks ordered tp fastest, then dp, then
pp; the token embedding sits on the first pipeline stage and the output head on the last, next to
their transformer layers. A plan maps onto it when every stage has the same tp and dp with even
batch shares, the stages sit on ranks in that order (with the cluster, its nodes are launched in the
plan's rank order, so the first stage may sit on any node: `launch_node{k}.sh` per node, GPUs pinned
to ranks), and the transformer layers per stage are
even except on the first and last stage (`--decoder-first/last-pipeline-num-layers`, at least one
layer each); any other split, interleaved chunks included, is written as Megatron-Core's
`--pipeline-model-parallel-layout`. Interleaved plans with the same number of layers in every chunk
map onto virtual stages (`--num-layers-per-virtual-pipeline-stage`). Recomputation maps to full, uniform recomputation
of every layer (`--recompute-num-layers 1`: keep each layer's input, as the plan's `recompute`
means), a partial one (`recompute_layers` N on every stage that holds more than N layers) to
`--recompute-method block --recompute-num-layers N`, ZeRO-1 to the distributed optimizer, and
ZeRO-2/3 without pipelining to Megatron FSDP
(`--use-megatron-fsdp` with `--data-parallel-sharding-strategy optim_grads` / `optim_grads_params`
and the flags Megatron-Core's Megatron-FSDP user guide requires: `--no-gradient-accumulation-fusion`,
`--use-distributed-optimizer`, `--ckpt-format fsdp_dtensor`; its launcher leaves
CUDA_DEVICE_MAX_CONNECTIONS unset, which Megatron asserts under FSDP). Anything else is refused with
the reason: GPipe (Megatron has only 1F1B schedules), ZeRO-2/3 with pipelining (Megatron FSDP's
documentation covers TP, EP and CP, not pipeline parallelism), recomputation on
some stages only or different partial counts (Megatron's `--recompute-num-layers` applies the same count
on every stage),
per-op shardings other than Megatron's, and model families other than GPT, Llama and MoE.

Gradient reduction as costed (`grad_reduce`): `--overlap-grad-reduce` (and, with the distributed
optimizer, `--overlap-param-gather`) when `grad_reduce_overlap` and dp > 1; `grad_reduce_dtype`
fp32 -> `--accumulate-allreduce-grads-in-fp32`, bf16 over bf16 (or fp8) training ->
`--grad-reduce-in-bf16`, fp16 over fp16 training -> Megatron's default. Left open (None), Megatron
reduces bf16 and fp8 runs in fp32 (it sets `--accumulate-allreduce-grads-in-fp32` itself) and the
others in their own dtype; any other pairing is refused (Megatron reduces in the parameters' dtype
or fp32).

Tensor-parallel communication as costed: `--tp-comm-overlap` (Transformer Engine's userbuffer
overlap of the TP collectives with the GEMMs beside them; it needs `--sequence-parallel`, which every
tp > 1 export sets) when the plan was costed with `Workload.tp_comm_overlap` and tp > 1. On a
cluster it is refused where the userbuffers cannot run (`tp_overlap_refusal`): a tensor-parallel group
across nodes or over PCIe, or on GPUs before sm80.

The loss as costed (`Workload.loss`): Megatron-Core's own cross-entropy is the in-place one (it keeps the fp32
softmax and turns it into the gradient), which an eager or in-place costing describes (an eager one keeps more);
a fused costing writes `--cross-entropy-loss-fusion --cross-entropy-fusion-impl te` (Transformer Engine's
kernel, which keeps the 16-bit logits and writes the gradient over them; Megatron-Core's native fused kernel
still upcasts, and is the in-place loss in memory).

The flag spellings follow NVIDIA/Megatron-LM `megatron/training/arguments.py`; the simulator's
assumptions (sequence parallelism with TP, the costed gradient reduction) are switched on so the
run matches the prediction.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from tagplan.cost.sharding import default_strategies
from tagplan.errors import SpecError
from tagplan.export.checks import (
    ExportError,
    GradReduce,
    check_rank_order,
    check_reduce_dtype,
    micro_batch_size,
    reduce_dtype_note,
    refuse,
    uniform_mesh,
    validate,
)
from tagplan.export.node_launch import clear_launch_files, fixed_rank_table, launch_scripts, record_launch_files
from tagplan.export.shapes import ffn_width, transformer_shape
from tagplan.frontends.families import TransformerShape
from tagplan.frontends.model_spec import ModelSpec
from tagplan.ir.cluster import Cluster, DeviceSpec, LinkKind
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule, context_split_whole
from tagplan.ir.workload import DType, LossKernel

FMT = "megatron"
DECODER_FAMILIES = ("gpt", "llama", "moe")  # the families pretrain_gpt.py builds
_EDGE_KINDS = ("embedding", "head")
# The quantized recipes as costed: Transformer Engine's GEMMs on cast copies with bf16 elsewhere. fp8: per-tensor
# delayed scaling (Megatron's default --fp8-recipe), E4M3 forward and E5M2 gradients; fp8-cs: per-tensor current
# scaling; mxfp8: E4M3 with 32-element block scales; nvfp4: E2M1 with 16-element block scales.
_DTYPE_FLAG = {DType.BF16: ["--bf16"], DType.FP16: ["--fp16"], DType.FP32: [],
               DType.FP8: ["--bf16", "--fp8-format", "hybrid"],
               DType.FP8_CS: ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
               DType.MXFP8: ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"],
               DType.NVFP4: ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]}
# per training dtype: the dtype Megatron reduces gradients in when not told, and those it can be told
_REDUCE_DEFAULT = {**{d: DType.FP32 for d in DType if d.quantized}, DType.BF16: DType.FP32,
                   DType.FP16: DType.FP16, DType.FP32: DType.FP32}
_REDUCE_FLAG: dict[DType, dict[DType, list[str]]] = {
    DType.BF16: {DType.FP32: ["--accumulate-allreduce-grads-in-fp32"], DType.BF16: ["--grad-reduce-in-bf16"]},
    DType.FP16: {DType.FP32: ["--accumulate-allreduce-grads-in-fp32"], DType.FP16: []},
    DType.FP32: {DType.FP32: ["--accumulate-allreduce-grads-in-fp32"]},
}
_REDUCE_FLAG.update({d: _REDUCE_FLAG[DType.BF16] for d in DType if d.quantized})  # quantized runs are --bf16 runs


def model_config_from_spec(spec: str | ModelSpec) -> dict[str, Any]:
    """`{"family": ..., **TransformerShape fields}` of a zoo name or `family?key=value` SPEC;
    `hf:LlamaConfig?...` and `hf:GPT2Config?...` map to the llama and gpt shapes
    (`tagplan.export.shapes`); ExportError for graph files and user modules, whose shapes are not
    known here; SpecError for other Hugging Face configs and bad SPECs."""
    found = transformer_shape(spec)
    if found is None:
        text = spec.text if isinstance(spec, ModelSpec) else spec
        raise refuse(FMT, f"model {text!r} is not a zoo name, FAMILY?key=value or hf:LlamaConfig/GPT2Config SPEC, so "
                          "its transformer shape (layers, hidden, heads, ffn, vocab) is not known; pass model_config")
    family, shape = found
    return {"family": family, **asdict(shape)}


def megatron_arguments(model: ModelGraph, plan: Plan, *, global_batch: int, seq_len: int,
                       model_config: dict[str, Any] | None = None, grad_reduce_dtype: DType | None = None,
                       grad_reduce_overlap: bool = True, tp_comm_overlap: bool = False,
                       loss: LossKernel = LossKernel.EAGER, cluster: Cluster | None = None) -> list[str]:
    """The Megatron-LM command-line arguments (flags and values, in order) that run `plan`
    (launched on `cluster`'s nodes in the plan's rank order when given, `rank_order`).

    `model_config` is `model_config_from_spec`'s dict (None: derived from `model.name`, which is
    the SPEC for zoo and parametric models). `grad_reduce_dtype` and `grad_reduce_overlap`: the
    gradient reduction as costed (None: Megatron's own dtype); `tp_comm_overlap`: the TP collectives
    as costed (`Workload.tp_comm_overlap`); `loss`: the cross-entropy as costed (`Workload.loss`: fused writes
    Transformer Engine's; the others run Megatron-Core's own, which keeps no more than they were costed with).
    ExportError when Megatron-LM cannot express the plan or the reduction.
    """
    validate(plan, model, cluster)
    check_reduce_dtype(grad_reduce_dtype)
    reduce_args = reduce_dtype_args(model.dtype, grad_reduce_dtype)
    family, shape = _shape(model, model_config)
    if seq_len != model.seq_len:
        raise refuse(FMT, f"seq_len={seq_len} but the model graph was built at {model.seq_len} tokens")
    dp, tp = plan_checks(plan, cluster, tp_comm_overlap=tp_comm_overlap, model=model)
    if cluster is not None and (why := quantized_refusal(plan, cluster, model.dtype)):
        raise refuse(FMT, why)
    pp, chunks = _pipeline_depth(plan)
    _check_sharding(model, plan)
    counts = _layer_counts(model, plan, shape)
    _check_divisible(family, shape, tp, seq_len)
    mbs = micro_batch_size(plan, global_batch, dp, FMT)
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    cp = plan.stages[0].cp
    if cp > 1:
        if not context_split_whole(seq_len, cp, tp):
            raise refuse(FMT, f"stages[0].cp = {cp} with seq_len {seq_len} and tp {tp}: Megatron's context parallelism "
                              f"splits each sequence into 2 * cp = {2 * cp} chunks (load-balanced causal attention), "
                              "and sequence parallelism splits each rank's seq_len / cp tokens over tp; pick a cp "
                              "whose 2 * cp divides the sequence length and whose share tp divides")
        args += ["--context-parallel-size", str(cp)]
    args += _split_args(counts, pp, chunks)
    if tp > 1:
        args.append("--sequence-parallel")  # the cost model's TP layout (tagplan.cost.sharding.BOUNDARY)
        if tp_comm_overlap:
            args.append("--tp-comm-overlap")  # as costed (cost.stage_cost.exposed_tp_s); needs --sequence-parallel
    args += _model_args(family, shape, seq_len)
    args += ["--micro-batch-size", str(mbs), "--global-batch-size", str(global_batch)]
    args += _recompute_args(plan, model)
    if loss is LossKernel.FUSED:  # Transformer Engine's kernel keeps the 16-bit logits, as costed
        args += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]
    args += _optimizer_args(plan, dp, overlap=grad_reduce_overlap)
    return args + reduce_args + _DTYPE_FLAG[model.dtype]


def quantized_refusal(plan: Plan, cluster: Cluster, dtype: DType) -> str | None:
    """Why Transformer Engine cannot run quantized recipe `dtype` on the plan's devices (None: it can, or `dtype`
    is not quantized). The block-scaled recipes (mxfp8, nvfp4) need Blackwell's block-scaled tensor cores (sm100+;
    the catalog marks them by an fp4 rate), the per-tensor fp8 ones (fp8, fp8-cs) fp8 tensor cores (sm89+: Ada,
    Hopper, Blackwell; an fp8 rate), `DeviceSpec.has_tensor_cores_for`: Transformer Engine refuses them elsewhere,
    where the cost model gives such a device its fallback rate (`DeviceSpec.peak_flops`)."""
    return _quantized_refusal([cluster.device(d).spec for d in plan.devices], dtype)


def cluster_quantized_refusal(cluster: Cluster, dtype: DType) -> str | None:
    """`quantized_refusal` where no GPU of the cluster can run `dtype`, so that no plan on it can (None where some
    can: a plan on those alone may)."""
    specs = [d.spec for d in cluster.devices]
    if not dtype.quantized or any(spec.has_tensor_cores_for(dtype) for spec in specs):
        return None
    return _quantized_refusal(specs, dtype)


def _quantized_refusal(devices: Sequence[DeviceSpec], dtype: DType) -> str | None:
    if not dtype.quantized:
        return None
    specs = {spec.name: spec for spec in devices}
    lacking = sorted(name for name, spec in specs.items() if not spec.has_tensor_cores_for(dtype))
    needs = ("runs block-scaled GEMMs only on Blackwell (sm100+) GPUs" if dtype.block_scaled
             else "runs fp8 GEMMs only on GPUs with fp8 tensor cores (sm89+: Ada, Hopper, Blackwell)")
    if not lacking:
        return None
    fp8_everywhere = all(spec.peak_flops_fp8 is not None for spec in specs.values())
    instead = ("fp8 or fp8-cs (per-tensor scaling)" if dtype.block_scaled and fp8_everywhere
               else "bf16 (or fp16 where a GPU has no bf16 tensor cores)")
    return (f"dtype {dtype.value}: Transformer Engine {needs}; the plan uses {', '.join(lacking)}. Plan in "
            f"{instead} for these devices")


def tp_overlap_refusal(plan: Plan, cluster: Cluster) -> str | None:
    """Why `--tp-comm-overlap` cannot run `plan` on `cluster` (None: it can). Transformer Engine's
    userbuffers (its "Overlapping Communication with GEMM" requirements) need every tensor-parallel
    group on one node, connected over NVLink or NVSwitch, and run on the GPUs Transformer Engine
    supports, sm80 and later (the catalog's GPUs with bf16; before sm90 over CUDA IPC, `UB_SKIPMC=1`).
    Every pair of the group is judged by its link (`Cluster.link`): a node's explicit pair links
    override its fabric, so two bridged GPUs of a PCIe node qualify and a PCIe pair of an NVLink
    node does not."""
    for i, stage in enumerate(plan.stages):
        if stage.tp < 2:
            continue
        for g in range(stage.dp_cp):
            members = stage.tp_group(g)
            group = [cluster.device(d) for d in members]
            node = cluster.nodes[group[0].node]
            if any(d.node != group[0].node for d in group):
                return (f"--tp-comm-overlap: stages[{i}] tensor-parallel group {g} spans nodes; Transformer Engine's "
                        "userbuffers need each tensor-parallel group on one node")
            slow = next(((a, b) for j, a in enumerate(members) for b in members[j + 1:]
                         if cluster.link(a, b).kind not in (LinkKind.NVLINK, LinkKind.NVSWITCH)), None)
            if slow is not None:
                a, b = slow
                return (f"--tp-comm-overlap: stages[{i}] runs on {node.name!r}, whose GPUs {cluster.device(a).local} "
                        f"and {cluster.device(b).local} meet over {cluster.link(a, b).kind.value}; Transformer "
                        "Engine's userbuffers need NVLink or NVSwitch between every GPU of a tensor-parallel group")
            if group[0].spec.peak_flops_bf16 is None:
                return (f"--tp-comm-overlap: stages[{i}] runs on {group[0].spec.name}, older than sm80; Transformer "
                        "Engine does not run there")
    return None


def uses_megatron_fsdp(plan: Plan) -> bool:
    """Whether the plan runs under Megatron FSDP (ZeRO-2/3; `megatron_arguments` has accepted it)."""
    return any(s.zero >= 2 for s in plan.stages)


def write_megatron(model: ModelGraph, plan: Plan, out_dir: Path, *, global_batch: int, seq_len: int,
                   model_config: dict[str, Any] | None = None, grad_reduce_dtype: DType | None = None,
                   grad_reduce_overlap: bool = True, tp_comm_overlap: bool = False,
                   loss: LossKernel = LossKernel.EAGER, cluster: Cluster | None = None) -> list[Path]:
    """Write `megatron_args.txt` (one flag per line) and the launch under `out_dir`; returns the paths.

    Without `cluster`: `launch.sh`, device d as global rank d. With it: `launch_node{k}.sh` per node
    (k = node rank, nodes in the plan's rank order; CUDA_VISIBLE_DEVICES lists the node's GPUs in
    rank order, so local rank j runs the GPU the plan gave it: Megatron-LM takes its device from
    LOCAL_RANK; older releases that take rank modulo the visible GPUs agree only where each node's
    first world rank is a multiple of its rank count, e.g. nodes holding equal numbers) and `ranks.json`
    (world rank -> cluster device, node, local GPU, GPU type), so a plan whose first stage sits on any
    node runs as it was costed."""
    args = megatron_arguments(model, plan, global_batch=global_batch, seq_len=seq_len, model_config=model_config,
                              grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap,
                              tp_comm_overlap=tp_comm_overlap, loss=loss, cluster=cluster)
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_launch_files(out_dir)
    args_path = out_dir / "megatron_args.txt"
    args_path.write_text(_one_flag_per_line(args))
    if cluster is None:
        launch_path = out_dir / "launch.sh"
        launch_path.write_text(_launch_script(len(plan.devices), fsdp=uses_megatron_fsdp(plan)))
        launch_path.chmod(0o755)
        record_launch_files(out_dir, [launch_path])
        return [args_path, launch_path]
    table = fixed_rank_table(rank_order(plan, cluster), cluster)
    paths = [args_path]
    for name, text in launch_scripts(table, setup=_launch_setup(fsdp=uses_megatron_fsdp(plan)),
                                     command=_MEGATRON_COMMAND, pin_gpus=True).items():
        (path := out_dir / name).write_text(text)
        path.chmod(0o755)
        paths.append(path)
    table_path = out_dir / "ranks.json"
    table_path.write_text(json.dumps(table, indent=1) + "\n")
    record_launch_files(out_dir, [*paths[1:], table_path])
    return [*paths, table_path]


def model_refusal(model: ModelGraph) -> str | None:
    """Why this exporter writes no arguments for `model` whatever the plan (a family that is not a
    decoder-only transformer, a graph whose name is no SPEC), else None."""
    try:
        _shape(model, None)
    except SpecError as err:
        return str(err)
    return None


def _shape(model: ModelGraph, config: dict[str, Any] | None) -> tuple[str, TransformerShape]:
    if config is None:
        try:
            config = model_config_from_spec(model.name)
        except ExportError:
            raise
        except SpecError:  # a graph's own name, not a SPEC
            raise refuse(FMT, f"model {model.name!r} is not a zoo name, FAMILY?key=value or "
                              "hf:LlamaConfig/GPT2Config SPEC; pass model_config") from None
    config = dict(config)
    family = str(config.pop("family", model.family))
    if family not in DECODER_FAMILIES:
        raise refuse(FMT, f"model family {family!r} is not exported; this exporter writes pretrain_gpt.py "
                          f"arguments, which build decoder-only transformers ({', '.join(DECODER_FAMILIES)})")
    known = {f.name for f in fields(TransformerShape)}
    return family, TransformerShape(**{k: v for k, v in config.items() if k in known})


def plan_checks(plan: Plan, cluster: Cluster | None = None, *, tp_comm_overlap: bool = False,
                model: ModelGraph | None = None) -> tuple[int, int]:
    """(dp, tp) after every refusal the plan alone decides: one mesh with even shares, the schedule,
    the rank order (on `cluster`'s nodes when given: `rank_order`), `--tp-comm-overlap` where asked
    (on `cluster`: `tp_overlap_refusal`), recomputation on all stages or none, one ZeRO stage (2 and 3
    without pipelining)."""
    dp, tp = uniform_mesh(plan, FMT, "Megatron-LM uses one tensor- and data-parallel degree for the whole model")
    pp, _ = _pipeline_depth(plan)
    _check_schedule(plan, pp)
    rank_order(plan, cluster)
    if tp_comm_overlap and cluster is not None and (why := tp_overlap_refusal(plan, cluster)):
        raise refuse(FMT, why)
    _recompute_args(plan, model)
    _optimizer_args(plan, dp)
    return dp, tp


def rank_order(plan: Plan, cluster: Cluster | None = None) -> tuple[int, ...]:
    """The plan's devices in Megatron-LM's world-rank order (`checks.check_rank_order`)."""
    pp, _ = _pipeline_depth(plan)
    return check_rank_order(plan, [s.devices for s in plan.stages[:pp]], tp=plan.stages[0].tp, fmt=FMT,
                            launcher="Megatron-LM (ranks tp-fastest, then cp, then dp, then pp)", cluster=cluster)


def _pipeline_depth(plan: Plan) -> tuple[int, int]:
    """(pipeline ranks, model chunks per rank)."""
    pp = len(dict.fromkeys(s.devices for s in plan.stages))
    return pp, len(plan.stages) // pp


def _check_schedule(plan: Plan, pp: int) -> None:
    if plan.schedule is Schedule.GPIPE and len(plan.stages) > 1:
        raise refuse(FMT, "schedule 'gpipe' has no Megatron-LM equivalent (it runs 1F1B or interleaved 1F1B); "
                          "re-plan with schedule '1f1b'")
    if plan.schedule is Schedule.INTERLEAVED_1F1B and len(plan.stages) > pp:
        if pp < 2:
            raise refuse(FMT, f"interleaved_1f1b over {pp} device group needs pipeline-model-parallel-size >= 2")
        if plan.micro_batches % pp:
            raise refuse(FMT, f"interleaved_1f1b: micro_batches={plan.micro_batches} is not a multiple of the "
                              f"pipeline-model-parallel-size {pp}, as Megatron-LM's interleaved schedule needs")


def _layer_counts(model: ModelGraph, plan: Plan, shape: TransformerShape) -> list[int]:
    """Transformer layers per plan stage (embedding and head excluded: Megatron adds them itself)."""
    kinds = [model.block_of(i).kind for i in range(len(model.layers))]
    if kinds[0] != "embedding" or kinds[-1] != "head" or any(k in _EDGE_KINDS for k in kinds[1:-1]):
        raise refuse(FMT, f"model {model.name!r} is not embedding, transformer layers, head (layer kinds "
                          f"{sorted(set(kinds))}); Megatron-LM places exactly that structure")
    if len(kinds) - 2 != shape.layers:
        raise refuse(FMT, f"model config says {shape.layers} layers but the graph has {len(kinds) - 2}")
    return [sum(1 for k in kinds[s.layers[0]:s.layers[1]] if k not in _EDGE_KINDS) for s in plan.stages]


def _split_args(counts: list[int], pp: int, chunks: int) -> list[str]:
    """Flags that place `counts[i]` transformer layers on plan stage i.

    Even splits need no flag (interleaved: `--num-layers-per-virtual-pipeline-stage`); uneven first
    or last stages take `--decoder-first/last-pipeline-num-layers`; any other split is written as
    Megatron-Core's `--pipeline-model-parallel-layout` (stages in model order separated by `|`,
    `E` the embedding, `t` a transformer layer, `L` the head and loss)."""
    if len(set(counts)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(counts[0])] if chunks > 1 else []
    middle = counts[1:-1]
    if chunks == 1 and len(set(middle)) <= 1 and min(counts[0], counts[-1]) > 0:
        args: list[str] = []
        for flag, index in (("--decoder-first-pipeline-num-layers", 0),
                            ("--decoder-last-pipeline-num-layers", pp - 1)):
            if not middle or counts[index] != middle[0]:
                args += [flag, str(counts[index])]
        return args
    return ["--pipeline-model-parallel-layout", pipeline_layout(counts)]


def pipeline_layout(counts: list[int]) -> str:
    """Megatron-Core's layout string for `counts[i]` transformer layers on stage i, e.g. 'Et*3|t*5|t*2L'."""
    parts = []
    for i, c in enumerate(counts):
        body = "t" if c == 1 else f"t*{c}" if c else ""
        parts.append(("E" if i == 0 else "") + body + ("L" if i == len(counts) - 1 else ""))
    return "|".join(parts)


def _check_sharding(model: ModelGraph, plan: Plan) -> None:
    """ExportError where a stage's per-op sharding differs from Megatron's (cost.sharding's default)."""
    for i, stage in enumerate(plan.stages):
        if not stage.sharding or stage.tp == 1:
            continue
        hashes = dict.fromkeys(model.layers[j].block for j in range(*stage.layers))
        for h in hashes:
            for op, megatron in default_strategies(model.block_by_hash[h]).items():
                given = stage.sharding.get(op)
                if given is not None and given != megatron:
                    raise refuse(FMT, f"stages[{i}].sharding[{op!r}] = {given.value} but Megatron-LM shards "
                                      f"{op!r} as {megatron.value}; it has no per-op sharding choice")


def _check_divisible(family: str, shape: TransformerShape, tp: int, seq_len: int) -> None:
    ffn = ffn_width(family, shape)
    sizes = {"num-attention-heads": shape.heads, "ffn-hidden-size": ffn, "seq-length (sequence parallel)": seq_len}
    if family != "gpt":
        sizes["num-query-groups"] = shape.kvh
    for name, size in sizes.items():
        if tp > 1 and size % tp:
            raise refuse(FMT, f"--{name} {size} is not divisible by the tensor-parallel size {tp}")


def _model_args(family: str, shape: TransformerShape, seq_len: int) -> list[str]:
    """Architecture flags: sizes from the shape, GPT defaults or the Llama/MoE switches."""
    args = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
            "--ffn-hidden-size", str(ffn_width(family, shape)), "--num-attention-heads", str(shape.heads)]
    if shape.dh != shape.hidden // shape.heads or shape.hidden % shape.heads:
        # Megatron-LM derives kv_channels as hidden / heads only where heads divide hidden (it asserts so
        # otherwise): gpt3-1.3b's 24 heads of 2048 // 24 = 85 need it written
        args += ["--kv-channels", str(shape.dh)]
    positions = max(shape.max_positions, seq_len) if family == "gpt" else seq_len
    args += ["--seq-length", str(seq_len), "--max-position-embeddings", str(positions),
             "--vocab-size", str(shape.vocab)]
    if family != "gpt":
        args += ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear"]
        if shape.kvh != shape.heads:
            args += ["--group-query-attention", "--num-query-groups", str(shape.kvh)]
    if not shape.tied:
        args.append("--untie-embeddings-and-output-weights")
    if family == "moe":
        args += ["--num-experts", str(shape.experts), "--moe-router-topk", str(shape.top_k)]
    return args


def _recompute_args(plan: Plan, model: ModelGraph | None = None) -> list[str]:
    """Full recomputation: every layer checkpointed (`--recompute-method uniform --recompute-num-layers 1`);
    partial (`Stage.recompute_layers`): Megatron's block method, each (virtual) stage recomputing its first N
    transformer layers, one N for all. With `model`, each stage's count is checked against min(N, its layers)."""
    flags = [s.recompute for s in plan.stages]
    if not any(flags):
        return []
    if not all(flags):
        on = [i for i, f in enumerate(flags) if f]
        off = [i for i, f in enumerate(flags) if not f]
        raise refuse(FMT, f"stages {on} recompute but stages {off} do not; Megatron-LM's --recompute-num-layers "
                          "applies the same count on every pipeline stage, so per-stage recomputation has no flag")
    # a count equal to all of a stage's blocks is full recomputation of that stage (what N >= its blocks does)
    counts = {s.recompute_layers for s in plan.stages if s.recompute_layers is not None and not (
        model is not None and s.recompute_layers == len(model.checkpointable(*s.layers)))}
    if not counts:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if len(counts) > 1:
        raise refuse(FMT, f"stages recompute {sorted(counts)} layers; Megatron-LM's --recompute-method block "
                          "--recompute-num-layers recomputes the same number of layers on every (virtual) stage")
    n = counts.pop()
    for i, stage in enumerate(plan.stages):
        if model is not None and stage.recompute_layers in (None, len(model.checkpointable(*stage.layers))) \
                and len(model.checkpointable(*stage.layers)) > n:
            raise refuse(FMT, f"stages[{i}] recomputes all its {len(model.checkpointable(*stage.layers))} layers "
                              f"but other stages {n}; Megatron-LM's --recompute-num-layers {n} would recompute "
                              f"{n} of them")
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(n)]


def _optimizer_args(plan: Plan, dp: int, *, overlap: bool = True) -> list[str]:
    """The distributed optimizer for ZeRO-1, Megatron FSDP for ZeRO-2/3 on one pipeline stage, and with
    `overlap` (as costed) and more than one device per parameter shard (dp x cp > 1: gradients reduce over
    the context-parallel ranks too) the overlap flags (without them Megatron reduces and gathers after the
    backward)."""
    reducing = dp * plan.stages[0].cp
    zeros = {s.zero for s in plan.stages}
    if len(zeros) > 1:
        raise refuse(FMT, f"stages use ZeRO stages {sorted(zeros)}; Megatron-LM has one optimizer for all stages")
    zero = zeros.pop()
    pp, _ = _pipeline_depth(plan)
    if zero >= 2 and pp > 1:
        raise refuse(FMT, f"zero={zero} with pipeline-model-parallel-size {pp}: Megatron-LM shards gradients and "
                          "parameters only under Megatron FSDP, whose documentation covers TP, EP and CP but not "
                          "pipeline parallelism; re-plan with ZeRO-1 (the distributed optimizer) or one stage")
    # ZeRO-3 always overlaps: the simulator costs its per-layer gathers prefetched under compute
    # whatever `overlap` says (as DeepSpeed's `overlap_comm`)
    overlapped = (overlap or zero >= 3) and reducing > 1
    args = ["--overlap-grad-reduce"] if overlapped else []
    if zero >= 2:
        strategy = "optim_grads" if zero == 2 else "optim_grads_params"
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                 "--no-gradient-accumulation-fusion", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
        if overlapped:
            args.append("--overlap-param-gather")
    elif zero == 1:
        args.append("--use-distributed-optimizer")
        if overlapped:
            args.append("--overlap-param-gather")
    return args


def reduce_dtype_args(dtype: DType, grad_reduce_dtype: DType | None) -> list[str]:
    """The flag that makes Megatron reduce gradients in `grad_reduce_dtype` under `dtype` training
    (none when left open); ExportError for a pairing Megatron has no flag for."""
    if grad_reduce_dtype is None:
        return []
    accepted = _REDUCE_FLAG[dtype]
    if grad_reduce_dtype not in accepted:
        raise refuse(FMT, f"grad_reduce_dtype={grad_reduce_dtype.value} with dtype {dtype.value}: Megatron-LM reduces "
                          "gradients in the parameters' dtype or in fp32 (--accumulate-allreduce-grads-in-fp32; "
                          "--bf16 runs reduce in fp32 unless --grad-reduce-in-bf16). Accepted with dtype "
                          f"{dtype.value}: {', '.join(d.value for d in accepted)}, or leave it unset")
    return list(accepted[grad_reduce_dtype])


def grad_reduce(plan: Plan, dtype: DType, *, grad_reduce_dtype: DType | None = None,
                grad_reduce_overlap: bool = True) -> GradReduce:
    """How the exported run reduces gradients (`plan` already accepted by `plan_checks`, `dtype` the
    training dtype): the flags `megatron_arguments` writes for it. Megatron runs either setting as
    costed, except ZeRO-3 costed without overlap: its gathers must overlap (`_optimizer_args`), and
    the reduction then overlaps too (noted: faster than costed). ExportError for a reduction dtype
    it has no flag for."""
    dp = plan.stages[0].dp
    written = reduce_dtype_args(dtype, grad_reduce_dtype)
    written += [a for a in _optimizer_args(plan, dp, overlap=grad_reduce_overlap) if a.startswith("--overlap")]
    overlap = "--overlap-grad-reduce" in written if plan.stages[0].dp_cp > 1 else None
    notes = (("ZeRO-3 under Megatron FSDP overlaps its parameter gathers (costed so whatever the setting), and "
              "with them the gradient reduction, which was costed after the backward: the run reduces faster "
              "than predicted",) if overlap and not grad_reduce_overlap else ())
    runs = grad_reduce_dtype or _REDUCE_DEFAULT[dtype]
    wider = reduce_dtype_note(FMT, dtype, grad_reduce_dtype, runs, f"Export with --grad-reduce-dtype {dtype.value} "
                              "to write the flag that reduces in the training dtype, or cost the plan with "
                              f"--grad-reduce-dtype {runs.value}") if plan.stages[0].dp_cp > 1 else None
    return GradReduce(dtype=runs, overlap=overlap, written=tuple(written), notes=(*notes, *([wider] if wider else [])))


def _one_flag_per_line(args: list[str]) -> str:
    lines: list[str] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append(arg)
        else:
            lines[-1] += " " + shlex.quote(arg)
    return "\n".join(lines) + "\n"


_MEGATRON_COMMAND = ('"${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}/pretrain_gpt.py" '
                     '$(cat megatron_args.txt) $DATA_ARGS "$@"')


def _launch_setup(*, fsdp: bool) -> list[str]:
    """The lines a per-node launch runs before torchrun (in the export directory)."""
    return ['DATA_ARGS="${DATA_ARGS:---mock-data --tokenizer-type NullTokenizer --train-iters 100 --lr 1e-4}"',
            _connections(fsdp), "# shellcheck disable=SC2046,SC2086"]


def _connections(fsdp: bool) -> str:
    return ("unset CUDA_DEVICE_MAX_CONNECTIONS  # Megatron FSDP asserts it is not 1" if fsdp
            else "export CUDA_DEVICE_MAX_CONNECTIONS=1")


def _launch_script(world: int, *, fsdp: bool = False) -> str:
    per_node = min(world, 8)
    connections = _connections(fsdp)
    return f"""#!/usr/bin/env bash
# Runs the plan with Megatron-LM: one torchrun per node, nodes numbered in the cluster SPEC's order
# (the plan's device d is global rank d). Set MEGATRON_LM to a Megatron-LM checkout; append data,
# tokenizer and optimizer flags with DATA_ARGS / extra arguments (default: mock data).
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
GPUS_PER_NODE="${{GPUS_PER_NODE:-{per_node}}}"
NNODES="${{NNODES:-$(( {world} / GPUS_PER_NODE ))}}"
DATA_ARGS="${{DATA_ARGS:---mock-data --tokenizer-type NullTokenizer --train-iters 100 --lr 1e-4}}"
{connections}
# shellcheck disable=SC2046,SC2086
exec torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "${{NODE_RANK:-0}}" \\
    --master_addr "${{MASTER_ADDR:-localhost}}" --master_port "${{MASTER_PORT:-6000}}" \\
    "${{MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout}}/pretrain_gpt.py" \\
    $(cat "$HERE/megatron_args.txt") $DATA_ARGS "$@"
"""
