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

Also, against one real step (`kineto_step`): the H200's Kineto trace of 8 Llama-3-8B blocks (4 samples of 4,096
tokens, `kineto/kernels.json`), its kernels summed by kind beside the defaults' op times for the same step and with
the fitted causal figures: where the defaults' errors cancel (docs/FIDELITY.md, "Causal attention").

Run: `.venv/bin/python bench/fit_causal_attention.py` (a few seconds); writes bench/results/causal_attention.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.compute import eager_extra_s, op_time
from tagplan.datasets.traces.bundle import read_bundle
from tagplan.frontends.catalog import lookup_device
from tagplan.frontends.model_spec import load_model
from tagplan.ir.model import OpKind
from tagplan.ir.plan import ShardStrategy
from tagplan.ir.workload import DType
from tagplan.training.calibrate import causal_pairs, fit_causal

DATA = Path(__file__).parent / "data" / "gpu"
GPUS = ("h100", "h200")
TRACE = ("h200", "llama-8b-8l", "H200-SXM")  # bundle, traced case, device
KERNEL_KINDS = (  # (kind, substrings of a kernel's name), first match wins
    ("flash attention", ("sdpa", "flash", "fmha", "dot_do_o", "convert_dq")),
    ("GEMMs", ("nvjet", "gemm", "cutlass")),
    ("optimizer (multi-tensor)", ("multi_tensor_apply",)),
    ("loss softmax", ("SoftMax",)),
    ("norms", ("layer_norm", "GammaBeta", "rms")),
    ("copies, casts, pointwise, activations", ("copy", "elementwise", "Functor", "silu", "gelu", "Fill")),
)
OP_KINDS = {OpKind.ATTENTION: "flash attention", OpKind.MATMUL: "GEMMs", OpKind.SOFTMAX: "loss softmax",
            OpKind.LAYERNORM: "norms", OpKind.ELEMENTWISE: "copies, casts, pointwise, activations"}


def kineto_step(fitted: Calibration) -> dict[str, dict[str, float]]:
    """Milliseconds per kernel kind of the traced step, and of the op model's times for it (forward and backward of
    every op, all samples in one micro-batch as traced) under the defaults and under `fitted`."""
    bundle, case, device = TRACE
    trace = json.loads((DATA / bundle / "kineto" / "kernels.json").read_text())[case]
    out: dict[str, dict[str, float]] = {}
    for kernel in trace["kernels"]:
        kind = next((k for k, keys in KERNEL_KINDS if any(x in kernel["name"] for x in keys)), "other")
        out.setdefault(kind, {}).setdefault("trace_ms", 0.0)
        out[kind]["trace_ms"] += 1e3 * kernel["seconds"]
    model = load_model(trace["case"], seq_len=trace["seq_len"])
    spec = lookup_device(device)
    samples = trace["global_batch"] / trace["micro_batches"]
    for label, calibration in (("defaults_ms", DEFAULT_CALIBRATION), ("fitted_causal_ms", fitted)):
        for i in range(len(model.layers)):
            for op in model.block_of(i).ops:
                kind = OP_KINDS.get(op.kind, "other")
                t = op_time(op, samples=samples, tp=1, strategy=ShardStrategy.REPLICATE, spec=spec,
                            dtype=DType.BF16, calibration=calibration)
                out.setdefault(kind, {}).setdefault(label, 0.0)
                out[kind][label] += 1e3 * trace["micro_batches"] * (t.forward_s + t.backward_s)
                # the eager program's own traffic (casts, fp32 residuals, unfused rotary): a norm's in the norms
                extra = eager_extra_s(op, samples=samples, tp=1, strategy=ShardStrategy.REPLICATE, spec=spec,
                                      calibration=calibration, autocast=True)
                eager_kind = "norms" if op.kind is OpKind.LAYERNORM else "copies, casts, pointwise, activations"
                out.setdefault(eager_kind, {}).setdefault(label, 0.0)
                out[eager_kind][label] += 1e3 * trace["micro_batches"] * (extra.forward_s + extra.backward_s)
    return out


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
    fitted_calibration = DEFAULT_CALIBRATION.model_copy(update={"causal_time_fraction": fraction,
                                                                "causal_diagonal_tokens": tokens})
    step = kineto_step(fitted_calibration)
    print(f"\n{TRACE[1]} on {TRACE[2]}, one step by kernel kind (ms; the optimizer step is costed apart):")
    print(f"{'kind':40s} {'trace':>8s} {'defaults':>9s} {'fitted causal':>14s}")
    for kind, figures in sorted(step.items(), key=lambda kv: -kv[1].get("trace_ms", 0.0)):
        print(f"{kind:40s} {figures.get('trace_ms', 0.0):8.1f} {figures.get('defaults_ms', 0.0):9.1f} "
              f"{figures.get('fitted_causal_ms', 0.0):14.1f}")
    out = Path(__file__).parent / "results" / "causal_attention.json"
    out.write_text(json.dumps({"causal_time_fraction": fraction, "causal_diagonal_tokens": tokens,
                               "held_out_worst_abs_error": worst, "pairs": points, "kineto_step": step},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
