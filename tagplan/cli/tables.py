"""Rich tables for people: each draws the JSON-ready dict (or object) a command prints with `--json`.

The dicts come from `tagplan.ir.summary`, `PlanResult.to_json`-side objects and the commands
themselves; nothing here computes a figure, it only formats one.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tagplan.cost.report import Report
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.summary import device_ranges
from tagplan.ir.workload import LossKernel, Workload
from tagplan.search.result import Candidate, PlanResult


def si(x: float, unit: str = "") -> str:
    """`x` with an SI prefix and two decimals: `si(2.5e12, "FLOP")` is `"2.50 TFLOP"`."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".strip()


def duration(seconds: float) -> str:
    """A time for people: seconds to three decimals from 0.1 s, else milliseconds or microseconds (a small model's
    iteration printed as 0.000 s)."""
    if abs(seconds) >= 0.1 or seconds == 0:
        return f"{seconds:.3f} s"
    if abs(seconds) >= 1e-4:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} us"


def model_table(summary: dict[str, Any], max_rows: int = 40) -> Table:
    """A table of the layer sequence; runs of identical blocks are collapsed into one row."""
    title = (f"{summary['name']}: {si(summary['params'])} params, {si(summary['flops_per_sample'], 'FLOP')} "
             f"fwd/sample at seq {summary['seq_len']} ({summary['dtype']}), {summary['unique_blocks']} unique blocks")
    table = Table(title=title)
    for col in ("layers", "kind", "hash", "params", "fwd FLOP/sample", "saved act./sample"):
        table.add_column(col, justify="right" if col not in {"layers", "kind", "hash"} else "left")
    runs: list[list[dict[str, Any]]] = []
    for layer in summary["layers"]:
        if runs and runs[-1][0]["hash"] == layer["hash"]:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    for run in runs[:max_rows]:
        first = run[0]
        name = first["name"] if len(run) == 1 else f"{first['name']}..{run[-1]['name'].rsplit('.', 1)[-1]} x{len(run)}"
        table.add_row(name, first["kind"], first["hash"][:10], si(first["params"]), si(first["flops"]),
                      si(first["saved_bytes"], "B"))
    return table


def cluster_table(summary: dict[str, Any]) -> Table:
    """A table with one row per node: GPUs, fabric, NICs."""
    table = Table(title=f"{summary['name']}: {summary['num_devices']} devices "
                        f"({', '.join(summary['device_types'])})")
    for col in ("node", "devices", "GPU", "peak (dense)", "memory", "fabric", "GPU-GPU", "network/GPU"):
        table.add_column(col)
    by_index = {d["index"]: d for d in summary["devices"]}
    for node in summary["nodes"]:
        first = by_index[node["devices"][0]]
        span = f"{node['devices'][0]}-{node['devices'][-1]}"
        table.add_row(node["name"], span, f"{node['gpus']} x {node['type']}", si(first["peak_flops"], "FLOP/s"),
                      si(first["mem_bytes"], "B"), node["fabric"], _gpu_gpu(summary, node),
                      si(node["nic_bandwidth_per_gpu_Bps"], "B/s"))
    return table


def _gpu_gpu(summary: dict[str, Any], node: dict[str, Any]) -> str:
    """The node's GPU-to-GPU bandwidth: its fabric's, or on a mesh of point-to-point links (NVLink pairs, the
    other pairs over the fabric) the range of its pairs' and the fabric's for the rest (collectives run rings
    over the fast pairs: `cost.mesh_rings`)."""
    pairs = [link for link in summary["links"] if link["scope"] == "pair" and link["node"] == node["index"]]
    fabric = si(node["fabric_bandwidth_Bps"], "B/s")
    if not pairs:
        return fabric
    kinds = "/".join(sorted({link["kind"] for link in pairs}))
    low, high = (si(f([link["bandwidth_Bps"] for link in pairs]), "B/s") for f in (min, max))
    cell = f"{kinds} pairs {low}" if low == high else f"{kinds} pairs {low} to {high}"
    every = node["gpus"] * (node["gpus"] - 1) // 2
    return cell if len(pairs) >= every else f"{cell}, other pairs {fabric}"


