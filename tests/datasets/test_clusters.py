"""Random clusters: sizes, type mixes, fabrics consistent with the GPU type, held-out types."""

from __future__ import annotations

import random

import pytest

from tagplan.datasets.clusters import GPU_COUNTS, HELD_OUT_GPU_TYPES, NIC_SPEEDS_GBPS, TRAIN_GPU_TYPES, random_cluster
from tagplan.frontends.catalog import CATALOG
from tagplan.frontends.presets import gbps_to_Bps
from tagplan.ir import Cluster, LinkKind

FABRIC = {
    "A100-SXM-40GB": LinkKind.NVSWITCH, "A100-SXM-80GB": LinkKind.NVSWITCH, "H100-SXM": LinkKind.NVSWITCH,
    "H200-SXM": LinkKind.NVSWITCH, "T4": LinkKind.PCIE, "L4": LinkKind.PCIE, "A10": LinkKind.PCIE,
    "L40S": LinkKind.PCIE, "RTX4090": LinkKind.PCIE_HOST, "MI250X": LinkKind.XGMI, "MI300X": LinkKind.XGMI,
}


def _clusters(n: int, types: tuple[str, ...] = TRAIN_GPU_TYPES, seed: int = 0) -> list[Cluster]:
    rng = random.Random(seed)
    return [random_cluster(rng, gpu_types=types) for _ in range(n)]


def test_type_lists_are_disjoint_catalog_names() -> None:
    assert not set(TRAIN_GPU_TYPES) & set(HELD_OUT_GPU_TYPES)
    assert set(TRAIN_GPU_TYPES) | set(HELD_OUT_GPU_TYPES) <= set(CATALOG)


def test_sizes_and_mixes_stay_in_range() -> None:
    clusters = _clusters(300)
    assert {len(c.nodes) for c in clusters} == {*range(1, 9), 16}
    assert {len(c.device_types) for c in clusters} == {1, 2}
    for c in clusters:
        assert set(c.device_types) <= set(TRAIN_GPU_TYPES)
        assert len({n.name for n in c.nodes}) == len(c.nodes)
        assert 5e-6 <= c.network.latency_s <= 30e-6 and 1.0 <= c.network.oversubscription <= 2.0
        for node in c.nodes:
            assert node.gpus in GPU_COUNTS and 1 <= node.nics <= 8
            assert node.nic_bandwidth_Bps in {gbps_to_Bps(g) for g in NIC_SPEEDS_GBPS}


def test_fabric_follows_the_gpu_type() -> None:
    for c in _clusters(300) + _clusters(100, HELD_OUT_GPU_TYPES):
        for node in c.nodes:
            name = node.device.name
            if name in FABRIC:
                assert node.fabric is FABRIC[name], (name, node.fabric)
            if name.startswith("V100-SXM2") and node.gpus >= 2:  # the DGX-1V mesh or a quad of it
                assert node.pair_links and all(p.kind is LinkKind.NVLINK for p in node.pair_links)
            if node.fabric is LinkKind.NVSWITCH:
                assert node.fabric_bandwidth_Bps > 200e9


def test_eight_pcie_cards_cross_sockets() -> None:
    nodes = [n for c in _clusters(400) for n in c.nodes if n.fabric is LinkKind.PCIE and n.gpus == 8]
    assert nodes
    for node in nodes:
        smp = {(p.a, p.b) for p in node.pair_links if p.kind is LinkKind.SMP}
        assert smp == {(a, b) for a in range(4) for b in range(4, 8)}


def test_nodes_of_one_type_are_alike() -> None:
    for c in _clusters(100):
        by_type: dict[str, set[tuple[int, int, float]]] = {}
        for node in c.nodes:
            by_type.setdefault(node.device.name, set()).add((node.gpus, node.nics, node.nic_bandwidth_Bps))
        assert all(len(kinds) == 1 for kinds in by_type.values())


def test_held_out_types_only_when_asked() -> None:
    seen = {t for c in _clusters(300) for t in c.device_types}
    assert not seen & set(HELD_OUT_GPU_TYPES)
    held = {t for c in _clusters(100, HELD_OUT_GPU_TYPES) for t in c.device_types}
    assert held == set(HELD_OUT_GPU_TYPES)


def test_deterministic_for_a_seed() -> None:
    assert _clusters(10, seed=5) == _clusters(10, seed=5)


def test_empty_type_list_is_rejected() -> None:
    with pytest.raises(ValueError, match="gpu_types is empty"):
        random_cluster(random.Random(0), gpu_types=())
