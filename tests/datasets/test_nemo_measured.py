"""NVIDIA's published NeMo / Megatron-Bridge runs (bench/data/nemo_performance_summary.json) as
bench/fidelity_nemo.py screens them."""

from __future__ import annotations

import json

from bench_modules import BENCH, load_bench


def test_the_nemo_lora_rows_are_not_scored_as_full_training() -> None:
    nemo = load_bench("fidelity_nemo")
    rows = json.loads((BENCH / "data" / "nemo_performance_summary.json").read_text())["rows"]
    tasks = {r["id"].rsplit("/", 1)[1]: r["config"]["task"] for r in rows if "24.07/Finetuning" in r["id"]}
    assert tasks == {"305": "Finetuning (SFT)", "306": "Finetuning (SFT)", "307": "Finetuning (SFT)",
                     "308": "Finetuning (LoRA)", "309": "Finetuning (LoRA)", "310": "Finetuning (LoRA)"}
    reasons = {r["id"]: nemo._skip(r) for r in rows}
    lora = [r["id"] for r in rows if "LoRA" in (r["config"].get("task") or "")]
    assert len(lora) == 8 and all(reasons[i] == "LoRA fine-tuning not modelled" for i in lora)
    assert [reasons[r["id"]] for r in rows if r["config"].get("task") == "Finetuning (SFT)"] == [None, None, None]