def report_table(report: Report, plan: Plan) -> Table:
    """The report for people: headline figures, the breakdown, and one row per stage."""
    b = report.breakdown
    title = (f"iteration {duration(report.iteration_time_s)} | {report.throughput_samples_s:.2f} samples/s | "
             f"{report.tflops_per_device:.1f} TFLOP/s per device | MFU {report.mfu:.1%} | peak memory "
             f"{si(report.peak_memory_bytes, 'B')} on device {report.worst_device} "
             f"({'fits' if report.fits else 'DOES NOT FIT'})\n"
             f"compute {b.compute:.3f} s, tp {b.tp_comm:.3f} s, dp {b.dp_comm:.3f} s, pp {b.pp_comm:.3f} s, "
             f"bubble {b.bubble:.3f} s, optimizer {b.optimizer:.3f} s | {plan.micro_batches} micro-batches, "
             f"{plan.schedule.value}")
    table = Table(title=title)
    for col in ("stage", "layers", "devices", "dp x (cp x) tp", "fwd/mb", "bwd/mb", "tp/cp comm/mb", "dp sync", "p2p",
                "in flight", "zero", "recompute"):
        table.add_column(col, justify="right")
    for s, stage in zip(report.stages, plan.stages, strict=True):
        devs = stage.devices
        table.add_row(str(s.index), f"[{s.layers[0]}, {s.layers[1]})", device_ranges(devs), _mesh(s.dp, s.cp, s.tp),
                      f"{s.forward_s * 1e3:.2f} ms", f"{s.backward_s * 1e3:.2f} ms", f"{s.tp_comm_s * 1e3:.2f} ms",
                      f"{s.dp_sync_s * 1e3:.2f} ms", f"{s.p2p_s * 1e3:.3f} ms", str(s.in_flight), str(stage.zero),
                      _recompute_cell(stage))
    return table


def _recompute_cell(stage: Stage) -> str:
    """"no", "yes" (every block), or how many of the stage's blocks recompute."""
    if not stage.recompute:
        return "no"
    return "yes" if stage.recompute_layers is None else f"{stage.recompute_layers} layers"


def workload_line(workload: Workload, overlap: dict[int, bool] | None = None) -> str:
    """How the plans were costed: batch, sequence, dtype, optimizer and the gradient reduction
    (`overlap`: the best plan's data-parallel stages, overlapped or not, where a runtime decided)."""
    reduce = (workload.grad_reduce_dtype or workload.dtype.elementwise).value
    hidden = sorted(i for i, h in (overlap or {}).items() if h)
    after = sorted(i for i, h in (overlap or {}).items() if not h)
    if hidden and after:
        when = f"overlapped with the backward on stages {hidden}, after it on stages {after}"
    elif hidden or after:
        when = "overlapped with the backward" if hidden else "after the backward"
    else:
        when = "overlapped with the backward" if workload.grad_reduce_overlap else "after the backward"
    return (f"costed for: global batch {workload.global_batch}, sequence {workload.seq_len}, {workload.dtype.value}, "
            f"{workload.optimizer.value}, gradients reduced in {reduce} {when}"
            + (", tensor-parallel collectives overlapped with compute" if workload.tp_comm_overlap else "")
            + {None: "", True: ", attention fused on every device",
               False: ", attention scores materialised"}[workload.fused_attention]
            + {LossKernel.EAGER: "", LossKernel.IN_PLACE: ", the loss's fp32 softmax turned into its gradient in place",
               LossKernel.FUSED: ", the loss fused over its logits"}[workload.loss]
            + _eager_phrase(workload)
            + (", a gated MLP's activation fused (where the model has one)" if workload.fused_activation else "")
            + (", each stage keeping its micro-batches' inputs and outputs (DeepSpeed's pipeline engine)"
               if workload.keeps_stage_outputs else ""))


def _eager_phrase(workload: Workload) -> str:
    """", eager PyTorch ..." where the workload describes an eager runtime, else ""."""
    if not workload.eager:
        return ""
    if workload.autocast:
        return ", eager PyTorch under autocast over fp32 weights"
    return ", eager PyTorch over 16-bit weights" if workload.eager_16bit_weights else ", eager PyTorch"


