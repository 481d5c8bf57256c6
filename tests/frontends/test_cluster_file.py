"""Cluster files: the documented schema, defaults, and errors that name the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tagplan.errors import SpecError
from tagplan.frontends.catalog import CATALOG
from tagplan.frontends.cluster_file import load_cluster_file, parse_cluster_data
from tagplan.ir import LinkKind

DOC = Path(__file__).parents[2] / "docs" / "CLUSTER_FORMAT.md"


def _group(**group: Any) -> dict[str, Any]:
    return {"node_groups": [group]}


def test_documented_example_parses() -> None:
    block = re.search(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert block is not None
    cluster = parse_cluster_data(yaml.safe_load(block.group(1)))
    assert cluster.name == "my-cluster"
    assert cluster.num_devices == 28
    assert [n.name for n in cluster.nodes] == ["a100-0", "a100-1", "g4dn.12xlarge-0", "h100-sxm-capped-0"]
    assert cluster.link(0, 1).kind is LinkKind.NVSWITCH
    assert cluster.link(0, 8).bandwidth_Bps == 25e9  # 8 x 200 Gb/s over 8 GPUs
    assert cluster.link(0, 16).bandwidth_Bps == pytest.approx(50e9 / 8 / 4)  # g4dn's share is smaller
    custom = cluster.nodes[3]
    assert custom.device.peak_flops_bf16 == 7e14 and custom.device.mem_bytes == CATALOG["H100-SXM"].mem_bytes
    assert custom.fabric_bandwidth_Bps == pytest.approx(18 * 20.6e9)  # base H100-SXM's links
    assert cluster.network.latency_s == 5e-6


def test_json_file_and_default_name(tmp_path: Path) -> None:
    path = tmp_path / "lab.json"
    path.write_text(json.dumps({"node_groups": [{"preset": "dgx-h100", "nodes": 2}]}))
    cluster = load_cluster_file(path)
    assert cluster.name == "lab"
    assert cluster.num_devices == 16
    assert [n.name for n in cluster.nodes] == ["dgx-h100-0", "dgx-h100-1"]


def test_malformed_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nnode_groups:\n  - gpu: A100\n    nodes: [1\n")
    with pytest.raises(SpecError, match=r"bad\.yaml.*line \d+"):
        load_cluster_file(path)


def test_malformed_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"node_groups": [\n  {"gpu": "T4",}\n]}')
    with pytest.raises(SpecError, match=r"bad\.json.*line 2"):
        load_cluster_file(path)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (_group(gpu="A100-SXM-80GB", gpus_per_node=0), r"node_groups\[0\]\.gpus_per_node: 0 .*positive integer"),
        (_group(gpu="A100-SXM-80GB", gpus_per_node=8, nodes=-2), r"node_groups\[0\]\.nodes: -2"),
        (_group(gpu="A100-SXM-80GB", gpus_per_node=2.5), r"gpus_per_node: 2\.5"),
        (_group(gpu="A100-SXM-80GB"), r"gpus_per_node: None .*positive integer"),
        (_group(gpu="A100", gpus_per_node=8, fabrik="x"), r"unknown key 'fabrik'; accepted keys: gpu, nodes"),
        (_group(gpu="A100", gpus_per_node=8, fabric="ib"), r"node_groups\[0\]\.fabric: unknown fabric 'ib'"),
        (_group(gpu="T4", gpus_per_node=4, fabric="nvswitch"), r"fabric: T4 has no default bandwidth"),
        (_group(gpu="T4", gpus_per_node=4, nic_speed_Gbps="fast"), r"nic_speed_Gbps: 'fast' .*positive number"),
        (_group(gpu="R100", gpus_per_node=8), r"node_groups\[0\]\.gpu: unknown GPU type 'R100'.*Known: A10"),
        (_group(preset="dgx-a100", nodes=1), r"node_groups\[0\]\.preset: unknown cluster preset 'dgx-a100'"),
        (_group(preset="dgx-h100", gpus_per_node=4), r"unknown key 'gpus_per_node'; accepted keys: preset"),
        (_group(nodes=2), r"node_groups\[0\]: .*'gpu' or 'preset'"),
        ({"node_groups": []}, r"node_groups: \[\] .*non-empty list"),
        ([1, 2], r"top level is list"),
        ({"node_groups": [{"preset": "g4dn.12xlarge"}], "nodes": 3}, r"unknown key 'nodes'"),
        ({"node_groups": [{"preset": "g4dn.12xlarge"}], "network": {"oversubscription": 0.5}},
         r"network\.oversubscription: 0\.5 .*>= 1"),
        ({"node_groups": [{"preset": "g4dn.12xlarge"}], "network": {"latency_us": -1}}, r"network\.latency_us: -1"),
    ],
)
def test_validation_errors_name_field_value_and_accepted(data: Any, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        parse_cluster_data(data)


@pytest.mark.parametrize(
    ("yaml_text", "pattern"),
    [
        ("node_groups: [{gpu: T4, gpus_per_node: 4, fabric_bandwidth_GBps: .inf}]",
         r"node_groups\[0\]\.fabric_bandwidth_GBps: inf is not accepted; expected a finite positive number"),
        ("node_groups: [{gpu: T4, gpus_per_node: 4, fabric_bandwidth_GBps: .nan}]", r"fabric_bandwidth_GBps: nan"),
        ("node_groups: [{gpu: T4, gpus_per_node: 4, fabric_latency_us: .inf}]",
         r"fabric_latency_us: inf is not accepted; expected a finite number >= 0"),
        ("node_groups: [{gpu: T4, gpus_per_node: 4, nic_speed_Gbps: .inf}]", r"\]\.nic_speed_Gbps: inf"),
        ("node_groups: [{preset: g4dn.12xlarge, fabric_bandwidth_GBps: .inf}]", r"\]\.fabric_bandwidth_GBps: inf"),
        ("node_groups: [{preset: g4dn.12xlarge, nic_speed_Gbps: .inf}]", r"\]\.nic_speed_Gbps: inf"),
        ("node_groups: [{gpu: {base: H100-SXM, mem_bandwidth_Bps: .inf}, gpus_per_node: 8}]",
         r"node_groups\[0\]\.gpu\.mem_bandwidth_Bps: inf is not accepted; expected a finite number"),
        ("node_groups: [{gpu: {base: H100-SXM, mem_bytes: .inf}, gpus_per_node: 8}]", r"\.gpu\.mem_bytes: inf"),
        ("node_groups: [{preset: g4dn.12xlarge, gpu: {base: T4, peak_flops_fp16: -.inf}}]",
         r"\.gpu\.peak_flops_fp16: -inf"),
        ("node_groups: [{preset: g4dn.12xlarge}]\nnetwork: {latency_us: .inf}",
         r"network\.latency_us: inf is not accepted; expected a finite number >= 0"),
        ("node_groups: [{preset: g4dn.12xlarge}]\nnetwork: {oversubscription: .inf}",
         r"network\.oversubscription: inf is not accepted; expected a finite number >= 1"),
    ],
)
def test_non_finite_figures_are_refused(yaml_text: str, pattern: str) -> None:
    """YAML's .inf and .nan in any bandwidth, latency, memory or custom device figure name the field."""
    with pytest.raises(SpecError, match=pattern):
        parse_cluster_data(yaml.safe_load(yaml_text))


