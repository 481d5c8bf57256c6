"""Labelled samples: determinism across workers, exact re-simulation, manifest, random walks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.simulator import Simulator
from tagplan.datasets.clusters import HELD_OUT_GPU_TYPES, TRAIN_GPU_TYPES
from tagplan.datasets.models import TRANSFORMER_FAMILIES
from tagplan.datasets.synthetic import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    SAMPLES_FILE,
    Sample,
    batch_candidates,
    generate,
    instance_rng,
    label_instance,
    load_samples,
    random_instance,
    random_walk,
    rebuild,
)
from tagplan.errors import SpecError
from tagplan.ir import check_plan
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.space import PlanSpace

INSTANCES, PLANS = 4, 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("w1"), instances=INSTANCES, plans_per_instance=PLANS, seed=7)


@pytest.fixture(scope="module")
def samples(dataset: Path) -> list[Sample]:
    return load_samples(dataset)


def test_same_seed_same_samples_whatever_the_workers(dataset: Path, tmp_path: Path) -> None:
    parallel = generate(tmp_path, instances=INSTANCES, plans_per_instance=PLANS, seed=7, workers=2)
    assert (parallel / SAMPLES_FILE).read_bytes() == (dataset / SAMPLES_FILE).read_bytes()


def test_another_seed_gives_other_samples(dataset: Path, tmp_path: Path) -> None:
    other = generate(tmp_path, instances=INSTANCES, plans_per_instance=PLANS, seed=8)
    assert (other / SAMPLES_FILE).read_bytes() != (dataset / SAMPLES_FILE).read_bytes()


def test_labels_re_simulate_identically_after_rebuild(samples: list[Sample]) -> None:
    assert samples
    for sample in samples:
        model, cluster, workload, plan = rebuild(sample)
        report = Simulator(model, cluster, workload).simulate(plan)
        assert report.iteration_time_s == sample.iteration_time_s
        assert report.peak_memory_bytes == sample.peak_memory_bytes
        assert report.fits == sample.fits
        assert sample.lower_bound_s == lower_bound_s(model, cluster, workload)
        assert sample.lower_bound_s == SimulatorEvaluator(PlanSpace(Simulator(model, cluster, workload))).lower_bound_s


def test_groups_hold_distinct_plans_of_one_instance(samples: list[Sample]) -> None:
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    assert len(groups) == INSTANCES
    for members in groups.values():
        assert 1 <= len(members) <= PLANS
        assert len({m.plan.to_json() for m in members}) == len(members)
        first = members[0]
        assert all((m.model, m.cluster, m.workload, m.family) == (first.model, first.cluster, first.workload,
                                                                   first.family) for m in members)
        assert first.gpu_types == tuple(sorted(first.cluster.device_types))
    assert {s.source for s in samples} == {"random", "search"}


def test_workloads_are_sensible_for_the_cluster(samples: list[Sample]) -> None:
    for s in samples:
        assert s.workload.global_batch in batch_candidates(s.cluster.num_devices)
        assert 8 <= s.workload.global_batch <= 512
        assert s.workload.dtype is s.model.dtype and s.workload.seq_len == s.model.seq_len


def test_sample_json_round_trips(samples: list[Sample]) -> None:
    for s in samples:
        assert Sample.model_validate_json(s.to_json()) == s


def test_manifest_describes_the_samples(dataset: Path, samples: list[Sample]) -> None:
    manifest = json.loads((dataset / MANIFEST_FILE).read_text())
    assert manifest["format"] == FORMAT_VERSION and manifest["tagplan_version"]
    assert manifest["seed"] == 7 and manifest["instances"] == INSTANCES and manifest["plans_per_instance"] == PLANS
    assert manifest["instances_written"] + manifest["instances_skipped"] == INSTANCES
    assert manifest["samples"] == len(samples) == sum(manifest["sources"].values())
    assert manifest["samples_fit"] == sum(s.fits for s in samples)
    assert sum(f["samples"] for f in manifest["families"].values()) == len(samples)
    assert set(manifest["families"]) == {s.family for s in samples}
    assert manifest["gpu_types"] == sorted(TRAIN_GPU_TYPES)
    assert set(manifest["gpu_types_seen"]) == {t for s in samples for t in s.gpu_types}
    assert manifest["created"].endswith("+00:00")


def test_families_include_a_non_transformer_over_seeds() -> None:
    families = {random_instance(instance_rng(seed, 0), "g", TRAIN_GPU_TYPES).recipe.family for seed in range(40)}
    assert families - set(TRANSFORMER_FAMILIES)
    assert len(families) >= 5


def test_held_out_types_never_appear_with_the_default_types(samples: list[Sample]) -> None:
    assert not {t for s in samples for t in s.gpu_types} & set(HELD_OUT_GPU_TYPES)
    for seed in range(60):
        instance = random_instance(instance_rng(seed, 1), "g", TRAIN_GPU_TYPES)
        assert not set(instance.cluster.device_types) & set(HELD_OUT_GPU_TYPES)


def test_random_walks_yield_valid_plans() -> None:
    for seed in range(8):
        rng = instance_rng(seed, 2)
        instance = random_instance(rng, "g", TRAIN_GPU_TYPES)
        sim = Simulator(instance.model, instance.cluster, instance.workload)
        space = PlanSpace(sim)
        for _ in range(3):
            plan = random_walk(space, rng)
            assert plan is not None
            check_plan(plan, instance.model, instance.cluster)
            assert sim.simulate(plan).iteration_time_s > 0


def test_random_walks_are_reproducible_and_varied() -> None:
    instance = random_instance(instance_rng(0, 0), "g", TRAIN_GPU_TYPES)
    space = PlanSpace(Simulator(instance.model, instance.cluster, instance.workload))
    first = [random_walk(space, random.Random(5)) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    rng = random.Random(5)
    plans = {p.to_json() for p in (random_walk(space, rng) for _ in range(20)) if p is not None}
    assert len(plans) > 5


def test_an_instance_without_actions_is_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(PlanSpace, "actions", lambda self, state: [])
    instance = random_instance(instance_rng(0, 0), "g", TRAIN_GPU_TYPES)
    assert label_instance(instance, 4, random.Random(0)) == []
    out = generate(tmp_path, instances=2, plans_per_instance=2)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["instances_skipped"] == 2 and manifest["samples"] == 0
    assert load_samples(out) == []


def test_rebuild_detects_a_changed_model(samples: list[Sample]) -> None:
    stale = samples[0].model_copy(update={"model_digest": "0" * 16})
    with pytest.raises(ValueError, match="regenerate the dataset"):
        rebuild(stale)


def test_load_samples_names_the_bad_line(dataset: Path, tmp_path: Path) -> None:
    lines = (dataset / SAMPLES_FILE).read_text().splitlines()
    bad = tmp_path / SAMPLES_FILE
    bad.write_text(lines[0] + "\n{\"group\": 1}\n")
    assert len(load_samples(dataset / SAMPLES_FILE)) == len(lines)
    with pytest.raises(ValueError, match=":2: not a valid sample"):
        load_samples(bad)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"instances": -1}, "instances must be >= 0"),
    ({"instances": 1, "plans_per_instance": 0}, "plans_per_instance must be >= 1"),
    ({"instances": 1, "workers": 0}, "workers must be >= 1"),
    ({"instances": 1, "gpu_types": ()}, "gpu_types must be a non-empty"),
])
def test_generate_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate(tmp_path, **kwargs)  # type: ignore[arg-type]


def test_generate_rejects_unknown_gpu_types(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="unknown GPU type 'R100'"):
        generate(tmp_path, instances=1, gpu_types=("R100",))


def test_generate_accepts_held_out_types(tmp_path: Path) -> None:
    out = generate(tmp_path, instances=2, plans_per_instance=2, seed=3, gpu_types=HELD_OUT_GPU_TYPES)
    types = {t for s in load_samples(out) for t in s.gpu_types}
    assert types and types <= set(HELD_OUT_GPU_TYPES)
