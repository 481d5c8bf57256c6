"""Retrain the GNN on measured iterations: a correction over the (calibrated) simulator.

`finetune_on_traces` takes the iteration records of trace bundles, featurizes each measured plan
with the calibration in use (so the closed-form estimate the value head corrects is the
calibrated cost model's), and fine-tunes a copy of the active GNN on log(measured / T_lb).

- Held out: every third record in file order (at least one), never trained on; the error is the
  MAPE of predicted vs measured time on them, for the GNN before and after, and for the simulator.
- Regularisation: few records must not erase what the synthetic data taught, so the loss adds
  `anchor` * ||theta - theta_0||^2 (L2-SP: Li, Grandvalet and Davoine, ICML 2018), pulling the
  weights towards the version being replaced; the best epoch by training loss is kept.
- The new version is registered with a model card stating the errors; it becomes active only
  when its held-out error is lower than the version it replaces (never when it is worse).
"""

from __future__ import annotations

import copy
import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch_geometric.data import Batch, HeteroData

from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.simulator import Simulator
from tagplan.datasets.traces.bundle import Bundle, IterationRecord
from tagplan.datasets.traces.iterations import possible_record
from tagplan.errors import SpecError
from tagplan.gnn.features import FeatureCache, featurize
from tagplan.gnn.model import PlanGNN, load_checkpoint, save_checkpoint
from tagplan.training.registry import Registry
from tagplan.training.train import git_commit

HOLD_OUT_EVERY = 3


@dataclass(frozen=True)
class TraceFinetune:
    """Hyper-parameters of fine-tuning on measurements."""

    epochs: int = 150
    lr: float = 1e-3
    anchor: float = 1e-2  # weight of ||theta - theta_0||^2
    seed: int = 0


@dataclass(frozen=True)
class Measured:
    """One iteration record rebuilt: its graph (with target) and the simulator's prediction."""

    graph: HeteroData
    measured_s: float
    simulator_s: float
    lower_bound_s: float
    device_types: tuple[str, ...] = ()  # the GPU types of the measured cluster


def measured_graphs(bundles: Sequence[Bundle], calibration: Calibration,
                    names: Sequence[str] | None = None) -> list[Measured]:
    """Every iteration record of `bundles` as a labelled graph, in order; SpecError naming the bundle (`names`, else
    its position) and the record's number in its records.jsonl for one that does not load or cannot be a run."""
    cache = FeatureCache(size=16)
    out = []
    for b, bundle in enumerate(bundles):
        built: dict[str, Any] = {}  # each SPEC of a bundle built once (a Hugging Face one takes a second)
        iterations = [(n, r) for n, r in enumerate(bundle.records, start=1) if isinstance(r, IterationRecord)]
        for i, (number, record) in enumerate(iterations):
            where = f"{names[b] if names else f'bundle {b}'}: record {number} of records.jsonl"
            model, cluster, plan = possible_record(record, where, built)
            w = record.workload
            graph = featurize(model, cluster, w, plan, cache=cache, calibration=calibration)
            bound = lower_bound_s(model, cluster, w)
            graph.y = torch.tensor([math.log(record.measured_s / bound)], dtype=torch.float)
            graph.group = torch.tensor([b * 100_000 + i], dtype=torch.long)
            simulated = Simulator(model, cluster, w, calibration=calibration).simulate(plan).iteration_time_s
            types = tuple(sorted({d.spec.name for d in cluster.devices}))
            out.append(Measured(graph, record.measured_s, simulated, bound, types))
    return out


