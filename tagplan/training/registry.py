"""A registry of GNN versions: checkpoints with model cards, one active version.

Layout under the root (default `$TAGPLAN_HOME/registry`, else `~/.tagplan/registry`):

    registry.json            {"active": "v0002", "versions": ["v0001", "v0002"]}
    versions/v0001/model.pt  checkpoint (weights + constructor arguments + card)
    versions/v0001/card.json the model card (data, splits, metrics, date, git commit)
    versions/v0001/calibration.json  optional: the cost-model calibration pinned beside the version

The package ships a default checkpoint (`tagplan/gnn/checkpoints/default.pt`), used when the
registry has no active version.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tagplan.cost.calibration import Calibration
from tagplan.errors import SpecError
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.workload import Workload
from tagplan.search.planner import Correction
from tagplan.search.problem import Scorer

PACKAGED_CHECKPOINT = Path(__file__).resolve().parents[1] / "gnn" / "checkpoints" / "default.pt"
_VERSION = re.compile(r"v\d{4,}")  # a version's name: v0001, ...
AUTO_GNN_MAX_DEVICES = 256
"""Beyond this many devices, scoring each expansion's graphs costs more search time than it saves."""


def default_root() -> Path:
    """`$TAGPLAN_HOME/registry` or `~/.tagplan/registry` (read when called, not at import)."""
    home = os.environ.get("TAGPLAN_HOME")
    return Path(home) / "registry" if home else Path.home() / ".tagplan" / "registry"


