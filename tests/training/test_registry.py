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
