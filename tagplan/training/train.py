"""Train the GNN: out-of-distribution splits, log-time + pairwise ranking loss, early stopping,
a checkpoint with its model card.

Splits: plans of held-out model families and plans on clusters with held-out GPU types are
test sets never seen in training (out of distribution); the rest is split by instance group
80/20 into train and validation. The loss is the squared error of log(T / T_lb), plus a
pairwise logistic ranking loss over plans of the same group in a batch, plus the fit
classification's binary cross-entropy.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tagplan.errors import SpecError
from tagplan.training.metrics import kendall_tau, mape, top_k_regret

log = logging.getLogger(__name__)

HELD_OUT_FAMILIES = ("t5", "cnn")


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters (defaults small enough for two CPU cores)."""

    epochs: int = 40
    hidden: int = 64
    layers: int = 3
    lr: float = 3e-4
    batch_size: int = 32
    patience: int = 8
    rank_weight: float = 0.1  # the pairwise term breaks near-ties; larger, it inflates the spread and the MSE
    fit_weight: float = 0.2
    seed: int = 0
    dropout: float = 0.1
    weight_decay: float = 1e-3
    held_out_families: tuple[str, ...] = HELD_OUT_FAMILIES


@dataclass
class Splits:
    """Dataset items by split."""

    train: list[Any] = field(default_factory=list)
    val: list[Any] = field(default_factory=list)
    test_family: list[Any] = field(default_factory=list)
    test_gpu: list[Any] = field(default_factory=list)