class Registry:
    """Versioned checkpoints on disk with one active version.

    With a `fallback` (a tenant's registry in the service falls back to the service-wide one),
    `checkpoint()` and `calibration_path()` without an active version of their own answer the
    fallback's; versions registered or activated here never touch the fallback.
    """

    def __init__(self, root: Path | None = None, *, fallback: Registry | None = None) -> None:
        self.root = root or default_root()
        self.fallback = fallback

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

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the registry's lock (`flock` on `registry.lock`) while the index is read, changed and written:
        two processes registering, pruning or activating at once (two workers' training runs) take turns."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "registry.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _folders(self) -> list[str]:
        """The version folders on disk (a registration interrupted before its index write leaves one unlisted)."""
        folder = self.root / "versions"
        return sorted(p.name for p in folder.iterdir() if _VERSION.fullmatch(p.name)) if folder.is_dir() else []

    def register(self, checkpoint: Path, card: dict[str, Any], *, activate: bool = False,
                 calibration: Path | None = None, activate_if_first: bool = True) -> str:
        """Copy `checkpoint` in as a new version with `card` (and a pinned `calibration` file);
        returns the version name. The first version becomes active unless `activate_if_first` is off.
        Named past every version listed or on disk, so a pruned or half-registered name is never reused."""
        with self._locked():
            index = self._index()
            numbers = [int(v[1:]) for v in [*index["versions"], *self._folders()] if _VERSION.fullmatch(v)]
            version = f"v{max(numbers, default=0) + 1:04d}"
            target = self.root / "versions" / version
            target.mkdir(parents=True, exist_ok=False)
            shutil.copyfile(checkpoint, target / "model.pt")
            if calibration is not None:
                self._copy_calibration(calibration, target)
            (target / "card.json").write_text(json.dumps({**card, "version": version}, indent=2, default=str))
            index["versions"].append(version)
            if activate or (index["active"] is None and activate_if_first):
                index["active"] = version
            self._write(index)
        return version

    def prune(self, keep: int) -> list[str]:
        """Delete the oldest versions beyond the newest `keep`, never the active one; returns those deleted.

        The index is rewritten first, so a version is never listed without its files."""
        if keep < 1:
            raise SpecError(f"prune: keep={keep} is not accepted; keep at least 1 version")
        with self._locked():
            index = self._index()
            newest = set(index["versions"][-keep:])
            gone = [v for v in index["versions"] if v not in newest and v != index["active"]]
            if gone:
                index["versions"] = [v for v in index["versions"] if v not in gone]
                self._write(index)
            # under the lock no registration is in flight: an unlisted folder is one a killed run left
            orphans = [v for v in self._folders() if v not in index["versions"] and v not in gone]
            for version in [*gone, *orphans]:
                shutil.rmtree(self.root / "versions" / version, ignore_errors=True)
        return gone

    def pin_calibration(self, version: str, calibration: Path) -> None:
        """Pin the calibration file `calibration` beside `version` (replacing one pinned before)."""
        self.card(version)  # SpecError for an unknown version
        self._copy_calibration(calibration, self.root / "versions" / version)

    def calibration_path(self, version: str | None = None) -> Path | None:
        """The calibration pinned beside `version` (default: the active one, else the fallback's), or None."""
        version = version or self.active()
        if version is None:
            return self.fallback.calibration_path() if self.fallback is not None else None
        path = self.root / "versions" / version / "calibration.json"
        return path if path.exists() else None

    @staticmethod
    def _copy_calibration(source: Path, target_dir: Path) -> None:
        from tagplan.cost.calibration import Calibration

        try:
            Calibration.model_validate_json(Path(source).read_text())
        except (OSError, ValueError) as err:
            raise SpecError(f"{source}: not a calibration file (from `tagplan calibrate`): {err}") from None
        partial = target_dir / "calibration.json.partial"
        shutil.copyfile(source, partial)
        partial.replace(target_dir / "calibration.json")

    def activate(self, version: str) -> None:
        """Make `version` the active one ("default": none, so the shipped checkpoint); SpecError if unknown."""
        with self._locked():
            index = self._index()
            if version != "default" and version not in index["versions"]:
                raise SpecError(f"unknown model version {version!r}; registered: {index['versions'] or 'none'}")
            index["active"] = None if version == "default" else version
            self._write(index)

    def card(self, version: str) -> dict[str, Any]:
        """The model card of `version`."""
        path = self.root / "versions" / version / "card.json"
        try:
            return dict(json.loads(path.read_text()))
        except FileNotFoundError:  # never registered, or pruned meanwhile
            raise SpecError(f"unknown model version {version!r}; registered: {self.versions() or 'none'}") from None

    def checkpoint(self, version: str | None = None) -> Path | None:
        """Path of `version` (default: the active one, else the fallback's, else the packaged default;
        None if none)."""
        version = version or self.active()
        if version is not None:
            return self.root / "versions" / version / "model.pt"
        if self.fallback is not None:
            return self.fallback.checkpoint()
        return PACKAGED_CHECKPOINT if PACKAGED_CHECKPOINT.exists() else None


def prior_factory(scorer: Scorer, registry: Registry, devices: int, *,
                  heterogeneous: bool = False) -> Callable[[Any], Any] | None:
    """The search prior `scorer` asks for: None (uniform) for `simulator`; for `auto`, the GNN's only
    where its card records a measured wall-clock gain for this class of problem (`guidance_pays`);
    for `gnn`, the GNN's (see `gnn_prior_factory`)."""
    if scorer is Scorer.SIMULATOR:
        return None
    if scorer is Scorer.AUTO and not guidance_pays(registry, devices, heterogeneous=heterogeneous):
        return None
    try:
        return gnn_prior_factory(registry, devices, required=scorer is Scorer.GNN)
    except SpecError as err:
        raise SpecError(f"scorer gnn: {err}") from None


AUTO_WORST_SPEEDUP = 1 / 1.2
"""`--scorer auto` may be at most 20% slower than `--scorer simulator` on any measured case of a class
it guides (the issue's bound): a class whose gain is a geometric mean over big wins and small losses
stays unguided when one of its cases loses more than that."""


def class_pays(entry: Mapping[str, Any]) -> bool:
    """Whether one `guidance` entry of a card (a problem class as `bench/planner.py` measured it) lets
    `--scorer auto` guide: a geometric-mean gain above 1x and no case slower than `AUTO_WORST_SPEEDUP`."""
    return (entry.get("speedup") or 0.0) > 1.0 and (entry.get("worst") or 0.0) >= AUTO_WORST_SPEEDUP


def guidance_pays(registry: Registry, devices: int, *, heterogeneous: bool) -> bool:
    """Whether the active checkpoint's card records that GNN guidance reached a plan within 1% of the
    best known in less search wall-clock than the uniform prior, on problems of this class, and on
    none of them more than 20% slower (`AUTO_WORST_SPEEDUP`).

    The card's `guidance` list holds what `bench/planner.py` measured: entries
    `{"heterogeneous": bool, "max_devices": int, "speedup": float, "worst": float}` (uniform seconds /
    GNN seconds: the geometric mean over the class and its worst case). No entry, no GNN: `--scorer
    auto` is then the uniform prior.
    """
    path = registry.checkpoint()
    if path is None:
        return False
    card_path = path.parent / "card.json" if (path.parent / "card.json").exists() else path.with_suffix(".card.json")
    try:
        card = json.loads(card_path.read_text())
    except (OSError, ValueError):
        return False
    return any(entry.get("heterogeneous") == heterogeneous and devices <= entry.get("max_devices", 0)
               and class_pays(entry) for entry in card.get("guidance", []))


def gnn_prior_factory(registry: Registry, devices: int, *, required: bool = False) -> Callable[[Any], Any] | None:
    """A factory of the search's GNN prior from `registry`'s active checkpoint (else the packaged one).

    None (the search then uses a uniform prior) beyond `AUTO_GNN_MAX_DEVICES` devices or without a
    checkpoint; with `required`, SpecError instead of None when no checkpoint exists. The model is
    loaded once per process and checkpoint version.
    """
    path = registry.checkpoint()
    if path is None or not path.exists():
        if required:
            raise SpecError("no GNN checkpoint is installed; train one with `tagplan train`")
        return None
    if devices > AUTO_GNN_MAX_DEVICES and not required:
        return None
    import torch

    from tagplan.gnn.scorer import GNNPrior, GNNScorer

    torch.set_num_threads(1)  # small graphs: one thread is ~100x faster than two contending ones here
    scorer = GNNScorer(_load_model(str(path), path.stat().st_mtime_ns))
    return lambda space: GNNPrior(space, scorer)


@functools.lru_cache(maxsize=4)
def _load_model(path: str, mtime_ns: int) -> Any:
    """The checkpoint at `path`, loaded once (keyed by its mtime: a replaced file reloads)."""
    from tagplan.gnn.model import load_checkpoint

    return load_checkpoint(path)[0]


def correction(registry: Registry, model: ModelGraph, cluster: Cluster, workload: Workload, *,
               calibration: Calibration) -> Correction | None:
    """The learned correction the planner re-ranks with, or None.

    Only the active version qualifies, and only when it was fine-tuned on measured iterations of a
    GPU type this cluster has (`measured_devices` in its card) and predicted the held-out records
    better than the simulator did (`beats_simulator`).
    """
    version = registry.active()
    if version is None:
        return None
    card = registry.card(version)
    types = {d.spec.name for d in cluster.devices}
    if not card.get("beats_simulator") or not types & set(card.get("measured_devices", [])):
        return None
    path = registry.checkpoint(version)
    if path is None or not path.exists():
        return None
    from tagplan.gnn.scorer import GNNScorer

    scorer = GNNScorer(_load_model(str(path), path.stat().st_mtime_ns))
    return Correction(version, lambda plans: list(scorer.predicted_time_s(model, cluster, workload, plans,
                                                                           calibration=calibration)))
