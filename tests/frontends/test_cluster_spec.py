"""`load_cluster`: preset grammar, mixed clusters, topology files and keyword overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import ClusterOptions, load_cluster, parse_cluster_spec, resolve_gpu
from tagplan.ir import LinkKind

FIXTURES = Path(__file__).parent / "fixtures"


def test_mixed_presets_are_node_major_in_spec_order() -> None:
    cluster = load_cluster("p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1")
    assert cluster.num_devices == 16
    assert [d.spec.name for d in cluster.devices] == ["V100-SXM2-16GB"] * 12 + ["T4"] * 4
    assert [n.name for n in cluster.nodes] == ["p3.8xlarge-0", "p3.8xlarge-1", "p3.8xlarge-2", "g4dn.12xlarge-0"]
    link = cluster.link(0, 12)
    assert link.kind is LinkKind.NETWORK
    v100_share, t4_share = 10e9 / 8 / 4, 50e9 / 8 / 4
    assert link.bandwidth_Bps == min(v100_share, t4_share)
    assert cluster.link(0, 4).bandwidth_Bps == v100_share
    assert cluster.network.latency_s == 30e-6


def test_mixed_latency_is_the_larger_one() -> None:
    assert load_cluster("dgx-a100-80gb").network.latency_s == 5e-6
    assert load_cluster("dgx-a100-80gb+p4d.24xlarge").network.latency_s == 15e-6


def test_keyword_defaults_and_term_options() -> None:
    cluster = load_cluster("dgx-h100", ClusterOptions(nodes=4, nic_speed_Gbps=200))
    assert cluster.num_devices == 32
    assert cluster.nodes[0].nic_bandwidth_Bps == 25e9
    cluster = load_cluster("dgx-h100:nodes=2,nics=4+dgx-h100", ClusterOptions(nodes=3))  # a term's own option wins
    assert [n.nics for n in cluster.nodes] == [4, 4, 8, 8, 8]
    assert [n.name for n in cluster.nodes][-1] == "dgx-h100-4"  # numbering continues across terms
    assert load_cluster("p3.16xlarge:gpu=v100-32gb").nodes[0].device.name == "V100-SXM2-32GB"


def test_repeated_names_stay_unique() -> None:
    names = [n.name for n in load_cluster("g4dn.12xlarge:nodes=2+p3.8xlarge+g4dn.12xlarge").nodes]
    assert len(set(names)) == len(names) == 4


@pytest.mark.parametrize(
    ("spec", "kwargs", "pattern"),
    [
        ("p3.8xlarge:nodes=0", {}, r"p3\.8xlarge:nodes: 0 is not accepted; expected a positive integer"),
        ("p3.8xlarge", {"nodes": 0}, r"nodes: 0 is not accepted"),
        ("p3.8xlarge:nodes=two", {}, r"nodes: 'two' is not accepted; expected a whole number"),
        ("p3.8xlarge:node=2", {}, r"option 'node=2' is not accepted; accepted options: nodes=\.\.\., gpu="),
        ("p3.8xlarge:2", {}, r"option '2' is not accepted"),
        ("p3.8xlarg:nodes=2", {}, r"unknown cluster preset 'p3.8xlarg'\. Did you mean 'p3.8xlarge'"),
        ("dgx-a100:nodes=2", {}, r"Did you mean .*'dgx-a100-80gb'"),
        ("dgx-h100:gpu=B900", {}, r"dgx-h100:gpu: unknown GPU type 'B900'.*Known: A10, "),
        ("g4dn.12xlarge:nic_speed_Gbps=0", {}, r"nic_speed_Gbps: 0\.0 is not accepted"),
        ("dgx-h100", {"network_latency_us": -3}, r"network_latency_us: -3"),
        ("nowhere/cluster.yaml", {}, r"'nowhere/cluster\.yaml': no such file"),
        ("p3.8xlarge:nodes=5_0000", {}, r"nodes: '5_0000' is not accepted; expected a whole number"),
        ("dgx-h100:nodes=2:nodes=3", {}, r"^cluster spec 'dgx-h100:nodes=2:nodes=3': option 'nodes' is given twice; "
         r"give each option once$"),
        ("dgx-h100:gpu=H100-SXM,nics=4,gpu=A100-SXM-80GB", {}, r"option 'gpu' is given twice"),
    ],
)
def test_bad_specs(spec: str, kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        load_cluster(spec, ClusterOptions(**kwargs))


def test_nvidia_topo_file_with_keyword_arguments() -> None:
    cluster = load_cluster(str(FIXTURES / "topo_dgx_a100.txt"),
                           ClusterOptions(nodes=2, gpu="A100-SXM-80GB", nic_speed_Gbps=200))
    assert cluster.num_devices == 16
    assert [n.name for n in cluster.nodes] == ["topo_dgx_a100-0", "topo_dgx_a100-1"]
    assert cluster.devices[0].spec.name == "A100-SXM-80GB"
    assert cluster.link(0, 1).kind is LinkKind.NVSWITCH
    assert cluster.link(0, 8).bandwidth_Bps == 25e9
    assert cluster.network.latency_s == 5e-6  # 200 Gb/s NICs: RDMA class


def test_pcie_topo_file_needs_gpu() -> None:
    with pytest.raises(SpecError, match=r"pass gpu"):
        load_cluster(str(FIXTURES / "topo_pcie4.txt"))
    assert load_cluster(str(FIXTURES / "topo_pcie4.txt"), ClusterOptions(gpu="Tesla T4")).devices[0].spec.name == "T4"


def test_nccl_xml_file() -> None:
    cluster = load_cluster(str(FIXTURES / "nccl_topo_dgx_a100.xml"), ClusterOptions(nodes=4))
    assert cluster.num_devices == 32
    assert cluster.link(0, 8).bandwidth_Bps == 25e9


def test_cluster_file_and_its_restrictions(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"node_groups": [{"gpu": "L4", "gpus_per_node": 4, "nodes": 2}]}))
    cluster = load_cluster(str(path), ClusterOptions(network_latency_us=40))
    assert cluster.num_devices == 8
    assert cluster.network.latency_s == 40e-6
    with pytest.raises(SpecError, match=r"nodes cannot be given with a cluster file"):
        load_cluster(str(path), ClusterOptions(nodes=3))


def test_custom_gpu_file(tmp_path: Path) -> None:
    path = tmp_path / "npu.yaml"
    path.write_text(yaml.safe_dump({"gpu": {"base": "A100-SXM-80GB", "name": "A100-slow", "peak_flops_bf16": 2e14}}))
    assert resolve_gpu(str(path)).peak_flops_bf16 == 2e14
    cluster = load_cluster("dgx-a100-80gb", ClusterOptions(gpu=str(path)))
    assert cluster.devices[0].spec.name == "A100-slow"


def test_nccl_tests_are_applied() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2", ClusterOptions(nccl_tests=(
        str(FIXTURES / "all_reduce_perf_1node.log"), str(FIXTURES / "nccl_tests_2nodes.log"))))
    assert cluster.link(0, 1).bandwidth_Bps == pytest.approx(233.74e9)
    assert cluster.link(0, 8).bandwidth_Bps == pytest.approx(185.67e9 / 8)


def test_parse_is_pure_and_counts_nodes() -> None:
    spec = parse_cluster_spec("p3.8xlarge:nodes=3+g4dn.12xlarge")
    assert not spec.names_file
    assert spec.nodes == 4
    assert [t.preset for t in spec.terms] == ["p3.8xlarge", "g4dn.12xlarge"]
    path = parse_cluster_spec("nowhere/cluster.yaml")  # a path is recognised without reading it
    assert path.names_file and path.path == "nowhere/cluster.yaml" and path.nodes is None
    assert parse_cluster_spec("topo.txt").names_file
    assert parse_cluster_spec("dgx-a100-80gb:gpu=npu.yaml").names_file  # a custom device is read from a file
    assert not parse_cluster_spec("dgx-a100-80gb:gpu=H100-SXM").names_file
