"""DeepSpeed config and pipeline partition for a plan (`ds_config.json`, `partition.json`).

DeepSpeed's PipelineEngine runs one 1F1B schedule (its TrainSchedule) over a PipelineModule whose
layer list is cut at `parts`, on ranks ordered pipe-major, data-parallel fastest
(PipeDataParallelTopology). A plan maps onto it when every stage has the same dp with even batch
shares and no tensor parallelism, stages sit on ranks in that order (with the cluster, a `hostfile`
lists its nodes in the plan's rank order, so the first stage may sit on any node), and ZeRO is 0 or 1 once there
is more than one stage. Refused, with the reason: tensor parallelism (DeepSpeed's pipeline engine
has none; it needs Megatron-DeepSpeed's `--tensor-model-parallel-size`, use fmt="megatron"),
ZeRO-2/3 with pipeline parallelism (PipelineModule does not support them), interleaved and GPipe
schedules, and different ZeRO stages per pipeline stage (one `zero_optimization` for all).

Batch arithmetic: `train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* dp`, with one micro-batch per accumulation step (`gradient_accumulation_steps = micro_batches`).

Gradient reduction (`grad_reduce`): a costed `grad_reduce_dtype` is written as
`communication_data_type` (the key DeepSpeed reads since it replaced `fp32_allreduce`), plus
`"fp32_allreduce": true` for fp32 over 16-bit training (older DeepSpeed and DeeperSpeed read only
that); `zero_optimization.overlap_comm` is `grad_reduce_overlap` with dp > 1 (always with ZeRO-3, which
the simulator costs prefetched under compute). DeepSpeed overlaps the
reduction with the backward only under ZeRO 1-3 on one stage: its pipeline engine reduces after
the flush and ZeRO 0 after the backward, so an overlapped costing of such a plan is not refused but
noted (`tagplan_notes` in partition.json): the run will be slower than predicted.
Key names follow the DeepSpeed configuration JSON reference and `deepspeed/runtime/pipe/module.py`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tagplan.export.checks import (
    GradReduce,
    check_rank_order,
    check_reduce_dtype,
    micro_batch_size,
    refuse,
    uniform_mesh,
    validate,
)
from tagplan.export.node_launch import clear_launch_files, fixed_rank_table, record_launch_files
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan, Schedule
from tagplan.ir.workload import SIXTEEN_BIT, DType

FMT = "deepspeed"

HOW_TO_APPLY = (
    "DeepSpeed's PipelineModule has no partition_method taking explicit boundaries (it offers 'parameters', "
    "'uniform' and 'type:REGEX'). Build the PipelineModule from `layers` one-to-one (a LayerSpec per entry), "
    "subclass it and override _partition_layers to set self.parts = parts and call "
    "self._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1]) with "
    "stage_id = self._topo.get_coord(self.global_rank).pipe; stage s then builds layers[parts[s]:parts[s + 1]]. "
    "After construction set module.activation_checkpoint_interval = activation_checkpoint_interval[stage_id]."
)


def deepspeed_config(model: ModelGraph, plan: Plan, *, global_batch: int, seq_len: int,
                     grad_reduce_dtype: DType | None = None, grad_reduce_overlap: bool = True,
                     cluster: Cluster | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict (`ds_config.json`) that runs `plan` (on `cluster`'s nodes in the
    plan's rank order when given, `rank_order`), reducing gradients as costed (`grad_reduce_dtype`
    None: in the training dtype); ExportError if it cannot."""
    dp, pp = _check(model, plan, seq_len, cluster)
    check_reduce_dtype(grad_reduce_dtype)
    mbs = micro_batch_size(plan, global_batch, dp, FMT)
    zero = plan.stages[0].zero
    config: dict[str, Any] = {
        "train_batch_size": mbs * plan.micro_batches * dp,
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": plan.micro_batches,
        "zero_optimization": {"stage": zero, "overlap_comm": _overlap_comm(zero, dp, grad_reduce_overlap)},
    }
    if model.dtype.quantized:
        raise refuse(FMT, f"dtype {model.dtype.value}: DeepSpeed's config has no quantized GEMMs (Transformer "
                          "Engine); export to megatron or plan in bf16")
    if model.dtype is DType.BF16:
        config["bf16"] = {"enabled": True}
    elif model.dtype is DType.FP16:
        config["fp16"] = {"enabled": True}
    config.update(_reduce_keys(model.dtype, grad_reduce_dtype))
    intervals = _checkpoint_intervals(plan)
    if any(intervals):
        # recompute = keep each layer's input only: checkpoint every layer, activations not partitioned
        config["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                              "contiguous_memory_optimization": False}
    if pp > 1:
        config["pipeline"] = {"stages": pp, "seed_layers": False}
        if len(set(intervals)) == 1:
            config["pipeline"]["activation_checkpoint_interval"] = intervals[0]
    return config


def deepspeed_partition(model: ModelGraph, plan: Plan, *, notes: Sequence[str] = ()) -> dict[str, Any]:
    """The pipeline partition (`partition.json`): `parts` in PipelineModule's format (stage s builds
    layers [parts[s], parts[s+1])), the layer names, per-stage checkpoint intervals, how to apply them
    and `tagplan_notes` (`notes`: where the run differs from the costing)."""
    return {
        "num_stages": len(plan.stages),
        "parts": [s.layers[0] for s in plan.stages] + [plan.stages[-1].layers[1]],
        "layers": [layer.name for layer in model.layers],
        "activation_checkpoint_interval": _checkpoint_intervals(plan),
        "how_to_apply": HOW_TO_APPLY,
        "tagplan_notes": list(notes),
    }


def write_deepspeed(model: ModelGraph, plan: Plan, out_dir: Path, *, global_batch: int, seq_len: int,
                    grad_reduce_dtype: DType | None = None, grad_reduce_overlap: bool = True,
                    cluster: Cluster | None = None) -> list[Path]:
    """Write `ds_config.json` and `partition.json` under `out_dir`; with `cluster` also `hostfile`
    (its nodes in the plan's rank order) and partition.json's `launch` (`launch`); returns the paths."""
    config = deepspeed_config(model, plan, global_batch=global_batch, seq_len=seq_len,
                              grad_reduce_dtype=grad_reduce_dtype, grad_reduce_overlap=grad_reduce_overlap,
                              cluster=cluster)
    reduce = grad_reduce(plan, model.dtype, grad_reduce_dtype=grad_reduce_dtype,
                         grad_reduce_overlap=grad_reduce_overlap)
    out_dir.mkdir(parents=True, exist_ok=True)
    clear_launch_files(out_dir)
    config_path, partition_path = out_dir / "ds_config.json", out_dir / "partition.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    partition = deepspeed_partition(model, plan, notes=reduce.notes)
    paths = [config_path, partition_path]
    if cluster is not None:
        partition["launch"] = launch(plan, cluster)
        hostfile = out_dir / "hostfile"
        hostfile.write_text(partition["launch"]["hostfile_text"])
        paths.append(hostfile)
        record_launch_files(out_dir, [hostfile])
    partition_path.write_text(json.dumps(partition, indent=2) + "\n")
    return paths


def launch(plan: Plan, cluster: Cluster) -> dict[str, Any]:
    """How to launch `plan` on `cluster` with DeepSpeed's launcher so each rank runs the device it
    was costed on: a hostfile listing the nodes in the plan's rank order (node names as the cluster
    names them: put the hosts' addresses in their place), `--include` selecting each node's GPUs,
    and the rank table (world rank -> device, node, local GPU, GPU type)."""
    table = fixed_rank_table(rank_order(plan, cluster), cluster)
    nodes = list(dict.fromkeys(row["node"] for row in table))
    gpus = {n: [row["local_gpu"] for row in table if row["node"] == n] for n in nodes}
    slots = {node.name: node.gpus for node in cluster.nodes}  # the node's GPUs: --include picks among them
    include = "@".join(f"{n}:{','.join(map(str, gpus[n]))}" for n in nodes)
    return {"hostfile_text": "".join(f"{n} slots={slots[n]}\n" for n in nodes), "include": include,
            "command": f"deepspeed --hostfile hostfile --include {include} YOUR_TRAIN.py --deepspeed "
                       "--deepspeed_config ds_config.json",
            "note": "the hostfile and --include name the cluster's nodes: make each name resolve to its host "
                    "(/etc/hosts or ssh config) or replace it in both, keeping the hostfile's order: DeepSpeed "
                    "numbers ranks host by host in hostfile order",
            "ranks": table}


def grad_reduce(plan: Plan, dtype: DType, *, grad_reduce_dtype: DType | None = None,
                grad_reduce_overlap: bool = True) -> GradReduce:
    """How the exported run reduces gradients (`plan` already accepted by `plan_checks`, `dtype` the
    training dtype): the keys `deepspeed_config` writes for it, and a note where DeepSpeed cannot
    overlap the reduction as costed (its pipeline engine after the flush, ZeRO 0 after the backward)."""
    dp, pp, zero = plan.stages[0].dp, len(plan.stages), plan.stages[0].zero
    keys = {**_reduce_keys(dtype, grad_reduce_dtype),
            "zero_optimization.overlap_comm": _overlap_comm(zero, dp, grad_reduce_overlap)}
    written = tuple(f"{key}: {json.dumps(value)}" for key, value in keys.items())
    reduced_in = grad_reduce_dtype or dtype
    if dp == 1:
        return GradReduce(dtype=reduced_in, overlap=None, written=written)
    overlaps = can_overlap(plan)
    notes: tuple[str, ...] = ()
    if grad_reduce_overlap and not overlaps:
        when = (f"its pipeline engine ({pp} stages) reduces them after the flush" if pp > 1
                else "with ZeRO 0 it reduces them after the backward")
        notes = (f"DeepSpeed cannot overlap this plan's gradient reduction: {when}, exposed. A plan costed with "
                 "the reduction overlapped will run slower than predicted; `plan --exportable deepspeed` costs it "
                 "as DeepSpeed runs it (DeepSpeed overlaps only ZeRO 1-3 on one stage)",)
    return GradReduce(dtype=reduced_in, overlap=_overlap_comm(zero, dp, grad_reduce_overlap) and overlaps,
                      written=written, notes=notes)


def _overlap_comm(zero: int, dp: int, grad_reduce_overlap: bool) -> bool:
    """`overlap_comm`: as costed; ZeRO-3 always (the simulator costs its layer-by-layer gathers and
    reduce-scatters prefetched under compute whatever `grad_reduce_overlap` says)."""
    return dp > 1 and (grad_reduce_overlap or zero >= 3)


def can_overlap(plan: Plan) -> bool:
    """Whether DeepSpeed can reduce `plan`'s gradients while the backward runs: ZeRO 1-3 (`overlap_comm`)
    on one stage; its pipeline engine reduces after the flush, and without ZeRO it reduces after the backward."""
    return plan.stages[0].zero >= 1 and len(plan.stages) == 1


def _reduce_keys(dtype: DType, grad_reduce_dtype: DType | None) -> dict[str, Any]:
    """Top-level config keys for the reduction dtype: none when left to the training dtype;
    `communication_data_type`, and `fp32_allreduce` for fp32 over 16-bit training (older DeepSpeed)."""
    if grad_reduce_dtype is None:
        return {}
    keys: dict[str, Any] = {"communication_data_type": grad_reduce_dtype.value}
    if grad_reduce_dtype is DType.FP32 and dtype in SIXTEEN_BIT:
        keys["fp32_allreduce"] = True
    return keys


def _check(model: ModelGraph, plan: Plan, seq_len: int, cluster: Cluster | None) -> tuple[int, int]:
    """(dp, pipeline depth) after every refusal check."""
    validate(plan, model, cluster)
    if seq_len != model.seq_len:
        raise refuse(FMT, f"seq_len={seq_len} but the model graph was built at {model.seq_len} tokens")
    return plan_checks(plan, cluster)


LAUNCHER = "DeepSpeed (ranks data-parallel fastest, then pipe)"


def rank_order(plan: Plan, cluster: Cluster | None = None) -> tuple[int, ...]:
    """The plan's devices in DeepSpeed's world-rank order (`checks.check_rank_order`). On `cluster`'s
    nodes the launcher (`deepspeed --hostfile --include`) gives a node's ranks to its listed GPUs in
    ascending order (older releases sort each host's list; newer keep --include's order, where this
    rule is stricter than needed), so each node's devices must also ascend in rank order."""
    ranked = check_rank_order(plan, [s.devices for s in plan.stages], tp=1, fmt=FMT, launcher=LAUNCHER,
                              cluster=cluster)
    if cluster is not None:
        per_node: dict[int, list[int]] = {}
        for d in ranked:
            per_node.setdefault(cluster.device(d).node, []).append(d)
        for node, mine in per_node.items():
            if mine != sorted(mine, key=lambda d: cluster.device(d).local):
                raise refuse(FMT, f"node {cluster.nodes[node].name!r} runs devices {mine} in that rank order, but "
                                  "DeepSpeed's launcher gives a node's ranks to its GPUs in ascending order; order "
                                  "each node's devices by GPU index within the stages")
    return ranked


def plan_checks(plan: Plan, cluster: Cluster | None = None) -> tuple[int, int]:
    """(dp, pipeline depth) after every refusal the plan alone decides (ExportError naming the stage);
    with `cluster`, the rank order on its nodes (`rank_order`)."""
    for i, stage in enumerate(plan.stages):  # what DeepSpeed lacks at all, before what it lacks per stage
        if stage.tp > 1:
            raise refuse(FMT, f"stages[{i}].tp = {stage.tp}: DeepSpeed's pipeline engine has no tensor parallelism; "
                              "that needs Megatron-DeepSpeed (its --tensor-model-parallel-size), or --format megatron "
                              "instead")
        if stage.cp > 1:
            raise refuse(FMT, f"stages[{i}].cp = {stage.cp}: DeepSpeed's pipeline engine has no context parallelism "
                              "(ring attention; its Ulysses sequence parallelism is another scheme); export with "
                              "--format megatron (--context-parallel-size)")
    dp, _ = uniform_mesh(plan, FMT, "DeepSpeed's pipeline topology has one data-parallel degree for all stages")
    pp = len(plan.stages)
    if pp > 1 and plan.schedule is Schedule.INTERLEAVED_1F1B:
        raise refuse(FMT, "schedule 'interleaved_1f1b' is not supported: DeepSpeed's PipelineEngine runs one "
                          "model chunk per stage with its 1F1B TrainSchedule")
    if pp > 1 and plan.schedule is Schedule.GPIPE:
        raise refuse(FMT, "schedule 'gpipe' is not supported: DeepSpeed's PipelineEngine runs 1F1B only; "
                          "re-plan with schedule '1f1b'")
    zeros = [s.zero for s in plan.stages]
    if len(set(zeros)) > 1:
        raise refuse(FMT, f"stages use ZeRO stages {zeros}; DeepSpeed has one zero_optimization.stage for all")
    if pp > 1 and zeros[0] >= 2:
        raise refuse(FMT, f"zero={zeros[0]} with {pp} pipeline stages: DeepSpeed's PipelineModule is not "
                          "compatible with ZeRO-2 and ZeRO-3 (use zero 0 or 1)")
    _checkpoint_intervals(plan)
    rank_order(plan, cluster)
    return dp, pp


def _checkpoint_intervals(plan: Plan) -> list[int]:
    """Per stage: 1 (checkpoint every layer) where the plan recomputes, else 0. A partial recompute is refused:
    DeepSpeed's `activation_checkpoint_interval` checkpoints every k-th layer of every stage, not its first N."""
    partial = [i for i, s in enumerate(plan.stages) if s.recompute_layers is not None]
    if partial:
        raise refuse(FMT, f"stages {partial} recompute only some of their layers (recompute_layers); DeepSpeed's "
                          "pipeline engine checkpoints every k-th layer of every stage "
                          "(activation_checkpoint_interval), not the first N: re-plan with full recomputation "
                          "or export with --format megatron or --format torch instead")
    return [1 if s.recompute else 0 for s in plan.stages]
