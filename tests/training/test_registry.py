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
