"""Score the cost model on NVIDIA's published NeMo / Megatron-Bridge runs (bench/data/, copied from
the team's reference/measured/): predicted against measured tokens/s per GPU.

Scored: dense rows with a model shape, in BF16 or a quantized recipe (`dtype_of`: fp8 delayed or current
scaling, mxfp8, nvfp4), on DGX H100 / B200 (8-GPU NVSwitch nodes) or GB200 / GB300 NVL72 racks (72 GPUs in
one NVLink domain). Each row becomes the plan Megatron-Core runs: tp x cp x pp x dp with `vp` interleaved
chunks (1F1B otherwise), layers split evenly (embedding first, head last; counted as layers of the split
where the chunks outnumber the blocks), micro-batch size and global batch as published, FSDP as ZeRO-3,
distributed optimizer (ZeRO-1) otherwise. The table does not give the recipes' recompute settings; the
presets in Megatron-Bridge do (`recipe`): the Llama 3 / 3.1 rows ran without full recompute and are scored
without it. For the other rows a layout that does not fit in memory in the model must have saved memory
somehow in the published run, so it is also scored with full recompute (the plan format's one recompute
setting, an upper bound on what any recompute costs) when that fits; the summary gives the errors of both
rules. Not scored, with the reason: models without a shape, LoRA fine-tuning (it trains adapters only: the
base weights take no weight-gradient GEMMs and keep no optimizer state, which the cost model does not
represent; SFT is full fine-tuning and is scored), the 25.09 section's FP8 of unverified granularity.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.simulator import Simulator
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.plan import Plan, Schedule, Stage
from tagplan.ir.workload import DType, LossKernel, Workload

DATA = Path(__file__).parent / "data" / "nemo_performance_summary.json"
SYSTEMS = {"H100-SXM-80GB": ("dgx-h100", 8), "B200": ("dgx-b200", 8), "GB200": ("gb200-nvl72", 72),
           "B300": ("dgx-b300", 8), "GB300": ("gb300-nvl72", 72)}
"""Published GPU -> (cluster preset, GPUs per preset node): DGX H100/B200 nodes of 8, GB200 NVL72 racks of
72 GPUs in one NVLink domain (a run on 256 GPUs takes 4 racks, the plan's devices the first 256)."""
PRECISIONS = {"FP8": DType.FP8, "BF16": DType.BF16, "FP8-CS": DType.FP8_CS, "MXFP8": DType.MXFP8,
              "FP8-MX": DType.MXFP8, "NVFP4": DType.NVFP4}
"""Published precision -> the recipe the cost model runs: "FP8-CS" per-tensor current scaling, "MXFP8" and
"FP8-MX" the 32-element block scaling, "NVFP4" the 16-element fp4 block scaling. Plain "FP8" depends on the
publisher (`dtype_of`). The 25.09 section's FP8 (two granularities, one parenthesised, which one unverified)
is not scored."""
BRIDGE = "NVIDIA-NeMo/Megatron-Bridge"
BRIDGE_SCRIPTS = "scripts/performance (argument --compute_dtype: bf16, fp8_cs, fp8_mx, fp8_sc, nvfp4)"


def dtype_of(row: dict[str, Any]) -> DType:
    """The recipe a row ran. Megatron-Bridge's performance scripts offer per-tensor fp8 only as current scaling
    (`BRIDGE_SCRIPTS`: no delayed scaling), so its plain "FP8" rows are fp8-cs; NeMo's own scripts (24.07 -
    25.04) ran Transformer Engine's default, delayed scaling."""
    precision = row["config"]["precision"]
    if precision == "FP8" and row["provenance"]["repo"] == BRIDGE:
        return DType.FP8_CS
    return PRECISIONS[precision]


RECIPE = (f"{BRIDGE} scripts/performance/configs/llama/llama3_workload_base_configs.py and "
          "llama31_workload_base_configs.py")


def recipe(row: dict[str, Any]) -> str | None:
    """What the published preset says of recompute, where it is known (None: not known). Every Llama 3 / 3.1
    preset of Megatron-Bridge (`RECIPE`) runs without full recompute: none sets a full recompute; a few
    recompute one to five layers or offload some layers' activations to the Grace CPU (Megatron FSDP on
    GB200/GB300), neither of which the plan format expresses. Such rows are scored without recompute whatever
    the memory model says; where it says the layout does not fit, the row records that as a miss of the memory
    model, not a reason to charge recompute the run did not do."""
    if row["provenance"]["repo"] == BRIDGE and row["model"]["name"].startswith("Llama 3"):
        c, (chunks, _) = row["config"], vp_of(row)
        vp = f" vp{chunks}" if chunks else ""
        how = "Megatron FSDP" if c.get("fsdp") else f"tp{c['tp']} pp{c['pp']}{vp}"
        return f"{how}, no full recompute (preset)"
    return None


PRESET_LAYOUT = {
    ("GB300", DType.MXFP8): (1, 4, 5), ("GB300", DType.NVFP4): (1, 4, 5),
    ("GB200", DType.MXFP8): (2, 4, 5), ("GB200", DType.NVFP4): (2, 4, 5),
    ("B300", DType.MXFP8): (1, 4, 5), ("B300", DType.NVFP4): (1, 4, 5),
    ("B200", DType.BF16): (2, 4, 5), ("B200", DType.MXFP8): (2, 4, 5), ("B200", DType.NVFP4): (2, 4, 5),
    ("H100-SXM-80GB", DType.BF16): (4, 4, 5), ("H100-SXM-80GB", DType.FP8_CS): (4, 8, 5),
}
"""Llama 3 70B pre-training in Megatron-Bridge's presets (`RECIPE`, llama3_workload_base_configs.py at commits
3dafb00 and 00919dc, both GBS variants alike): (GPU, recipe) -> (tp, pp, vp) of every preset that sets a
virtual pipeline. `vp_of` reads the table's vp where it gives one and this where the table leaves it blank for
the preset's own tp and pp."""


def vp_of(row: dict[str, Any]) -> tuple[int | None, str]:
    """(virtual pipeline stages, where that figure comes from) of a row: the table's, else the Megatron-Bridge
    preset's for a Llama 3 70B pre-training row whose tp and pp are the preset's (`PRESET_LAYOUT`). One row
    needs it: 26.02.01's GB300 MXFP8 run lists pp4 and no vp, measured 4798 tokens/s per GPU, where the
    26.02, 26.04 and 26.04.01 runs of the same preset list pp4 vp5 at 4596-4864; without interleaving its
    8 micro-batches per pipeline would idle 27% of the step in the bubble."""
    c = row["config"]
    if c.get("vp") is not None:
        return c["vp"], "table"
    layout = PRESET_LAYOUT.get((row["cluster"]["nodes"][0]["gpu"], dtype_of(row)))
    if (layout is None or row["provenance"]["repo"] != BRIDGE or row["model"]["name"] != "Llama 3 70B"
            or "Pre-Training" not in (c.get("task") or "") or (c["tp"], c["pp"]) != layout[:2]):
        return None, "table"
    return layout[2], "Megatron-Bridge preset (the table leaves vp blank)"


CLOCK_FITTED = ("GB200", "GB300")
"""The GPUs whose sustained clock is fitted to their rows here (bench/fit_sustained_clock.py): no other table
measures them."""
CLOCK_DTYPES = (DType.FP8, DType.FP8_CS)
"""The recipes a clock is fitted on: per-tensor fp8, whose GEMMs run at the datasheet fp8 rate."""
FRACTION_DTYPES = (DType.MXFP8, DType.NVFP4)
"""The block-scaled recipes whose GEMM fraction (`Calibration.block_scaled_gemm_fraction`) is fitted to their rows
on the clock-fitted GPUs, the clocks fixed."""


def fit_role(row: dict[str, Any]) -> str | None:
    """Which shipped figure a row is fitted into ("GB200 clock", "nvfp4 fraction", ...), None for a row no fit
    sees (every H100 and B200 row, and rows whose preset's recompute is not known): the out-of-sample rows."""
    gpu = row["cluster"]["nodes"][0]["gpu"]
    if _skip(row) is not None or recipe(row) is None or gpu not in CLOCK_FITTED:
        return None
    dtype = dtype_of(row)
    if dtype in CLOCK_DTYPES:
        return f"{gpu} clock"
    return f"{dtype.value} fraction" if dtype in FRACTION_DTYPES else None


def _skip(row: dict[str, Any]) -> str | None:
    c, gpu = row["config"], row["cluster"]["nodes"][0]["gpu"]
    if "layers" not in row["model"]:
        return "no model shape"
    if "lora" in (c.get("task") or "").lower():
        return "LoRA fine-tuning not modelled"  # adapters only: no base-weight gradients or optimizer state
    if c["precision"] not in PRECISIONS:  # the 25.09 section's FP8 of unverified granularity
        return f"precision {c['precision'][:12]} not modelled"
    if gpu not in SYSTEMS:
        return f"{gpu} system not modelled"
    if not all(isinstance(c.get(k), int) for k in ("tp", "pp", "micro_batch", "global_batch")):
        return "a parallelism figure is not a number in the table"
    return None


def _plan(row: dict[str, Any], layers: int) -> Plan:
    c = row["config"]
    gpus = row["cluster"]["gpus_used"]
    tp, pp, vp, cp = c["tp"], c["pp"], vp_of(row)[0] or 1, c.get("cp") or 1
    dp = gpus // (tp * pp * cp)
    zero = 3 if c.get("fsdp") else (1 if dp * cp > 1 else 0)
    chunks = pp * vp
    blocks = layers - 2
    if blocks % chunks and not layers % chunks:
        # Megatron's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split (Llama 3.1
        # 405B's 126 blocks over pp16 x vp8): the embedding and the head each count as a layer of the split
        bounds = [layers * k // chunks for k in range(chunks + 1)]
    else:
        bounds = [1 + blocks * k // chunks for k in range(chunks + 1)]
        bounds[0], bounds[-1] = 0, layers
    per_stage = gpus // pp
    stages = tuple(Stage(layers=(bounds[k], bounds[k + 1]), dp=dp, cp=cp, tp=tp, zero=zero,
                         devices=tuple(range((k % pp) * per_stage, (k % pp + 1) * per_stage))) for k in range(chunks))
    micro_batches = c["global_batch"] // (dp * c["micro_batch"])
    schedule = Schedule.INTERLEAVED_1F1B if vp > 1 else Schedule.ONE_F_ONE_B
    return Plan(micro_batches=micro_batches, schedule=schedule, stages=stages)


def score_row(row: dict[str, Any], *, sustained_peak_fraction: float | None = None,
              calibration: Calibration = DEFAULT_CALIBRATION) -> dict[str, Any]:
    """Predicted and measured tokens/s per GPU of one published row (with the row's GPU at
    `sustained_peak_fraction` instead of the catalog's, where given, and under `calibration`:
    `fit_sustained_clock` fits both)."""
    m, c = row["model"], row["config"]
    dtype = dtype_of(row)
    kv_heads = m.get("kv_heads") or m["heads"]
    spec = (f"llama?layers={m['layers']}&hidden={m['hidden']}&heads={m['heads']}&kv_heads={kv_heads}"
            f"&ffn={m['ffn_hidden']}&vocab={m['vocab']}")
    model = load_model(spec, seq_len=m["seq"], dtype=dtype)
    gpus = row["cluster"]["gpus_used"]
    preset, per_node = SYSTEMS[row["cluster"]["nodes"][0]["gpu"]]
    cluster = load_cluster(f"{preset}:nodes={-(-gpus // per_node)}")
    if sustained_peak_fraction is not None:
        cluster = cluster.with_device_figures(cluster.devices[0].spec.name,
                                              sustained_peak_fraction=sustained_peak_fraction)
    workload = Workload(global_batch=c["global_batch"], seq_len=m["seq"], dtype=dtype, tp_comm_overlap=True,
                        fused_activation=True, loss=LossKernel.IN_PLACE)
    # Megatron-Core: overlapped TP collectives, fused SwiGLU, its own cross-entropy (the in-place one; Transformer
    # Engine's, where a preset chose it, keeps less)
    sim = Simulator(model, cluster, workload, calibration=calibration)
    plan = _plan(row, len(model.layers))
    report = sim.simulate(plan)
    preset = recipe(row)
    recomputed = None
    if not report.fits and preset is None:
        full = sim.simulate(plan.model_copy(update={"stages": tuple(s.model_copy(update={"recompute": True})
                                                                     for s in plan.stages)}))
        recomputed = full if full.fits else None
    tokens = c["global_batch"] * m["seq"] / gpus
    vp, vp_source = vp_of(row)
    measured = row["measured"]["tokens_per_s_per_gpu"]
    predicted = tokens / report.iteration_time_s
    fitting = tokens / recomputed.iteration_time_s if recomputed else predicted
    return {"id": row["id"], "model": m["name"], "gpu": row["cluster"]["nodes"][0]["gpu"], "gpus": gpus,
            "precision": c["precision"], "tp": c["tp"], "pp": c["pp"], "vp": vp, "vp_source": vp_source,
            "fits": report.fits,
            "recompute_to_fit": recomputed is not None, "recipe": preset, "dtype": dtype.value,
            "cp": c.get("cp") or 1, "fit_role": fit_role(row),
            "measured_tokens_s_gpu": measured,
            "predicted_tokens_s_gpu": predicted, "error": predicted / measured - 1,
            "predicted_fitting_tokens_s_gpu": fitting, "error_fitting": fitting / measured - 1}


def nemo() -> dict[str, Any]:
    """Every scoreable row's error, and why the others are not scored."""
    rows = json.loads(DATA.read_text())["rows"]
    scored, skipped = [], {}
    for row in rows:
        reason = _skip(row)
        if reason is None:
            try:
                scored.append(score_row(row))
                continue
            except (ValueError, ZeroDivisionError) as err:  # a published layout the plan format cannot express
                reason = f"plan not expressible: {str(err)[:60]}"
        skipped[reason] = skipped.get(reason, 0) + 1
    def summary(rows: list[dict[str, Any]], key: str = "error") -> dict[str, Any]:
        errors = sorted(abs(r[key]) for r in rows)
        return {"rows": len(rows), "median_abs_error": errors[len(errors) // 2] if errors else None,
                "worst_abs_error": errors[-1] if errors else None}
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in scored:
        groups.setdefault(f"{r['gpu']} {r['dtype']}", []).append(r)
    whole, fitting = summary(scored), summary(scored, "error_fitting")
    return {"rows": len(rows), "scored": scored, "skipped": skipped,
            "median_abs_error": whole["median_abs_error"], "worst_abs_error": whole["worst_abs_error"],
            "median_abs_error_fitting": fitting["median_abs_error"],
            "worst_abs_error_fitting": fitting["worst_abs_error"],
            "out_of_sample": summary([r for r in scored if r["fit_role"] is None]),
            "in_sample": summary([r for r in scored if r["fit_role"] is not None]),
            "groups": {name: summary(members) for name, members in sorted(groups.items())}}
