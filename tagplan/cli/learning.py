"""`tagplan dataset generate`, `tagplan train`, `tagplan models`: the GNN's data, training and versions."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tagplan.cli.options import (
    Subparsers,
    add_calibration_option,
    add_json_option,
    emit,
    load_calibration_option,
    positive_int,
)
from tagplan.errors import SpecError


def add_learning_commands(sub: Subparsers) -> None:
    """Add `dataset generate`, `train` and `models` to the `tagplan` parser."""
    data = sub.add_parser("dataset", help="simulator-labelled training data for the GNN")
    data_sub = data.add_subparsers(dest="what", required=True)
    gen = data_sub.add_parser("generate", help="generate train/ and heldout_gpus/ sample sets")
    gen.add_argument("--out", required=True, help="directory to write")
    gen.add_argument("--instances", type=positive_int, default=200, help="(model, cluster, workload) instances")
    gen.add_argument("--plans-per-instance", type=positive_int, default=16)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--workers", type=positive_int, default=2)
    add_json_option(gen, "the directories written")
    gen.set_defaults(func=_dataset_generate)

    train = sub.add_parser("train", help="train the GNN; registers a new version")
    train.add_argument("--data", default=None, help="a directory from `tagplan dataset generate`")
    train.add_argument("--traces", nargs="+", default=None, metavar="BUNDLE",
                       help="instead: fine-tune the active GNN on these bundles' measured iterations; the new "
                            "version is activated only if its held-out error is lower")
    add_calibration_option(train, "with --traces, the pinned one; the corrected simulator uses it")
    train.add_argument("--epochs", type=positive_int, default=40)
    train.add_argument("--out", default="gnn-run", help="directory for model.pt and card.json")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--hidden", type=positive_int, default=64)
    train.add_argument("--lr", type=float, default=None, help="learning rate (default: TrainConfig's)")
    train.add_argument("--no-register", action="store_true", help="do not add the checkpoint to the registry")
    train.add_argument("--activate", action="store_true", help="make the new version the active one")
    add_json_option(train, "{checkpoint, metrics, version, activated}")
    train.set_defaults(func=_train)

    models = sub.add_parser("models", help="list or activate GNN versions in the registry")
    models.add_argument("action", choices=["list", "activate"])
    models.add_argument("version", nargs="?", help="a registered version, or \"default\" for the shipped checkpoint")
    add_json_option(models, "{active, fallback, versions}")
    models.set_defaults(func=_models)


def _dataset_generate(args: argparse.Namespace) -> int:
    from tagplan.datasets.clusters import HELD_OUT_GPU_TYPES, TRAIN_GPU_TYPES
    from tagplan.datasets.synthetic import generate

    out = Path(args.out)
    generate(out / "train", instances=args.instances, plans_per_instance=args.plans_per_instance, seed=args.seed,
             workers=args.workers, gpu_types=TRAIN_GPU_TYPES, progress=sys.stderr.isatty())
    generate(out / "heldout_gpus", instances=max(args.instances // 4, 1), plans_per_instance=args.plans_per_instance,
             seed=args.seed + 1_000_003, workers=args.workers, gpu_types=HELD_OUT_GPU_TYPES,
             progress=sys.stderr.isatty())
    written = {"train": str(out / "train"), "heldout_gpus": str(out / "heldout_gpus")}
    emit(written, args.json, lambda w: f"wrote {w['train']} and {w['heldout_gpus']}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import metrics_table

    if args.traces:
        summary = _train_traces(args)
    elif not args.data:
        raise SpecError("train: give --data DIR (synthetic samples) or --traces BUNDLE... (measurements)")
    else:
        summary = _train_synthetic(args)
    emit(summary, args.json, metrics_table)
    return 0


class EpochProgress:
    """Prints each epoch's losses with the elapsed time and an ETA (at most the remaining epochs;
    training also stops early once validation has not improved for `patience` epochs)."""

    def __init__(self, epochs: int, patience: int) -> None:
        self.epochs, self.patience = epochs, patience
        self.start = time.monotonic()
        self.best, self.stale = float("inf"), 0

    def epochs_left(self, epoch: int) -> int:
        """Epochs that may still run after `epoch` (0-based): the rest, or fewer under early stopping."""
        return max(min(self.epochs - epoch - 1, self.patience - self.stale), 0)

    def __call__(self, epoch: int, train_loss: float, val_mse: float) -> None:
        elapsed = time.monotonic() - self.start
        per_epoch = elapsed / (epoch + 1)
        self.best, self.stale = (val_mse, 0) if val_mse < self.best else (self.best, self.stale + 1)
        left = self.epochs_left(epoch)
        print(f"epoch {epoch + 1:3d}/{self.epochs}  train {train_loss:.4f}  val mse(log) {val_mse:.4f}  "
              f"elapsed {elapsed:.0f} s  ETA <= {left * per_epoch:.0f} s", file=sys.stderr, flush=True)


def _train_synthetic(args: argparse.Namespace) -> dict[str, Any]:
    from tagplan.training.registry import Registry
    from tagplan.training.train import TrainConfig, train

    data = Path(args.data)
    if not (data / "train" / "samples.jsonl").exists():
        raise SpecError(f"--data {args.data}: no train/samples.jsonl; create it with `tagplan dataset generate`")
    config = TrainConfig(epochs=args.epochs, seed=args.seed, hidden=args.hidden,
                         **({"lr": args.lr} if args.lr is not None else {}))
    path, card = train(data, Path(args.out), config, on_epoch=EpochProgress(config.epochs, config.patience))
    Path(args.out, "card.json").write_text(json.dumps(card, indent=2, default=str))
    metrics = {split: {k: round(v, 4) for k, v in m.items()} for split, m in card["metrics"].items()}
    registry = Registry()
    version = None if args.no_register else registry.register(path, card, activate=args.activate)
    return {"checkpoint": str(path), "metrics": metrics, "version": version,
            "activated": version is not None and registry.active() == version}


def _train_traces(args: argparse.Namespace) -> dict[str, Any]:
    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.training.traces import finetune_on_traces

    bundles = [read_bundle(b) for b in args.traces]
    card = finetune_on_traces(bundles, Path(args.out), calibration=load_calibration_option(args),
                              register=not args.no_register)
    Path(args.out, "card.json").write_text(json.dumps(card, indent=2, default=str))
    return {"checkpoint": str(Path(args.out) / "model.pt"), "metrics": {"held_out": card["metrics"]["held_out"]},
            "version": card.get("version"), "activated": card.get("activated", False)}


def _models(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import models_table
    from tagplan.training.registry import Registry

    registry = Registry()
    if args.action == "list" and args.version:
        raise SpecError(f"models list takes no VERSION (got {args.version!r}); it lists every version; "
                        f"`tagplan models activate {args.version}` activates one")
    if args.action == "activate":
        if not args.version:
            raise SpecError("models activate: give a VERSION (see `tagplan models list`)")
        registry.activate(args.version)
    active = registry.active()
    rows = [{"version": v, "active": v == active, "metrics": registry.card(v).get("metrics", {})}
            for v in registry.versions()]
    fallback = registry.checkpoint(None) if not active else None
    emit({"active": active, "fallback": str(fallback) if fallback else None, "versions": rows}, args.json,
         models_table)
    return 0