def exporters_line(exporters: dict[str, str | None], *, fits: bool = True) -> str:
    """Which export formats run the best plan, and why each other one does not (`fits`: whether the plan
    fits in memory; the formats express one that does not, but it would not run)."""
    runs = [fmt for fmt, reason in exporters.items() if reason is None]
    refusals = "; ".join(f"{fmt}: {' '.join(reason.split()).removeprefix(f'{fmt}: ')}"
                         for fmt, reason in exporters.items() if reason is not None)
    if not runs:
        return f"no export format runs this plan ({refusals})"
    if not fits:
        return (f"exports to {', '.join(runs)}, but does not run: it does not fit in memory"
                + (f" (not {refusals})" if refusals else ""))
    return f"runs under: {', '.join(runs)}" + (f" (not {refusals})" if refusals else "")


def formats_cell(exporters: dict[str, str | None] | None, *, fits: bool, refusals: dict[str, int]) -> str:
    """A reported plan's row: the formats that run it, or which refuse it, each refusal numbered once in
    `refusals` (its text -> its number, which the table's caption lists: many rows share the same refusals)."""
    if exporters is None:
        return ""
    runs = [fmt for fmt, reason in exporters.items() if reason is None]
    if not fits:
        return "none: does not fit in memory"
    if runs:
        return ", ".join(runs)
    cited = []
    for fmt, reason in exporters.items():
        text = f"{fmt}: {' '.join(str(reason).split()).removeprefix(f'{fmt}: ')}"
        cited.append(f"{fmt} [{refusals.setdefault(text, len(refusals) + 1)}]")
    return "none: " + ", ".join(cited)


def plan_result_table(result: PlanResult) -> Table:
    """The best plan beside the baselines and the frontier, for people."""
    best = result.best
    title = (f"best plan ({best.source}, objective {result.objective.value}): {duration(best.report.iteration_time_s)} "
             f"per iteration, {best.report.throughput_samples_s:.2f} samples/s, MFU {best.report.mfu:.1%}, "
             f"peak {si(best.report.peak_memory_bytes, 'B')} | searched {result.search.evaluations} plans in "
             f"{result.search.wall_s:.1f} s")
    idle = result.idle_devices
    lines = [f"idle devices: {device_ranges(idle)}"] if idle else []
    if result.workload is not None:
        lines.append(workload_line(result.workload, result.reduce_overlap))
    if result.exporters:
        lines.append(exporters_line(result.exporters, fits=best.report.fits))
    predictor = result.predictor
    if predictor is not None and predictor.correction_applied:
        corrected = best.corrected_time_s
        said = f": {duration(corrected)} per iteration as corrected" if corrected is not None else ""
        lines.append(f"ranked by GNN {predictor.gnn}'s learned correction{said} (times shown are the simulator's; "
                     "`simulate --predictor gnn` gives both)")
    lines += [f"note: {note}" for note in result.notes]
    asked = bool(result.exporters)
    pareto = result.pareto_exporters or (None,) * len(result.pareto)
    rows: list[tuple[str, Candidate | None, str, dict[str, str | None] | None]] = [
        ("best", best, "", result.exporters or None)]
    rows += [(name, b.candidate, b.reason or b.config, result.baseline_exporters.get(name))
             for name, b in result.baselines.items()]
    rows += [(f"pareto {i}", c, "", e) for i, (c, e) in enumerate(zip(result.pareto, pareto, strict=True))]
    table_rows: list[tuple[str, ...]] = []
    refusals: dict[str, int] = {}
    for name, cand, reason, exporters in rows:
        if cand is None:
            table_rows.append((name, f"n/a: {reason}", "", "", "", "", "", "", *(("",) if asked else ())))
            continue
        stages = "; ".join(f"[{s.layers[0]},{s.layers[1]}): {_mesh(s.dp, s.cp, s.tp).replace(' ', '')} @ "
                           f"{device_ranges(s.devices)}"
                           for s in cand.plan.stages)
        if reason:  # a baseline's configuration
            stages = f"{reason}\n{stages}"
        r = cand.report
        table_rows.append((name, stages, str(cand.plan.micro_batches), duration(r.iteration_time_s),
                           f"{r.throughput_samples_s:.2f}", si(r.peak_memory_bytes, "B"), str(r.devices_used),
                           f"{r.iteration_time_s / best.report.iteration_time_s:.2f}x",
                           *((formats_cell(exporters, fits=r.fits, refusals=refusals),) if asked else ())))
    lines += [f"[{number}] {text}" for text, number in refusals.items()]
    table = Table(title=title, caption="\n".join(lines) or None, caption_justify="left")
    for col in ("plan", "stages (layers: dp x (cp x) tp @ devices)", "micro-batches", "iteration", "samples/s",
                "peak memory", "GPUs", "vs best", *(("runs under",) if asked else ())):
        table.add_column(col)
    for row in table_rows:
        table.add_row(*row)
    return table


