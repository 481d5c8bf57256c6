"""One reading of an nccl-tests log: `inspect --nccl-tests` and `calibrate` give a GPU the same bandwidth."""

from __future__ import annotations

from pathlib import Path

import pytest

from tagplan.cost.calibration import calibrated_cluster
from tagplan.datasets.traces.bundle import Bundle, Manifest, host_fingerprint, now_iso
from tagplan.datasets.traces.nccl import import_nccl_tests
from tagplan.frontends.cluster_spec import ClusterOptions, load_cluster
from tagplan.frontends.nccl_tests import parse_nccl_tests
from tagplan.training.calibrate import fit_calibration

FIXTURES = Path(__file__).parents[1] / "frontends" / "fixtures"


def test_inspect_and_calibrate_agree_on_a_two_node_log() -> None:
    log = FIXTURES / "nccl_tests_2nodes.log"
    inspected = load_cluster("dgx-a100-80gb:nodes=2", ClusterOptions(nccl_tests=(str(log),)))
    records = import_nccl_tests(log, device="A100-SXM-80GB")
    manifest = Manifest(created=now_iso(), source="test", fingerprint=host_fingerprint("A100-SXM-80GB"))
    bundle = Bundle(manifest=manifest, records=tuple(records))
    calibration = fit_calibration([bundle], iterations=False).calibration
    calibrated = calibrated_cluster(load_cluster("dgx-a100-80gb:nodes=2"), calibration)
    per_gpu_inspect = inspected.nodes[0].nic_bandwidth_per_gpu_Bps
    per_gpu_calibrate = calibrated.nodes[0].nic_bandwidth_per_gpu_Bps
    # the plateau (inspect) and a fit over every size (calibrate) of the same log: the same figure, per GPU
    assert per_gpu_calibrate == pytest.approx(per_gpu_inspect, rel=0.15)
    assert per_gpu_inspect < 30e9  # a DGX A100 GPU's 200 Gb/s NIC share, not the node's 8 NICs together


@pytest.mark.parametrize(("name", "collective"), [("allreduce_2node.log", "all_reduce"),
                                                  ("all-gather-16.log", "all_gather"),
                                                  ("reducescatter.txt", "reduce_scatter"),
                                                  ("reduce_perf.log", "reduce")])
def test_the_collective_is_read_from_any_spelling_of_the_file_name(name: str, collective: str) -> None:
    text = (FIXTURES / "nccl_tests_2nodes.log").read_text()
    text = "\n".join(line for line in text.splitlines() if "Collective test starting" not in line)
    assert parse_nccl_tests(text, source=name).collective == collective
