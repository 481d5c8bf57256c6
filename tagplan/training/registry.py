"""A registry of GNN versions: checkpoints with model cards, one active version.

Layout under the root (default `$TAGPLAN_HOME/registry`, else `~/.tagplan/registry`):

    registry.json            {"active": "v0002", "versions": ["v0001", "v0002"]}
    versions/v0001/model.pt  checkpoint (weights + constructor arguments + card)
    versions/v0001/card.json the model card (data, splits, metrics, date, git commit)

The package ships a default checkpoint (`tagplan/gnn/checkpoints/default.pt`), used when the
registry has no active version.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tagplan.errors import SpecError

PACKAGED_CHECKPOINT = Path(__file__).resolve().parents[1] / "gnn" / "checkpoints" / "default.pt"


def default_root() -> Path:
    """`$TAGPLAN_HOME/registry` or `~/.tagplan/registry` (read when called, not at import)."""
    home = os.environ.get("TAGPLAN_HOME")
    return Path(home) / "registry" if home else Path.home() / ".tagplan" / "registry"


class Registry:
    """Versioned checkpoints on disk with one active version."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_root()

    def _index(self) -> dict[str, Any]:
        path = self.root / "registry.json"
        if not path.exists():
            return {"active": None, "versions": []}
        return dict(json.loads(path.read_text()))

    def _write(self, index: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / "registry.json.tmp"
        tmp.write_text(json.dumps(index, indent=2))
        tmp.replace(self.root / "registry.json")  # atomic: a crash never leaves half an index

    def versions(self) -> list[str]:
        """Registered versions, oldest first."""
        return list(self._index()["versions"])

    def active(self) -> str | None:
        """The active version, or None."""
        value = self._index()["active"]
        return str(value) if value else None

    def register(self, checkpoint: Path, card: dict[str, Any], *, activate: bool = False) -> str:
        """Copy `checkpoint` in as a new version with `card`; returns the version name."""
        index = self._index()
        version = f"v{len(index['versions']) + 1:04d}"
        target = self.root / "versions" / version
        target.mkdir(parents=True, exist_ok=False)
        shutil.copyfile(checkpoint, target / "model.pt")
        (target / "card.json").write_text(json.dumps({**card, "version": version}, indent=2, default=str))
        index["versions"].append(version)
        if activate or index["active"] is None:
            index["active"] = version
        self._write(index)
        return version

    def activate(self, version: str) -> None:
        """Make `version` the active one; SpecError if unknown."""
        index = self._index()
        if version not in index["versions"]:
            raise SpecError(f"unknown model version {version!r}; registered: {index['versions'] or 'none'}")
        index["active"] = version
        self._write(index)

    def card(self, version: str) -> dict[str, Any]:
        """The model card of `version`."""
        path = self.root / "versions" / version / "card.json"
        if not path.exists():
            raise SpecError(f"unknown model version {version!r}; registered: {self.versions() or 'none'}")
        return dict(json.loads(path.read_text()))

    def checkpoint(self, version: str | None = None) -> Path | None:
        """Path of `version` (default: the active one, else the packaged default; None if neither)."""
        version = version or self.active()
        if version is not None:
            return self.root / "versions" / version / "model.pt"
        return PACKAGED_CHECKPOINT if PACKAGED_CHECKPOINT.exists() else None
