"""Cluster files: a YAML or JSON description of node groups and the network (docs/CLUSTER_FORMAT.md).

Top level: `name` (optional, default the file's stem), `node_groups` (a non-empty list) and
`network` (optional). A node group is either a preset with overrides or a GPU type with a layout:

    node_groups:
      - gpu: A100-SXM-80GB        # catalog name, or DeviceSpec fields (`base`: a catalog device)
        nodes: 2                  # default 1
        gpus_per_node: 8          # required for a `gpu` group
        fabric: nvswitch          # nvswitch | nvlink | xgmi | pcie | pcie_host | smp; default by GPU
        fabric_bandwidth_GBps: 240   # per GPU pair, one way; default by fabric and GPU
        fabric_latency_us: 2      # default by fabric
        nics: 8                   # default 1
        nic_speed_Gbps: 200       # per NIC; default 100
        name: a100                # node name prefix; default the GPU name in lower case
      - preset: g4dn.12xlarge     # accepts nodes, gpu, nics, nic_speed_Gbps,
        nodes: 1                  # fabric_bandwidth_GBps and name as overrides
    network:
      latency_us: 5               # default: the largest of the groups' defaults
      oversubscription: 1.0       # core:edge bandwidth ratio, >= 1

Default fabric bandwidths: pcie the GPU's host link (PCIe x16 of its generation), pcie_host 5/6
of it (peer traffic through a CPU host bridge), smp 10 GB/s, nvswitch all the GPU's NVLinks x
the per-link rate, nvlink the GPU's links split evenly over its peers (at least one link per
pair), xgmi the catalog's per-pair figure; a custom device has its `base`'s links, or PCIe Gen4
and no NVLink without one. A group's default network latency is its preset's, or for a `gpu`
group 5 us with NICs of 100 Gb/s and more (RDMA), else 30 us (TCP). Nodes are named
`<prefix>-<i>`, numbered per prefix across groups, so names are unique.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError, unknown
from tagplan.frontends import catalog, presets
from tagplan.frontends.textfile import parse_structured, read_text
from tagplan.ir.cluster import Cluster, DeviceSpec, LinkKind, Network, Node

_FABRICS = ("nvswitch", "nvlink", "xgmi", "pcie", "pcie_host", "smp")
_LATENCY_S = {
    LinkKind.NVSWITCH: catalog.NVLINK_LATENCY_S, LinkKind.NVLINK: catalog.NVLINK_LATENCY_S,
    LinkKind.XGMI: catalog.NVLINK_LATENCY_S, LinkKind.PCIE: catalog.PCIE_LATENCY_S,
    LinkKind.PCIE_HOST: catalog.PCIE_HOST_LATENCY_S, LinkKind.SMP: catalog.SMP_LATENCY_S,
}
_GPU_KEYS = ("gpu", "nodes", "gpus_per_node", "fabric", "fabric_bandwidth_GBps", "fabric_latency_us",
             "nics", "nic_speed_Gbps", "name")
_PRESET_KEYS = ("preset", "nodes", "gpu", "nics", "nic_speed_Gbps", "fabric_bandwidth_GBps", "name")
DEFAULT_NIC_SPEED_GBPS = 100.0


def check_keys(data: dict[str, Any], accepted: tuple[str, ...], field: str) -> None:
    """Raise SpecError naming the first key of `data` not in `accepted`, and the accepted keys."""
    for key in data:
        if key not in accepted:
            raise SpecError(f"{field}: unknown key {key!r}; accepted keys: {', '.join(accepted)}")


def positive_int(value: Any, field: str) -> int:
    """`value` if it is an integer > 0; otherwise SpecError naming `field` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{field}: {value!r} is not accepted; expected a positive integer")
    return value


def _finite(value: Any) -> bool:
    """Whether `value` is an int or float (not a bool) with a finite float value (YAML's .inf and .nan are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float
        return False


def number(value: Any, field: str, *, minimum: float | None = None) -> float:
    """`value` as a finite float, required > 0 (or >= `minimum` when given); SpecError otherwise."""
    if _finite(value) and (value > 0 if minimum is None else value >= minimum):
        return float(value)
    expected = "a finite positive number" if minimum is None else f"a finite number >= {minimum:g}"
    raise SpecError(f"{field}: {value!r} is not accepted; expected {expected}")


def checked_device(value: Any, field: str) -> DeviceSpec:
    """`catalog.device_value(value, field)`, after refusing a custom device's non-finite figure (memory,
    bandwidth, FLOP/s: YAML's .inf or .nan), naming the field and value."""
    if isinstance(value, dict):
        for key, figure in value.items():
            if isinstance(figure, float) and not math.isfinite(figure):
                raise SpecError(f"{field}.{key}: {figure!r} is not accepted; expected a finite number")
    return catalog.device_value(value, field)


