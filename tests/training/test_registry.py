from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.training.registry import Registry


def test_versions_activation_and_cards(tmp_path: Path) -> None:
    ckpt = tmp_path / "m.pt"
    ckpt.write_bytes(b"weights")
    reg = Registry(tmp_path / "reg")
    assert reg.versions() == [] and reg.active() is None
    v1 = reg.register(ckpt, {"metrics": {"tau": 0.9}})
    assert (v1, reg.active()) == ("v0001", "v0001")  # the first version becomes active
    v2 = reg.register(ckpt, {"metrics": {"tau": 0.95}})
    assert reg.active() == "v0001" and reg.versions() == ["v0001", "v0002"]
    reg.activate(v2)
    assert Registry(tmp_path / "reg").active() == "v0002"  # persisted
    assert reg.card("v0002")["metrics"]["tau"] == 0.95 and reg.card("v0002")["version"] == "v0002"
    assert reg.checkpoint() == tmp_path / "reg" / "versions" / "v0002" / "model.pt"
    with pytest.raises(SpecError, match="unknown model version 'v0009'"):
        reg.activate("v0009")


def test_the_gnn_prior_factory_follows_the_auto_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tagplan.training import registry as module
    from tagplan.training.registry import AUTO_GNN_MAX_DEVICES, Registry, gnn_prior_factory

    reg = Registry(tmp_path / "registry")  # empty: the packaged checkpoint stands in
    assert callable(gnn_prior_factory(reg, 16))
    assert gnn_prior_factory(reg, AUTO_GNN_MAX_DEVICES + 1) is None
    assert callable(gnn_prior_factory(reg, AUTO_GNN_MAX_DEVICES + 1, required=True))  # asked for: no cut-off
    monkeypatch.setattr(module, "PACKAGED_CHECKPOINT", tmp_path / "missing.pt")
    assert gnn_prior_factory(reg, 16) is None
    with pytest.raises(SpecError, match="no GNN checkpoint"):
        gnn_prior_factory(reg, 16, required=True)


def test_a_tenant_registry_falls_back_to_the_global_one_and_never_changes_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "m.pt"
    ckpt.write_bytes(b"weights")
    shared = Registry(tmp_path / "global")
    tenant = Registry(tmp_path / "tenant", fallback=shared)
    assert tenant.checkpoint() == Registry(tmp_path / "empty").checkpoint()  # both empty: the packaged one
    g1 = shared.register(ckpt, {})
    assert tenant.checkpoint() == shared.checkpoint() == tmp_path / "global" / "versions" / g1 / "model.pt"
    t1 = tenant.register(ckpt, {}, activate=True, activate_if_first=False)
    assert tenant.checkpoint() == tmp_path / "tenant" / "versions" / t1 / "model.pt"
    assert shared.active() == g1 and shared.versions() == [g1]  # the global registry is untouched
    assert tenant.calibration_path() is None and tenant.active() == t1
    assert tenant.register(ckpt, {}, activate_if_first=False) == "v0002" and tenant.active() == t1


def test_activate_default_returns_to_the_shipped_checkpoint(tmp_path) -> None:
    from tagplan.training.registry import PACKAGED_CHECKPOINT, Registry

    registry = Registry(tmp_path / "registry")
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"weights")
    version = registry.register(checkpoint, {"metrics": {}}, activate=True)
    assert registry.active() == version
    registry.activate("default")
    assert registry.active() is None
    assert registry.checkpoint() == PACKAGED_CHECKPOINT


def test_a_correction_applies_only_to_measured_device_types(tmp_path) -> None:
    from tagplan.cost.calibration import DEFAULT_CALIBRATION
    from tagplan.frontends.cluster_spec import load_cluster
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir.workload import Workload
    from tagplan.training.registry import PACKAGED_CHECKPOINT, Registry, correction

    registry = Registry(tmp_path / "registry")
    card = {"metrics": {}, "measured_devices": ["V100-SXM2-16GB"], "beats_simulator": True}
    version = registry.register(PACKAGED_CHECKPOINT, card, activate=True)
    model = load_model("gpt?layers=2&hidden=64&heads=4&vocab=100", seq_len=32)
    workload = Workload(global_batch=8, seq_len=32)
    v100 = correction(registry, model, load_cluster("p3.8xlarge"), workload, calibration=DEFAULT_CALIBRATION)
    assert v100 is not None and v100.version == version
    from tagplan.cost.simulator import Simulator
    from tagplan.search.space import PlanSpace, PlanState

    space = PlanSpace(Simulator(model, load_cluster("p3.8xlarge"), workload))
    plan = space.to_plan(space.complete(PlanState()))
    assert v100.predict_s([plan])[0] > 0
    assert correction(registry, model, load_cluster("dgx-a100-80gb"), workload, calibration=DEFAULT_CALIBRATION) is None


