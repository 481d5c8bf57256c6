"""Ranking and accuracy metrics, computed per group of comparable plans (one model, cluster, workload).

- Kendall tau: rank agreement of predicted and true iteration times within each group, averaged
  over groups with at least two plans (Kendall 1938; ties count as neither concordant nor discordant).
- MAPE: mean |predicted time / true time - 1| over all plans.
- Top-k regret: for each group, the best true time among the k plans ranked best by the
  prediction, relative to the group's true best, minus 1; averaged over groups.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import numpy.typing as npt


def _groups(groups: npt.ArrayLike) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(np.asarray(groups).tolist()):
        out[int(g)].append(i)
    return out


def kendall_tau(pred: npt.ArrayLike, true: npt.ArrayLike, groups: npt.ArrayLike) -> float:
    """Mean within-group Kendall tau-a in [-1, 1] (nan when no group has two plans)."""
    p, t = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    taus = []
    for members in _groups(groups).values():
        if len(members) < 2:
            continue
        idx = np.asarray(members)
        dp = np.sign(p[idx][:, None] - p[idx][None, :])
        dt = np.sign(t[idx][:, None] - t[idx][None, :])
        n = len(idx)
        taus.append(float((dp * dt).sum() / (n * (n - 1))))
    return float(np.mean(taus)) if taus else float("nan")


def mape(pred_time: npt.ArrayLike, true_time: npt.ArrayLike) -> float:
    """Mean absolute percentage error of predicted times (a fraction, 0.1 = 10%)."""
    p, t = np.asarray(pred_time, dtype=float), np.asarray(true_time, dtype=float)
    return float(np.mean(np.abs(p / t - 1.0))) if len(t) else float("nan")


def top_k_regret(pred: npt.ArrayLike, true: npt.ArrayLike, groups: npt.ArrayLike, k: int = 1) -> float:
    """Mean over groups of (best true time among the top-k predicted) / (true best) - 1."""
    p, t = np.asarray(pred, dtype=float), np.asarray(true, dtype=float)
    regrets = []
    for members in _groups(groups).values():
        idx = np.asarray(members)
        chosen = idx[np.argsort(p[idx], kind="stable")[:k]]
        regrets.append(float(t[chosen].min() / t[idx].min() - 1.0))
    return float(np.mean(regrets)) if regrets else float("nan")