def read_data(path: str | Path) -> Any:
    """The YAML or JSON document in `path`; SpecError naming the line if it is malformed."""
    return parse_structured(read_text(path), str(path))


def default_fabric_bandwidth_Bps(links: catalog.DeviceLinks, fabric: LinkKind, gpus: int) -> float | None:
    """Per-pair one-way bandwidth (bytes/s) of `fabric` for `gpus` GPUs with `links`; None if they lack it."""
    if fabric is LinkKind.PCIE:
        return links.host_link_Bps
    if fabric is LinkKind.PCIE_HOST:
        return links.host_link_Bps * catalog.HOST_BRIDGE_FACTOR
    if fabric is LinkKind.SMP:
        return catalog.SMP_BPS
    if fabric is LinkKind.XGMI:
        return links.xgmi_pair_Bps or None
    if not links.nvlinks:
        return None
    if fabric is LinkKind.NVSWITCH:
        return links.nvlinks * links.nvlink_rate_Bps
    return max(1, links.nvlinks // max(1, gpus - 1)) * links.nvlink_rate_Bps


def _gpu_group(group: dict[str, Any], field: str, name: str) -> tuple[Node, float]:
    device = checked_device(group["gpu"], f"{field}.gpu")
    base = group["gpu"].get("base") if isinstance(group["gpu"], dict) else None
    links = catalog.device_links(catalog.lookup_device(str(base)) if base is not None else device)
    gpus = positive_int(group.get("gpus_per_node"), f"{field}.gpus_per_node")
    fabric_name = str(group.get("fabric", links.default_fabric.value)).lower()
    if fabric_name not in _FABRICS:
        raise SpecError(f"{field}.fabric: {unknown('fabric', fabric_name, _FABRICS)}")
    fabric = LinkKind(fabric_name)
    bw_Bps = default_fabric_bandwidth_Bps(links, fabric, gpus)
    if "fabric_bandwidth_GBps" in group:
        bw_Bps = number(group["fabric_bandwidth_GBps"], f"{field}.fabric_bandwidth_GBps") * 1e9
    if bw_Bps is None:
        raise SpecError(f"{field}.fabric: {device.name} has no default bandwidth on {fabric_name!r}; "
                        "give fabric_bandwidth_GBps or use fabric pcie")
    latency_s = _LATENCY_S[fabric]
    if "fabric_latency_us" in group:
        latency_s = number(group["fabric_latency_us"], f"{field}.fabric_latency_us", minimum=0) / 1e6
    nic_Bps = presets.gbps_to_Bps(number(group.get("nic_speed_Gbps", DEFAULT_NIC_SPEED_GBPS),
                                         f"{field}.nic_speed_Gbps"))
    node = Node(name=name, device=device, gpus=gpus, fabric=fabric, fabric_bandwidth_Bps=bw_Bps,
                fabric_latency_s=latency_s, nics=positive_int(group.get("nics", 1), f"{field}.nics"),
                nic_bandwidth_Bps=nic_Bps)
    return node, presets.latency_for_nic(nic_Bps)


def _preset_group(group: dict[str, Any], field: str) -> tuple[Node, float]:
    try:
        base = presets.preset(str(group["preset"]))
    except SpecError as err:
        raise SpecError(f"{field}.preset: {err}") from None
    node = presets.with_overrides(
        base.node,
        gpu=checked_device(group["gpu"], f"{field}.gpu") if "gpu" in group else None,
        nics=positive_int(group["nics"], f"{field}.nics") if "nics" in group else None,
        nic_speed_Gbps=number(group["nic_speed_Gbps"], f"{field}.nic_speed_Gbps") if "nic_speed_Gbps" in group
        else None,
    )
    if "fabric_bandwidth_GBps" in group:
        bw = number(group["fabric_bandwidth_GBps"], f"{field}.fabric_bandwidth_GBps") * 1e9
        node = presets.replace_node(node, fabric_bandwidth_Bps=bw, pair_links=())
    return node, base.network.latency_s


def _group_nodes(group: Any, field: str, counters: dict[str, int]) -> tuple[list[Node], float]:
    """The nodes of one group, named `<prefix>-<i>`, and the group's default network latency (s)."""
    if not isinstance(group, dict) or ("gpu" not in group and "preset" not in group):
        raise SpecError(f"{field}: {group!r} is not accepted; expected a mapping with 'gpu' or 'preset'")
    is_preset = "preset" in group
    check_keys(group, _PRESET_KEYS if is_preset else _GPU_KEYS, field)
    count = positive_int(group.get("nodes", 1), f"{field}.nodes")
    node, latency_s = _preset_group(group, field) if is_preset else _gpu_group(group, field, "node")
    prefix = str(group.get("name", group["preset"] if is_preset else node.device.name.lower()))
    start = counters.get(prefix, 0)
    counters[prefix] = start + count
    return [presets.replace_node(node, name=f"{prefix}-{start + i}") for i in range(count)], latency_s


def _network(data: Any, default_latency_s: float) -> Network:
    if data is None:
        return Network(latency_s=default_latency_s)
    if not isinstance(data, dict):
        raise SpecError(f"network: {data!r} is not accepted; expected a mapping with latency_us, oversubscription")
    check_keys(data, ("latency_us", "oversubscription"), "network")
    latency_s = default_latency_s
    if "latency_us" in data:
        latency_s = number(data["latency_us"], "network.latency_us", minimum=0) / 1e6
    over = number(data.get("oversubscription", 1.0), "network.oversubscription", minimum=1)
    return Network(latency_s=latency_s, oversubscription=over)


def parse_cluster_data(data: Any, *, default_name: str = "cluster") -> Cluster:
    """The cluster a parsed cluster document describes; SpecError names the bad field's path."""
    if not isinstance(data, dict):
        raise SpecError(f"cluster file: top level is {type(data).__name__}; expected a mapping with "
                        "name, node_groups, network")
    check_keys(data, ("name", "node_groups", "network"), "cluster file")
    groups = data.get("node_groups")
    if not isinstance(groups, list) or not groups:
        raise SpecError(f"node_groups: {groups!r} is not accepted; expected a non-empty list of groups")
    nodes: list[Node] = []
    latencies: list[float] = []
    counters: dict[str, int] = {}
    for i, group in enumerate(groups):
        group_nodes, latency_s = _group_nodes(group, f"node_groups[{i}]", counters)
        nodes.extend(group_nodes)
        latencies.append(latency_s)
    name = str(data.get("name") or default_name)
    return Cluster(name=name, nodes=tuple(nodes), network=_network(data.get("network"), max(latencies)))


def load_cluster_file(path: str | Path) -> Cluster:
    """The cluster described by the YAML/JSON file at `path`; SpecError on any bad input."""
    return parse_cluster_data(read_data(path), default_name=Path(path).stem)


def cluster_data(cluster: Cluster) -> dict[str, Any]:
    """`cluster` as a cluster document (`parse_cluster_data` reads it back to the same nodes and network):
    one `gpu` group per run of equal nodes, the device as its full figures. Explicit per-pair links
    (NVLink meshes from a topology dump) become the node's uniform fabric figure, the slowest pair's."""
    groups: list[dict[str, Any]] = []
    for node in cluster.nodes:
        fabric_Bps = min([node.fabric_bandwidth_Bps, *(p.bandwidth_Bps for p in node.pair_links)])
        group = {"name": node.name.rsplit("-", 1)[0], "gpu": node.device.model_dump(mode="json"),
                 "gpus_per_node": node.gpus, "fabric": node.fabric.value, "fabric_bandwidth_GBps": fabric_Bps / 1e9,
                 "fabric_latency_us": node.fabric_latency_s * 1e6, "nics": max(node.nics, 1),
                 "nic_speed_Gbps": node.nic_bandwidth_Bps * 8 / 1e9, "nodes": 1}
        if groups and {k: v for k, v in groups[-1].items() if k != "nodes"} == {k: v for k, v in group.items()
                                                                                  if k != "nodes"}:
            groups[-1]["nodes"] += 1
        else:
            groups.append(group)
    return {"name": cluster.name, "node_groups": groups,
            "network": {"latency_us": cluster.network.latency_s * 1e6,
                        "oversubscription": cluster.network.oversubscription}}