def test_second_group_error_names_its_index() -> None:
    data = {"node_groups": [{"preset": "g4dn.12xlarge"}, {"gpu": "L4", "gpus_per_node": 0}]}
    with pytest.raises(SpecError, match=r"node_groups\[1\]\.gpus_per_node"):
        parse_cluster_data(data)


@pytest.mark.parametrize(
    ("gpu", "gpus", "fabric", "expected_Bps"),
    [
        ("V100-SXM2-16GB", 4, LinkKind.NVLINK, 40e9),  # 6 links over 3 peers: 2 each
        ("V100-SXM2-16GB", 8, LinkKind.NVLINK, 20e9),  # at least one link per pair
        ("A100-SXM-80GB", 8, LinkKind.NVSWITCH, 240e9),
        ("H200-SXM", 8, LinkKind.NVSWITCH, 18 * 20.6e9),
        ("MI300X", 8, LinkKind.XGMI, 64e9),
        ("L40S", 4, LinkKind.PCIE, 24e9),
        ("T4", 4, LinkKind.PCIE, 12e9),
    ],
)
def test_default_fabric_and_bandwidth_by_gpu(gpu: str, gpus: int, fabric: LinkKind, expected_Bps: float) -> None:
    node = parse_cluster_data(_group(gpu=gpu, gpus_per_node=gpus)).nodes[0]
    assert node.fabric is fabric
    assert node.fabric_bandwidth_Bps == pytest.approx(expected_Bps)


def test_explicit_fabric_figures_and_nics() -> None:
    node = parse_cluster_data(_group(gpu="L4", gpus_per_node=8, fabric="pcie_host", fabric_bandwidth_GBps=16,
                                     fabric_latency_us=7, nics=2, nic_speed_Gbps=100)).nodes[0]
    assert (node.fabric, node.fabric_bandwidth_Bps, node.fabric_latency_s) == (LinkKind.PCIE_HOST, 16e9, 7e-6)
    assert (node.nics, node.nic_bandwidth_Bps) == (2, 12.5e9)


def test_preset_group_overrides() -> None:
    node = parse_cluster_data(_group(preset="p3.16xlarge", gpu="V100-SXM2-32GB", nic_speed_Gbps=100,
                                     fabric_bandwidth_GBps=100)).nodes[0]
    assert node.device.name == "V100-SXM2-32GB"
    assert node.nic_bandwidth_Bps == 12.5e9
    assert node.pair_links == () and node.fabric_bandwidth_Bps == 100e9


def test_node_names_are_unique_across_groups() -> None:
    cluster = parse_cluster_data({"node_groups": [{"gpu": "T4", "gpus_per_node": 1, "nodes": 2},
                                                  {"gpu": "t4", "gpus_per_node": 2}]})
    assert [n.name for n in cluster.nodes] == ["t4-0", "t4-1", "t4-2"]


def test_network_latency_defaults_to_the_slowest_group() -> None:
    mixed = parse_cluster_data({"node_groups": [{"preset": "dgx-a100-80gb"}, {"preset": "g4dn.12xlarge"}]})
    assert mixed.network.latency_s == 30e-6
    slow_nics = parse_cluster_data(_group(gpu="A10", gpus_per_node=4, nic_speed_Gbps=25))
    assert slow_nics.network.latency_s == 30e-6
    given = parse_cluster_data({**_group(gpu="A10", gpus_per_node=4), "network": {"latency_us": 12}})
    assert given.network.latency_s == 12e-6
