"""Routes of the GNN registry (`service/api/registry.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient


def test_models_list_and_admin_only_activate(make_settings: Any, client: TestClient, keys: Any, api: Any,
                                             tmp_path: Path) -> None:
    from tagplan.training.registry import Registry

    listing = client.get("/v1/models", headers=api.auth(keys.a)).json()
    assert listing["active"] is None and listing["versions"] == []
    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"weights")
    registry = Registry(make_settings().home / "registry")
    registry.register(checkpoint, {"metrics": {"mape": 0.1}})
    registry.register(checkpoint, {"metrics": {"mape": 0.05}})
    forbidden = client.post("/v1/models/v0002/activate", headers=api.auth(keys.a))
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["detail"]
    activated = client.post("/v1/models/v0002/activate", headers=api.auth(keys.admin))
    assert activated.status_code == 200, activated.text
    assert activated.json()["active"] == "v0002"
    versions = client.get("/v1/models", headers=api.auth(keys.a)).json()["versions"]
    assert [(v["version"], v["active"], v["card"]["metrics"]["mape"]) for v in versions] == [
        ("v0001", False, 0.1), ("v0002", True, 0.05)]
    assert client.post("/v1/models/v0099/activate", headers=api.auth(keys.admin)).status_code == 404


def test_a_version_pruned_while_the_list_is_read_is_left_out(make_settings: Any, client: TestClient, keys: Any,
                                                             api: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """A training run's prune between the index read and a card's read (two workers) was a 422 or a 500."""
    from tagplan.errors import SpecError
    from tagplan.training.registry import Registry

    checkpoint = tmp_path / "model.pt"
    checkpoint.write_bytes(b"weights")
    registry = Registry(make_settings().home / "registry")
    registry.register(checkpoint, {})
    registry.register(checkpoint, {})
    read = Registry.card

    def pruned_meanwhile(self: Registry, version: str) -> dict[str, Any]:
        if version == "v0001":
            raise SpecError("unknown model version 'v0001'")
        return read(self, version)

    monkeypatch.setattr(Registry, "card", pruned_meanwhile)
    listing = client.get("/v1/models", headers=api.auth(keys.a))
    assert listing.status_code == 200 and [v["version"] for v in listing.json()["versions"]] == ["v0002"]