def split(items: Sequence[Any], held_out_gpu_items: Sequence[Any], config: TrainConfig) -> Splits:
    """Held-out families -> test_family; `held_out_gpu_items` -> test_gpu; the rest 80/20 by group."""
    out = Splits(test_gpu=list(held_out_gpu_items))
    rest: list[Any] = []
    for item in items:
        (out.test_family if item.family in config.held_out_families else rest).append(item)
    groups = sorted({int(item.group) for item in rest})
    random.Random(config.seed).shuffle(groups)
    val_groups = set(groups[: max(1, len(groups) // 5)])
    for item in rest:
        (out.val if int(item.group) in val_groups else out.train).append(item)
    return out


def no_training_samples(data_dir: Path, splits: Splits, config: TrainConfig) -> SpecError:
    """Why `split` left no training samples: an empty set, only held-out families, or a single
    instance group, which the validation split takes whole."""
    where = data_dir / "train"
    held = config.held_out_families
    if not splits.test_family and not splits.val:
        return SpecError(f"{where}: no samples; create them with `tagplan dataset generate --instances 2` or more")
    if not splits.val:
        return SpecError(f"{where}: all {len(splits.test_family)} samples are of the held-out families {held}, "
                         "which are test data only; generate more instances (`tagplan dataset generate --instances N`)")
    others = f" of families other than the held-out {held}" if splits.test_family else ""
    return SpecError(  # `split` leaves training samples whenever there are two groups or more
        f"{where}: no training samples: all {len(splits.val)} samples{others} are of one instance, and the "
        "validation split took it (it takes 20% of the instances, at least one); training needs at least 2 "
        f"instances{others} (`tagplan dataset generate --instances 2` or more)")


def pairwise_rank_loss(pred: Tensor, target: Tensor, group: Tensor) -> Tensor:
    """Mean softplus(-(pred_j - pred_i) * sign(target_j - target_i)) over same-group pairs i < j."""
    same = (group[:, None] == group[None, :]) & ~torch.eye(len(group), dtype=torch.bool)
    sign = torch.sign(target[None, :] - target[:, None])
    mask = same & (sign != 0)
    if not mask.any():
        return pred.sum() * 0.0
    margin = (pred[None, :] - pred[:, None]) * sign
    return torch.nn.functional.softplus(-margin[mask]).mean()


def evaluate(model: torch.nn.Module, items: Sequence[Any], batch_size: int = 64) -> dict[str, float]:
    """Kendall tau (within groups), MAPE of time, top-1/top-3 regret, and the loss terms on `items`."""
    if not items:
        return {}
    from torch_geometric.loader import DataLoader

    preds, ys, groups = [], [], []
    model.eval()
    with torch.no_grad():
        for batch in DataLoader(list(items), batch_size=batch_size):
            value, _ = model(batch)
            preds.append(value)
            ys.append(batch.y.view(-1))
            groups.append(batch.group.view(-1))
    pred = torch.cat(preds).numpy()
    true = torch.cat(ys).numpy()
    group = torch.cat(groups).numpy()
    return {"kendall_tau": kendall_tau(pred, true, group), "mape": mape(np.exp(pred), np.exp(true)),
            "top1_regret": top_k_regret(pred, true, group, 1), "top3_regret": top_k_regret(pred, true, group, 3),
            "mse_log": float(np.mean((pred - true) ** 2)), "plans": float(len(true)),
            "simulator_kendall_tau": 1.0, "simulator_mape": 0.0}


def fit(model: torch.nn.Module, splits: Splits, config: TrainConfig,
        on_epoch: Callable[[int, float, float], None] | None = None) -> dict[str, Any]:
    """Train with early stopping on validation MSE and a cosine learning-rate decay over `epochs`;
    returns the history. Restores the best weights."""
    from torch_geometric.loader import DataLoader

    torch.manual_seed(config.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(config.epochs, 1))
    best, best_state, stale, history = math.inf, None, 0, []
    loader = DataLoader(splits.train, batch_size=config.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(config.seed))
    for epoch in range(config.epochs):
        model.train()
        total = 0.0
        for batch in loader:
            value, fit_logit = model(batch)
            y, group = batch.y.view(-1), batch.group.view(-1)
            loss = torch.nn.functional.mse_loss(value, y)
            loss = loss + config.rank_weight * pairwise_rank_loss(value, y, group)
            loss = loss + config.fit_weight * torch.nn.functional.binary_cross_entropy_with_logits(
                fit_logit, batch.fit.view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * batch.num_graphs
        schedule.step()
        val = evaluate(model, splits.val).get("mse_log", total)
        history.append({"epoch": epoch, "train_loss": total / max(len(splits.train), 1), "val_mse_log": val})
        if on_epoch:
            on_epoch(epoch, total / max(len(splits.train), 1), val)
        if val < best - 1e-6:
            best, stale = val, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            stale += 1
            if stale >= config.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    return {"history": history, "best_val_mse_log": best, "epochs_run": len(history)}


def git_commit() -> str:
    """The repository's HEAD commit, or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def train(data_dir: Path, out_dir: Path, config: TrainConfig = TrainConfig(),
          on_epoch: Callable[[int, float, float], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """Train on `data_dir` (from `tagplan dataset generate`); write `out_dir/model.pt`; return it and its card."""
    from tagplan.datasets.pyg import PlanDataset
    from tagplan.gnn.model import PlanGNN, save_checkpoint

    train_set = list(PlanDataset(str(data_dir / "train")))
    held_dir = data_dir / "heldout_gpus"
    held = list(PlanDataset(str(held_dir))) if (held_dir / "samples.jsonl").exists() else []
    splits = split(train_set, held, config)
    if not splits.train:
        raise no_training_samples(data_dir, splits, config)
    model = PlanGNN(hidden=config.hidden, layers=config.layers, dropout=config.dropout)
    run = fit(model, splits, config, on_epoch)
    metrics = {name: evaluate(model, items) for name, items in
               (("val", splits.val), ("test_family", splits.test_family), ("test_gpu", splits.test_gpu))}
    card = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "git_commit": git_commit(),
        "data": {"dir": str(data_dir), "train": len(splits.train), "val": len(splits.val),
                 "test_family": len(splits.test_family), "test_gpu": len(splits.test_gpu)},
        "splits": {"held_out_families": list(config.held_out_families),
                   "held_out_gpu_types": "clusters in heldout_gpus/ (types never in train/)",
                   "val": "20% of the remaining instance groups"},
        "config": asdict(config),
        "metrics": metrics, "training": {k: v for k, v in run.items() if k != "history"},
        "parameters": sum(p.numel() for p in model.parameters()),
        "labels": "simulator (tagplan.cost) iteration times; the simulator's own figures are exact on them",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.pt"
    save_checkpoint(model, path, card)
    return path, card
