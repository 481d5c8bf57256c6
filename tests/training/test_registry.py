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
