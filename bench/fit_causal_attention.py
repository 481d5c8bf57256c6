"""Fit what a causal mask saves a fused attention kernel (`Calibration.causal_time_fraction` and
`causal_diagonal_tokens`) from the flash-attention op records of the GPU bundles (bench/data/gpu/h100 and
h200, `ops/records.jsonl`: PyTorch's scaled_dot_product_attention, bf16, 32 heads of 128, 1,024-8,192 tokens,
each shape timed causal and unmasked, forward and backward).

A causal kernel skips the tiles above the diagonal: about half of them, plus the diagonal's own tiles, which it
computes whole and masks. Per pair, the causal time over the unmasked time of the same shape and phase is modelled
as fraction + tokens / s (s the keys), least squares over every pair of both GPUs. `fraction` is what the long
sequences approach (half the tiles at the masked kernel's efficiency), `tokens` the diagonal's cost. The fit is
`training.calibrate.fit_causal`, which `tagplan calibrate` runs on any bundle holding such pairs; a calibration
with the figures charges a causal op min(1, fraction + tokens / s) of its FLOPs on a device with a fused kernel
(`cost.compute.attention_fraction`). The shipped defaults do not (`cost.calibration.MEASURED_CAUSAL_TIME_FRACTION`
says why; docs/FIDELITY.md, "Causal attention").

Run: `.venv/bin/python bench/fit_causal_attention.py` (a second); writes bench/results/causal_attention.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tagplan.datasets.traces.bundle import read_bundle
from tagplan.training.calibrate import causal_pairs, fit_causal

DATA = Path(__file__).parent / "data" / "gpu"
GPUS = ("h100", "h200")


def main() -> None:
    records = [r for gpu in GPUS for r in read_bundle(DATA / gpu / "ops").ops()]
    fitted = fit_causal(records)
    assert fitted is not None, "the bundles time no causal and unmasked attention of one shape"
    fraction, tokens = fitted
    points = []
    print(f"{'device':9s} {'phase':9s} {'tokens':>6s} {'measured':>9s} {'model':>7s} {'held out':>9s}")
    for i, r in enumerate(records):  # leave out each causal call (with its unmasked twin) in turn
        pair = causal_pairs([r, *(o for o in records if o.shape.get("causal") == 0)]) if r.shape.get("causal") else []
        if r.kind.value != "attention" or not pair:
            continue
        held = fit_causal(records[:i] + records[i + 1:])
        assert held is not None
        keys, ratio = pair[0]
        point = {"device": r.device, "phase": r.phase, "seq": keys, "ratio": ratio,
                 "model": min(1.0, fraction + tokens / keys), "held_out": min(1.0, held[0] + held[1] / keys)}
        points.append(point)
        print(f"{r.device:9s} {r.phase:9s} {keys:6d} {ratio:9.3f} {point['model']:7.3f} {point['held_out']:9.3f}")
    worst = max(abs(p["held_out"] / p["ratio"] - 1) for p in points)
    print(f"causal_time_fraction {fraction:.3f}, causal_diagonal_tokens {tokens:.0f} over {len(points)} pairs; "
          f"leave-one-out worst |error| {worst:.1%}")
    out = Path(__file__).parent / "results" / "causal_attention.json"
    out.write_text(json.dumps({"causal_time_fraction": fraction, "causal_diagonal_tokens": tokens,
                               "held_out_worst_abs_error": worst, "pairs": points}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
