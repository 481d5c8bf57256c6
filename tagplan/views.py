"""Summaries of IR objects for people (rich tables) and tools (JSON-ready dicts, stable keys)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from tagplan.cost.report import Report
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.ir.workload import DType
from tagplan.search.result import Candidate, PlanResult


def model_summary(model: ModelGraph, *, batch: int = 1) -> dict[str, Any]:
    """`{name, params, flops_per_sample, layers: [{name, hash, params, flops}], unique_blocks, ...}`.

    Layer `flops` are forward FLOPs per sample; `flops_per_batch` is forward for `batch` samples.
    """
    layers = []
    for i, layer in enumerate(model.layers):
        block = model.block_of(i)
        layers.append({"name": layer.name, "hash": block.hash, "kind": block.kind, "params": block.params,
                       "flops": block.flops, "param_bytes": block.param_bytes,
                       "saved_bytes": block.saved_bytes, "output_bytes": block.output_bytes})
    return {
        "name": model.name, "family": model.family, "params": model.params,
        "flops_per_sample": model.flops_per_sample, "unique_blocks": model.unique_blocks,
        "seq_len": model.seq_len, "dtype": model.dtype.value, "batch": batch,
        "flops_per_batch": model.flops_per_sample * batch, "layers": layers,
    }


def cluster_summary(cluster: Cluster, *, dtype: DType = DType.BF16) -> dict[str, Any]:
    """`{name, devices: [{index, node, type, peak_flops, mem_bytes}], nodes: [...], links: [...]}`.

    `peak_flops` is dense FLOP/s in `dtype`; bandwidths are unidirectional bytes/s.
    """
    devices = [{"index": d.index, "node": d.node, "local": d.local, "type": d.spec.name,
                "peak_flops": d.spec.peak_flops(dtype), "mem_bytes": d.spec.mem_bytes,
                "mem_bandwidth_Bps": d.spec.mem_bandwidth_Bps} for d in cluster.devices]
    nodes, links = [], []
    for n, node in enumerate(cluster.nodes):
        members = list(cluster.node_devices(n))
        nodes.append({"index": n, "name": node.name, "type": node.device.name, "gpus": node.gpus,
                      "devices": members, "fabric": node.fabric.value,
                      "fabric_bandwidth_Bps": node.fabric_bandwidth_Bps, "nics": node.nics,
                      "nic_bandwidth_Bps": node.nic_bandwidth_Bps,
                      "nic_bandwidth_per_gpu_Bps": node.nic_bandwidth_per_gpu_Bps})
        if node.gpus > 1:
            links.append({"scope": "intra", "node": n, "kind": node.fabric.value, "devices": members,
                          "bandwidth_Bps": node.fabric_bandwidth_Bps, "latency_s": node.fabric_latency_s})
        for p in node.pair_links:
            links.append({"scope": "pair", "node": n, "kind": p.kind.value, "src": members[p.a],
                          "dst": members[p.b], "bandwidth_Bps": p.bandwidth_Bps, "latency_s": p.latency_s})
        if len(cluster.nodes) > 1:
            links.append({"scope": "nic", "node": n, "kind": "network", "nics": node.nics,
                          "bandwidth_Bps": node.nic_bandwidth_per_gpu_Bps, "latency_s": cluster.network.latency_s})
    return {"name": cluster.name, "num_devices": cluster.num_devices, "device_types": list(cluster.device_types),
            "devices": devices, "nodes": nodes, "links": links,
            "network": {"latency_s": cluster.network.latency_s,
                        "oversubscription": cluster.network.oversubscription}}


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".strip()


def model_table(summary: dict[str, Any], max_rows: int = 40) -> Table:
    """A table of the layer sequence; runs of identical blocks are collapsed into one row."""
    title = (f"{summary['name']}: {_si(summary['params'])} params, {_si(summary['flops_per_sample'], 'FLOP')} "
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
        table.add_row(name, first["kind"], first["hash"][:10], _si(first["params"]), _si(first["flops"]),
                      _si(first["saved_bytes"], "B"))
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
        table.add_row(node["name"], span, f"{node['gpus']} x {node['type']}", _si(first["peak_flops"], "FLOP/s"),
                      _si(first["mem_bytes"], "B"), node["fabric"], _si(node["fabric_bandwidth_Bps"], "B/s"),
                      _si(node["nic_bandwidth_per_gpu_Bps"], "B/s"))
    return table


def report_table(report: Report, plan: Plan) -> Table:
    """The report for people: headline figures, the breakdown, and one row per stage."""
    b = report.breakdown
    title = (f"iteration {report.iteration_time_s:.3f} s | {report.throughput_samples_s:.2f} samples/s | "
             f"{report.tflops_per_device:.1f} TFLOP/s per device | MFU {report.mfu:.1%} | peak memory "
             f"{_si(report.peak_memory_bytes, 'B')} on device {report.worst_device} "
             f"({'fits' if report.fits else 'DOES NOT FIT'})\n"
             f"compute {b.compute:.3f} s, tp {b.tp_comm:.3f} s, dp {b.dp_comm:.3f} s, pp {b.pp_comm:.3f} s, "
             f"bubble {b.bubble:.3f} s, optimizer {b.optimizer:.3f} s | {plan.micro_batches} micro-batches, "
             f"{plan.schedule.value}")
    table = Table(title=title)
    for col in ("stage", "layers", "devices", "dp x tp", "fwd/mb", "bwd/mb", "tp comm/mb", "dp sync", "p2p",
                "in flight", "zero", "recompute"):
        table.add_column(col, justify="right")
    for s, stage in zip(report.stages, plan.stages, strict=True):
        devs = stage.devices
        table.add_row(str(s.index), f"[{s.layers[0]}, {s.layers[1]})", f"{devs[0]}..{devs[-1]}", f"{s.dp} x {s.tp}",
                      f"{s.forward_s * 1e3:.2f} ms", f"{s.backward_s * 1e3:.2f} ms", f"{s.tp_comm_s * 1e3:.2f} ms",
                      f"{s.dp_sync_s * 1e3:.2f} ms", f"{s.p2p_s * 1e3:.3f} ms", str(s.in_flight), str(stage.zero),
                      "yes" if stage.recompute else "no")
    return table


def plan_result_table(result: PlanResult) -> Table:
    """The best plan beside the baselines and the frontier, for people."""
    best = result.best
    title = (f"best plan ({best.source}, objective {result.objective.value}): {best.report.iteration_time_s:.3f} s "
             f"per iteration, {best.report.throughput_samples_s:.2f} samples/s, MFU {best.report.mfu:.1%}, "
             f"peak {_si(best.report.peak_memory_bytes, 'B')} | searched {result.search.evaluations} plans in "
             f"{result.search.wall_s:.1f} s")
    table = Table(title=title)
    for col in ("plan", "stages (layers: dp x tp @ devices)", "micro-batches", "iteration", "samples/s",
                "peak memory", "GPUs", "vs best"):
        table.add_column(col)
    rows: list[tuple[str, Candidate | None, str]] = [("best", best, "")]
    rows += [(name, b.candidate, b.reason) for name, b in result.baselines.items()]
    rows += [(f"pareto {i}", c, "") for i, c in enumerate(result.pareto)]
    for name, cand, reason in rows:
        if cand is None:
            table.add_row(name, f"n/a: {reason}", "", "", "", "", "", "")
            continue
        stages = "; ".join(f"[{s.layers[0]},{s.layers[1]}): {s.dp}x{s.tp} @ {s.devices[0]}..{s.devices[-1]}"
                           for s in cand.plan.stages)
        r = cand.report
        table.add_row(name, stages, str(cand.plan.micro_batches), f"{r.iteration_time_s:.3f} s",
                      f"{r.throughput_samples_s:.2f}", _si(r.peak_memory_bytes, "B"), str(r.devices_used),
                      f"{r.iteration_time_s / best.report.iteration_time_s:.2f}x")
    return table
