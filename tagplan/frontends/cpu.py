"""This machine's CPU described as a cluster: one node of CPU "devices" on shared memory.

Measuring the CPU (its `DeviceSpec`) is profiling's job (`tagplan.profiling.device.cpu_device_spec`);
describing it as a cluster is the frontends': `cpu_cluster` writes the inline cluster-file object
(docs/CLUSTER_FORMAT.md) that iteration records carry and that `parse_cluster_data` builds.
"""

from __future__ import annotations

from typing import Any

from tagplan.frontends.cluster_file import parse_cluster_data
from tagplan.ir.cluster import Cluster, DeviceSpec

CPU_CLUSTER_NAME = "this-cpu"


def cpu_cluster(spec: DeviceSpec, devices: int = 1) -> dict[str, Any]:
    """An inline cluster file object: one node of `devices` devices of `spec` (this CPU) on shared memory."""
    return {"name": CPU_CLUSTER_NAME,
            "node_groups": [{"gpu": spec.model_dump(), "gpus_per_node": devices, "fabric": "smp"}]}


def gpu_cluster(spec: DeviceSpec, devices: int = 1) -> dict[str, Any]:
    """An inline cluster file object: one node of `devices` GPUs of `spec` (this host's, measured)."""
    return {"name": f"this-{spec.name.lower()}",
            "node_groups": [{"gpu": spec.model_dump(), "gpus_per_node": devices}]}


def build_cpu_cluster(spec: DeviceSpec, devices: int = 1) -> Cluster:
    """The Cluster `cpu_cluster(spec, devices)` describes."""
    return parse_cluster_data(cpu_cluster(spec, devices))