def test_auto_guides_only_a_class_whose_card_records_a_gain_and_no_case_20_percent_slower(tmp_path: Path) -> None:
    from tagplan.training.registry import PACKAGED_CHECKPOINT, class_pays, guidance_pays

    reg = Registry(tmp_path / "registry")
    entry = {"heterogeneous": True, "max_devices": 64, "speedup": 1.3, "worst": 0.9, "cases": 5}
    reg.register(PACKAGED_CHECKPOINT, {"guidance": [entry]})
    assert guidance_pays(reg, 64, heterogeneous=True)
    assert not guidance_pays(reg, 65, heterogeneous=True)  # beyond the measured sizes
    assert not guidance_pays(reg, 16, heterogeneous=False)  # no entry for the class
    for worse in ({"speedup": 0.95}, {"worst": 0.75}, {"worst": None}):
        reg.register(PACKAGED_CHECKPOINT, {"guidance": [{**entry, **worse}]}, activate=True)
        assert not guidance_pays(reg, 16, heterogeneous=True), worse
        assert not class_pays({**entry, **worse})  # the one rule the benchmark's auto figures use too
    assert class_pays(entry) and class_pays({**entry, "worst": 1 / 1.2})  # exactly 20% slower still pays


def test_prune_keeps_the_newest_and_the_active_and_never_reuses_a_name(tmp_path: Path) -> None:
    ckpt = tmp_path / "m.pt"
    ckpt.write_bytes(b"weights")
    reg = Registry(tmp_path / "reg")
    made = [reg.register(ckpt, {}, activate=i == 1) for i in range(5)]  # v0002 active
    assert reg.prune(2) == ["v0001", "v0003"]
    assert reg.versions() == ["v0002", "v0004", "v0005"] and reg.active() == "v0002"
    assert sorted(p.name for p in (tmp_path / "reg" / "versions").iterdir()) == reg.versions()
    assert reg.prune(2) == [] and made[-1] == "v0005"
    assert reg.register(ckpt, {}) == "v0006"  # numbered past the newest, not by how many are left
    with pytest.raises(SpecError, match="unknown model version 'v0001'"):
        reg.card("v0001")
    with pytest.raises(SpecError, match="keep=0"):
        reg.prune(0)


def test_a_half_registered_version_is_skipped_and_pruned(tmp_path: Path) -> None:
    ckpt = tmp_path / "m.pt"
    ckpt.write_bytes(b"weights")
    reg = Registry(tmp_path / "reg")
    reg.register(ckpt, {})
    (tmp_path / "reg" / "versions" / "v0002").mkdir()  # a run killed between its folder and the index write
    assert reg.register(ckpt, {}) == "v0003" and reg.versions() == ["v0001", "v0003"]
    assert reg.prune(5) == []  # nothing listed goes, but the orphan does
    assert sorted(p.name for p in (tmp_path / "reg" / "versions").iterdir()) == ["v0001", "v0003"]


def _register_and_prune(root: str, ckpt: str, rounds: int) -> None:
    reg = Registry(Path(root))
    for _ in range(rounds):
        reg.register(Path(ckpt), {}, activate=True)
        reg.prune(2)


def test_processes_registering_and_pruning_at_once_take_turns(tmp_path: Path) -> None:
    import multiprocessing

    ckpt = tmp_path / "m.pt"
    ckpt.write_bytes(b"weights")
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_register_and_prune, args=(str(tmp_path / "reg"), str(ckpt), 15))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    reg = Registry(tmp_path / "reg")
    assert reg.versions()[-1] == "v0045" and len(reg.versions()) == 2 and reg.active() in reg.versions()
    assert sorted(p.name for p in (tmp_path / "reg" / "versions").iterdir()) == reg.versions()
