"""nccl-tests logs: parsing, the bandwidth plateau, and applying measurements to a cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.cluster_spec import ClusterOptions, load_cluster
from tagplan.frontends.nccl_tests import apply_nccl_tests, load_nccl_tests, parse_nccl_tests
from tagplan.ir import LinkKind

FIXTURES = Path(__file__).parent / "fixtures"
ONE_NODE = FIXTURES / "all_reduce_perf_1node.log"
TWO_NODES = FIXTURES / "nccl_tests_2nodes.log"

V100_ALLGATHER = """# nThread 1 nGpus 8 minBytes 1048576 maxBytes 4194304 step: 2(factor) warmup iters: 5 iters: 20
#  Rank  0 Pid  7001 on p3-host device  0 [0x00] Tesla V100-SXM2-16GB
#  Rank  1 Pid  7001 on p3-host device  1 [0x00] Tesla V100-SXM2-16GB
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
     1048576         32768     float    none      -1    30.00   34.95   30.58    N/A      N/A     N/A     N/A    N/A
     4194304        131072     float    none      -1    80.00   52.43   45.88    N/A      N/A     N/A     N/A    N/A
# Avg bus bandwidth    : 38.23
"""


def test_single_node_log() -> None:
    result = load_nccl_tests(ONE_NODE)
    assert result.collective == "all_reduce"  # from the file name
    assert (result.ranks, result.hosts) == (8, ("dgx-a100-01",))
    assert result.device_name == "NVIDIA A100-SXM4-80GB"
    assert len(result.rows) == 14
    first = result.rows[0]
    assert (first.size_bytes, first.count, first.dtype) == (1048576, 262144, "float")
    assert first.out_of_place.time_s == pytest.approx(35.85e-6)
    assert first.out_of_place.algbw_Bps == pytest.approx(29.25e9)
    assert first.out_of_place.busbw_Bps == pytest.approx(51.19e9)
    assert first.in_place is not None and first.in_place.busbw_Bps == pytest.approx(51.12e9)
    assert result.peak_busbw_Bps == pytest.approx(233.74e9)  # the plateau, not the last row
    assert result.avg_busbw_Bps == pytest.approx(190.4639e9)


def test_two_node_log_skips_nccl_info_lines() -> None:
    result = load_nccl_tests(TWO_NODES)
    assert result.collective == "all_reduce"  # from "# Collective test starting"
    assert result.ranks == 16
    assert result.hosts == ("dgx-a100-01", "dgx-a100-02")
    assert result.peak_busbw_Bps == pytest.approx(185.67e9)


def test_no_in_place_variant_and_old_rank_lines() -> None:
    result = parse_nccl_tests(V100_ALLGATHER, source="logs/all_gather_perf.txt")
    assert result.collective == "all_gather"
    assert result.ranks == 2
    assert all(row.in_place is None for row in result.rows)
    assert result.peak_busbw_Bps == pytest.approx(45.88e9)


def test_single_host_sets_a_uniform_fabric() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    measured = apply_nccl_tests(cluster, load_nccl_tests(ONE_NODE))
    assert measured.link(0, 1).bandwidth_Bps == pytest.approx(233.74e9)
    assert measured.link(8, 9).bandwidth_Bps == pytest.approx(233.74e9)
    assert measured.link(0, 8) == cluster.link(0, 8)  # the network is untouched
    assert cluster.link(0, 1).bandwidth_Bps == 240e9  # the input is not modified


def test_single_host_drops_pair_links() -> None:
    cluster = load_cluster("p3.16xlarge")
    measured = apply_nccl_tests(cluster, parse_nccl_tests(V100_ALLGATHER))
    assert measured.nodes[0].pair_links == ()
    assert measured.link(0, 3).bandwidth_Bps == measured.link(0, 5).bandwidth_Bps == pytest.approx(45.88e9)
    assert measured.link(0, 3).kind is LinkKind.SMP  # the fabric kind is kept


def test_two_hosts_set_the_nic_bandwidth() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    measured = apply_nccl_tests(cluster, load_nccl_tests(TWO_NODES))
    per_nic = 185.67e9 / 8  # one ring per NIC: busbw = 8 NICs x one NIC's bandwidth
    assert measured.nodes[0].nic_bandwidth_Bps == pytest.approx(per_nic)
    assert measured.link(0, 8).bandwidth_Bps == pytest.approx(per_nic * 8 / 8)
    assert measured.link(0, 1) == cluster.link(0, 1)


def test_only_nodes_of_the_tested_device_change() -> None:
    cluster = load_cluster("dgx-a100-80gb+g4dn.12xlarge")
    measured = apply_nccl_tests(cluster, load_nccl_tests(ONE_NODE))
    assert measured.link(0, 1).bandwidth_Bps == pytest.approx(233.74e9)
    assert measured.nodes[1] == cluster.nodes[1]


def test_device_missing_from_a_mixed_cluster() -> None:
    cluster = load_cluster("p3.8xlarge+g4dn.12xlarge")
    with pytest.raises(SpecError, match=r"ran on 'NVIDIA A100-SXM4-80GB'.*V100-SXM2-16GB, T4"):
        apply_nccl_tests(cluster, load_nccl_tests(ONE_NODE))


def test_another_gpus_log_is_refused_by_a_one_type_cluster() -> None:
    """An A100 log no longer replaces an H100 cluster's bandwidths: names compare through the catalog."""
    with pytest.raises(SpecError, match=r"all_reduce_perf_1node\.log: nccl-tests ran on 'NVIDIA A100-SXM4-80GB' "
                                        r"\(A100-SXM-80GB in the device catalog\); the cluster's devices are "
                                        r"H100-SXM, none of them that one"):
        load_cluster("dgx-h100:nodes=2", ClusterOptions(nccl_tests=(str(ONE_NODE),)))
    with pytest.raises(SpecError, match=r"ran on 'NVIDIA A100-SXM4-80GB'.*are A100-SXM-40GB"):
        apply_nccl_tests(load_cluster("dgx-a100-40gb"), load_nccl_tests(ONE_NODE))  # another catalog GPU