def split_measured(items: Sequence[Measured]) -> tuple[list[Measured], list[Measured]]:
    """(train, held out): every third record held out, at least one of each when there are two or more."""
    held = [m for i, m in enumerate(items) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    if not held and len(items) >= 2:
        held = [items[-1]]
    train = [m for m in items if all(m is not h for h in held)]
    return train, held


def predicted_s(model: PlanGNN, items: Sequence[Measured]) -> np.ndarray:
    """The GNN's iteration seconds for `items`."""
    if not items:
        return np.zeros(0)
    model.eval()
    with torch.no_grad():
        value, _ = model(Batch.from_data_list([m.graph for m in items]))
    return np.exp(value.double().numpy()) * np.array([m.lower_bound_s for m in items])


def mape_s(pred: np.ndarray, items: Sequence[Measured]) -> float:
    """MAPE of `pred` against the measured seconds."""
    truth = np.array([m.measured_s for m in items])
    return float(np.mean(np.abs(pred / truth - 1.0))) if len(truth) else float("nan")


def finetune(model: PlanGNN, train: Sequence[Measured], config: TraceFinetune) -> PlanGNN:
    """A fine-tuned copy of `model` (the best epoch by training loss)."""
    torch.manual_seed(config.seed)
    tuned = copy.deepcopy(model).train()
    anchor = [p.detach().clone() for p in tuned.parameters()]
    opt = torch.optim.Adam(tuned.parameters(), lr=config.lr)
    batch = Batch.from_data_list([m.graph for m in train])
    target = batch.y.view(-1)
    best, best_state = math.inf, copy.deepcopy(tuned.state_dict())
    for _ in range(config.epochs):
        value, _ = tuned(batch)
        fit = torch.nn.functional.mse_loss(value, target)
        drift = sum(((p - p0) ** 2).sum() for p, p0 in zip(tuned.parameters(), anchor, strict=True))
        loss = fit + config.anchor * drift
        if float(fit.detach()) < best:  # the loss of the weights before this step: keep those
            best, best_state = float(fit.detach()), copy.deepcopy(tuned.state_dict())
        opt.zero_grad()
        loss.backward()
        opt.step()
    tuned.load_state_dict(best_state)
    return tuned.eval()


def finetune_on_traces(bundles: Sequence[Bundle], out_dir: Path, *, registry: Registry | None = None,
                       calibration: Calibration = DEFAULT_CALIBRATION, config: TraceFinetune = TraceFinetune(),
                       register: bool = True, names: Sequence[str] | None = None) -> dict[str, Any]:
    """Fine-tune the active GNN on the bundles' iteration records; register it; return its card. `names`: how
    errors name the bundles (default: their positions).

    The card's `metrics.held_out` holds the MAPE before and after, and the simulator's; the
    version is activated only if it improved on the one it replaces.
    """
    registry = registry or Registry()
    base_path = registry.checkpoint()
    if base_path is None or not base_path.exists():
        raise SpecError("no GNN to fine-tune: train one with `tagplan train --data DIR` first")
    base, base_card = load_checkpoint(base_path)
    items = measured_graphs(bundles, calibration, names)
    if len(items) < 2:
        raise SpecError(f"fine-tuning needs at least 2 iteration records in the bundles; found {len(items)} "
                        "(import measured iterations with `tagplan traces import`)")
    train_items, held = split_measured(items)
    tuned = finetune(base, train_items, config)
    before, after = mape_s(predicted_s(base, held), held), mape_s(predicted_s(tuned, held), held)
    simulator = mape_s(np.array([m.simulator_s for m in held]), held)
    fallback = registry.fallback.active() if registry.fallback is not None else None
    replaced = registry.active() or (f"service-wide {fallback}" if fallback else "packaged default")
    card = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "git_commit": git_commit(),
        "kind": "fine-tuned on measured iterations",
        "base": {"version": replaced, "date": base_card.get("date")},
        "data": {"iteration_records": len(items), "train": len(train_items), "held_out": len(held),
                 "bundles": [b.manifest.source for b in bundles]},
        "calibration": calibration.name,
        "config": config.__dict__,
        "metrics": {"held_out": {"mape_before": before, "mape_after": after, "simulator_mape": simulator},
                    **{k: v for k, v in base_card.get("metrics", {}).items() if k != "held_out"}},
        "improved": after < before,
        # the planner re-ranks with this version only on clusters of these types, and only if it beat
        # the simulator on the held-out records (`training.registry.correction`)
        "measured_devices": sorted({t for m in items for t in m.device_types}),
        "beats_simulator": after < simulator,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.pt"
    save_checkpoint(tuned, path, card)
    if register:
        card["version"] = registry.register(path, card, activate=after < before, activate_if_first=False)
        card["activated"] = after < before
    return card
