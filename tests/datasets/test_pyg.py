"""PlanDataset: targets, group indices, python attributes, caching under processed/, splits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch_geometric.data import HeteroData

from tagplan.datasets.pyg import PlanDataset
from tagplan.datasets.synthetic import MANIFEST_FILE, generate, load_samples
from tagplan.ir import Cluster, ModelGraph, Plan, Workload


def tiny_featurize(model: ModelGraph, cluster: Cluster, workload: Workload, plan: Plan) -> HeteroData:
    """A stand-in joint graph: one node per layer and per device, the layer chain, placements."""
    data = HeteroData()
    data["layer"].x = torch.ones(len(model.layers), 2)
    data["device"].x = torch.ones(cluster.num_devices, 1)
    src = torch.arange(len(model.layers) - 1)
    data["layer", "flows", "layer"].edge_index = torch.stack([src, src + 1])
    pairs = [(i, d) for s in plan.stages for i in range(*s.layers) for d in s.devices]
    data["layer", "placed_on", "device"].edge_index = torch.tensor(pairs, dtype=torch.long).t()
    return data


def _refuse(*args: object) -> HeteroData:
    raise AssertionError("processed data should have been loaded, not featurized again")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("pyg"), instances=3, plans_per_instance=3, seed=11)


def test_targets_and_attributes_follow_the_samples(root: Path) -> None:
    dataset = PlanDataset(root, featurize=tiny_featurize, force_reload=True)
    samples = load_samples(root)
    assert len(dataset) == len(samples)
    groups: dict[str, int] = {}
    for data, sample in zip(dataset, samples, strict=True):
        expected = math.log(sample.iteration_time_s / sample.lower_bound_s)
        assert data.y.shape == (1,) and data.y.dtype == torch.float
        assert data.y.item() == pytest.approx(expected, rel=1e-6)
        assert data.fit.tolist() == [1.0 if sample.fits else 0.0]
        assert data.group.dtype == torch.long
        assert data.group.tolist() == [groups.setdefault(sample.group, len(groups))]
        assert data.family == sample.family and data.gpu_types == list(sample.gpu_types)
        assert data.source == sample.source and data.group_name == sample.group
        assert data["layer"].num_nodes == sample.plan.stages[-1].layers[1]  # a plan covers every layer
    assert dataset.families == [s.family for s in samples]
    assert list(root.joinpath("processed").glob("data-*.pt"))


def test_processed_data_is_loaded_not_recomputed(root: Path) -> None:
    first = PlanDataset(root, featurize=tiny_featurize, force_reload=True)
    again = PlanDataset(root, featurize=_refuse)
    assert len(again) == len(first)
    assert torch.equal(torch.cat([d.y for d in again]), torch.cat([d.y for d in first]))


def test_a_regenerated_directory_is_processed_again(tmp_path: Path) -> None:
    generate(tmp_path, instances=1, plans_per_instance=2, seed=1)
    assert len(PlanDataset(tmp_path, featurize=tiny_featurize)) >= 1
    (tmp_path / MANIFEST_FILE).write_text((tmp_path / MANIFEST_FILE).read_text().replace('"seed": 1', '"seed": 2'))
    with pytest.raises(AssertionError, match="featurized again"):
        PlanDataset(tmp_path, featurize=_refuse)


def test_split_holds_out_families_and_gpu_types(root: Path) -> None:
    dataset = PlanDataset(root, featurize=tiny_featurize, force_reload=True)
    family = dataset.families[0]
    seen, held = dataset.split(held_out_families=[family])
    assert len(seen) + len(held) == len(dataset)
    assert set(held.families) == {family} and family not in seen.families
    gpu = dataset.graph_gpu_types[-1][0]
    seen, held = dataset.split(held_out_gpu_types=[gpu])
    assert all(gpu in types for types in held.graph_gpu_types)
    assert all(gpu not in types for types in seen.graph_gpu_types)


def test_missing_samples_file_says_how_to_generate(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="generate"):
        PlanDataset(tmp_path, featurize=tiny_featurize)


def test_real_featurizer(root: Path, tmp_path: Path) -> None:
    pytest.importorskip("tagplan.gnn.features", reason="tagplan.gnn.features (featurize) is not written yet")
    dataset = PlanDataset(root, force_reload=True)
    assert len(dataset) == len(load_samples(root))
    data = dataset[0]
    assert data["layer"].num_nodes > 0 and data["device"].num_nodes > 0
    assert torch.isfinite(torch.cat([d.y for d in dataset])).all()
