"""JSON-ready summaries of IR objects for tools: plain dicts with stable keys (a contract; see DESIGN).

No rendering here: `tagplan.cli.tables` draws these dicts for people, the service returns them as JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import DType


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
    nodes: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
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


def device_ranges(devices: Sequence[int]) -> str:
    """Device ids as ranges in their order: "0-7, 16-23"; a single id alone."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
