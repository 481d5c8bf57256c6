"""`tagplan train`'s per-epoch progress: losses, elapsed time and an ETA bounded by early stopping."""

from __future__ import annotations

import re

import pytest

from tagplan.cli.learning import EpochProgress


def test_eta_counts_down_and_is_bounded_by_patience(capsys: pytest.CaptureFixture[str]) -> None:
    progress = EpochProgress(epochs=40, patience=3)
    progress(0, 1.0, 0.5)
    assert progress.epochs_left(0) == 3  # improved: early stopping needs 3 stale epochs
    progress(1, 0.9, 0.6)  # no improvement: at most 2 more epochs before early stopping
    assert progress.epochs_left(1) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("epoch   1/40") and "val mse(log) 0.5000" in lines[0]
    etas = [float(re.search(r"ETA <= (\d+) s", line).group(1)) for line in lines]  # type: ignore[union-attr]
    assert all(eta >= 0 for eta in etas)
    assert "ETA <=" in lines[1]