def test_a_gpu_the_catalog_does_not_know_applies_to_a_one_type_cluster() -> None:
    text = ONE_NODE.read_text().replace("NVIDIA A100-SXM4-80GB", "NVIDIA Graphics Device")
    cluster = load_cluster("dgx-h100:nodes=2")
    measured = apply_nccl_tests(cluster, parse_nccl_tests(text))
    assert measured.link(0, 1).bandwidth_Bps == measured.link(8, 9).bandwidth_Bps == pytest.approx(233.74e9)
    with pytest.raises(SpecError, match=r"ran on 'NVIDIA Graphics Device'; .*V100-SXM2-16GB, T4"):
        apply_nccl_tests(load_cluster("p3.8xlarge+g4dn.12xlarge"), parse_nccl_tests(text))  # mixed: cannot tell


def test_a_log_applies_to_a_one_type_cluster_of_a_gpu_the_catalog_does_not_know(tmp_path: Path) -> None:
    """A cluster file's own GPU (a power-capped A100 described with `base:`) cannot be compared with the log's."""
    path = tmp_path / "c.yaml"
    path.write_text("name: custom\nnode_groups:\n  - gpu: {base: A100-SXM-80GB, name: a100-400w, "
                    "peak_flops_bf16: 2.8e14}\n    gpus_per_node: 8\n")
    measured = apply_nccl_tests(load_cluster(str(path)), parse_nccl_tests(ONE_NODE.read_text()))
    assert measured.link(0, 1).bandwidth_Bps == pytest.approx(233.74e9)


def test_malformed_row_names_its_line() -> None:
    text = V100_ALLGATHER.replace("80.00   52.43", "80.00   fast!")
    with pytest.raises(SpecError, match=r"line 6: .*expected time \(us\), algbw and busbw"):
        parse_nccl_tests(text)


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("# nothing here\n", r"no data rows"),
        ("     1048576  262144  float  sum  -1  1.0  2.0  3.0  0  1.0  2.0  3.0  0\n", r"no '#  Rank N"),
        ("#  Rank  0 Pid 1 on h device 0 [0x0] T4\n 1024 256 float 1.0 2.0\n", r"line 2: 5 columns"),
    ],
)
def test_incomplete_logs(text: str, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        parse_nccl_tests(text)


def test_one_rank_cannot_measure_a_link() -> None:
    text = "#  Rank  0 Pid 1 on h device 0 [0x0] Tesla T4\n 1024 256 float sum -1 1.0 2.0 0.0 0 1.0 2.0 0.0 0\n"
    with pytest.raises(SpecError, match=r"1 rank"):
        apply_nccl_tests(load_cluster("g4dn.12xlarge"), parse_nccl_tests(text))