def calibration_table(report: dict[str, Any]) -> Table:
    """`tagplan calibrate`'s report: held-out error per device and kind, before and after the fit."""
    notes = []
    if report.get("ops_mape_before") is not None:
        notes.append(f"ops, all held out: MAPE {report['ops_mape_before']:.1%} before -> "
                     f"{report['ops_mape_after']:.1%} after")
    if (causal := report.get("causal_attention")) is not None:
        notes.append(f"a causal attention call takes {causal['time_fraction']:.3f} + "
                     f"{causal['diagonal_tokens']:.0f} / keys of its unmasked time (fitted from calls timed both ways)")
    if layers := report.get("layer_records"):
        notes.append(f"{layers} layer records taken as measured block times (used as measured, not held out)")
    caption = "; ".join(notes) or None
    table = Table(title=f"held-out error of the simulator's op and collective times ({report['calibration']})",
                  caption=caption)
    for column in ("device", "what", "fitted on", "held out", "MAPE before", "MAPE after"):
        table.add_column(column, justify="right" if column not in ("device", "what") else "left")
    for row in report["rows"]:
        before = "-" if row["mape_before"] is None else f"{row['mape_before']:.1%}"
        table.add_row(row["device"], row["what"], str(row["fitted_on"]), str(row["held_out"]), before,
                      f"{row['mape_after']:.1%}")
    return table


def metrics_table(summary: dict[str, Any]) -> Table:
    """`tagplan train`'s result: the checkpoint, its version, and its metrics per split."""
    version = summary.get("version")
    state = "not registered"
    if version:
        state = f"registered as {version}" + (" (active)" if summary.get("activated") else "")
    table = Table(title=f"{summary['checkpoint']}: {state}")
    table.add_column("split")
    table.add_column("metrics")
    for split, values in summary["metrics"].items():
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        table.add_row(split, shown)
    return table


_HEADLINE = ("mape", "mape_after", "kendall_tau")  # the metrics `models list` shows per split (--json: all)


def models_table(summary: dict[str, Any]) -> Table | str:
    """`tagplan models`: the registry's versions, the active one marked (one line when there are none)."""
    fallback = f"; the planner uses {summary['fallback']}" if summary.get("fallback") else ""
    if not summary["versions"]:
        return f"no GNN versions registered{fallback}"
    table = Table(title=f"GNN versions (active: {summary['active'] or 'none'}{fallback})")
    for col in ("version", "active", "metrics"):
        table.add_column(col)
    for row in summary["versions"]:
        metrics = "; ".join(f"{split}: " + ", ".join(f"{k} {m[k]:.4g}" for k in _HEADLINE
                                                     if isinstance(m.get(k), float))
                            for split, m in row["metrics"].items() if isinstance(m, dict))
        table.add_row(row["version"], "*" if row["active"] else "", metrics)
    return table


def bundle_line(summary: dict[str, Any]) -> str:
    """A trace bundle's record counts in one line (and, when the summary holds it, what its manifest says)."""
    line = (f"{summary['bundle']}: {summary['op_records']} op records, {summary['collective_records']} collective "
            f"records, {summary['iteration_records']} iteration records, {summary.get('layer_records', 0)} layer "
            "records")
    manifest = summary.get("manifest")
    if manifest:
        line += (f"\nmeasured on {manifest['fingerprint']['device_type']} by `{manifest['source']}` "
                 f"({manifest['created']})")
    return line


def _mesh(dp: int, cp: int, tp: int) -> str:
    """A stage's mesh as the tables show it: "dp x tp", or "dp x cp x tp" under context parallelism."""
    return f"{dp} x {tp}" if cp == 1 else f"{dp} x {cp} x {tp}"
