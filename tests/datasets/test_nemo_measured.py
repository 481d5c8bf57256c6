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


def test_each_row_runs_the_recipe_its_publisher_offers() -> None:
    """Megatron-Bridge's scripts offer per-tensor fp8 only as current scaling, so its plain "FP8" is fp8-cs;
    NeMo's own scripts ran delayed scaling. Block-scaled rows keep their format; the 25.09 FP8 of unverified
    granularity is not scored."""
    from tagplan.ir.workload import DType

    nemo = load_bench("fidelity_nemo")
    rows = json.loads((BENCH / "data" / "nemo_performance_summary.json").read_text())["rows"]
    scoreable = [r for r in rows if nemo._skip(r) is None]
    by = {(r["provenance"]["repo"], r["config"]["precision"]): nemo.dtype_of(r) for r in scoreable}
    assert by[("NVIDIA-NeMo/Megatron-Bridge", "FP8")] is DType.FP8_CS
    assert by[("NVIDIA/NeMo", "FP8")] is DType.FP8
    assert by[("NVIDIA-NeMo/Megatron-Bridge", "MXFP8")] is DType.MXFP8
    assert by[("NVIDIA-NeMo/Megatron-Bridge", "FP8-MX")] is DType.MXFP8
    assert by[("NVIDIA-NeMo/Megatron-Bridge", "NVFP4")] is DType.NVFP4
    unverified = [r for r in rows if r["config"]["precision"].startswith("FP8 (25.09")]
    assert unverified and all(nemo._skip(r) for r in unverified)
    assert any((nemo._skip(r) or "").startswith("precision FP8 (25.09") for r in unverified)
    # the presets of Megatron-Bridge's Llama 3 rows set no full recompute; NeMo's older rows are not known
    assert all(nemo.recipe(r) for r in scoreable if r["provenance"]["repo"].endswith("Bridge")
               and r["model"]["name"].startswith("Llama 3"))
    assert not any(nemo.recipe(r) for r in scoreable if r["provenance"]["repo"] == "NVIDIA/NeMo")


def test_a_split_with_more_chunks_than_blocks_counts_the_embedding_and_head_as_layers() -> None:
    """Llama 3.1 405B's 126 blocks over pp16 x vp8 (128 chunks): Megatron accounts for the embedding and the
    loss in the pipeline split, one layer a chunk; the even split over blocks alone would leave chunks empty."""
    nemo = load_bench("fidelity_nemo")
    rows = json.loads((BENCH / "data" / "nemo_performance_summary.json").read_text())["rows"]
    row = next(r for r in rows if r["model"]["name"] == "Llama 3.1 405B" and r["config"]["pp"] == 16
               and r["config"].get("vp") == 8 and nemo._skip(r) is None)
    plan = nemo._plan(row, 128)
    assert len(plan.stages) == 128 and all(s.num_layers == 1 for s in plan.stages)
    assert plan.stages[0].layers == (0, 1) and plan.stages[-1].layers == (127, 128)
    # 64 chunks: the embedding shares its chunk with the first block, as before
    assert nemo._plan({**row, "config": {**row["config"], "vp": 4}}, 128).stages[0].layers == (0, 2)


def test_the_fits_see_only_blackwell_rows_and_keep_every_other_row_out_of_sample() -> None:
    """A clock is fitted to its GPU's per-tensor fp8 rows, a block-scaled format's fraction to its rows on those
    GPUs; every H100 and B200 row, and every row whose preset's recompute is unknown, is seen by no fit."""
    nemo = load_bench("fidelity_nemo")
    rows = json.loads((BENCH / "data" / "nemo_performance_summary.json").read_text())["rows"]
    roles = {r["id"]: nemo.fit_role(r) for r in rows}
    gpu = {r["id"]: r["cluster"]["nodes"][0]["gpu"] for r in rows}
    assert {roles[i] for i in roles if gpu[i] in ("H100-SXM-80GB", "B200")} == {None}
    assert {role for role in roles.values() if role} == {"GB200 clock", "GB300 clock", "mxfp8 fraction",
                                                          "nvfp4 fraction"}
    for r in rows:
        role = roles[r["id"]]
        if role is not None:
            assert nemo._skip(r) is None and nemo.recipe(r) is not None
            assert role.startswith(gpu[r["id"]]) or role.startswith(nemo.dtype_of(r).value)


def test_a_blank_vp_is_read_from_the_preset_only_where_the_table_runs_the_presets_layout() -> None:
    """26.02.01's GB300 MXFP8 Llama 3 70B row lists pp4 and no vp; the preset that ran it (pp4 vp5 in every
    published version) interleaves, and the plan the bench scores does too. A row that gives its vp keeps it,
    and a blank vp with another tp or pp, or outside the Llama 3 70B pre-training presets, stays blank."""
    from tagplan.ir.plan import Schedule

    nemo = load_bench("fidelity_nemo")
    rows = json.loads((BENCH / "data" / "nemo_performance_summary.json").read_text())["rows"]
    row = next(r for r in rows if r["id"].endswith("26.02.01/Pre-Training Performance/LLAMA3_70B/DGX-GB300/166"))
    assert row["config"]["vp"] is None and row["config"]["pp"] == 4
    assert nemo.vp_of(row) == (5, "Megatron-Bridge preset (the table leaves vp blank)")
    plan = nemo._plan(row, 82)
    assert plan.schedule is Schedule.INTERLEAVED_1F1B and len(plan.stages) == 20
    assert nemo.vp_of({**row, "config": {**row["config"], "vp": 2}}) == (2, "table")
    assert nemo.vp_of({**row, "config": {**row["config"], "pp": 2}}) == (None, "table")
    assert nemo.vp_of({**row, "config": {**row["config"], "task": "SFT Performance"}}) == (None, "table")
    assert nemo.vp_of({**row, "model": {**row["model"], "name": "Llama 3 8B"}}) == (None, "table")
    filled = [r["id"] for r in rows if nemo._skip(r) is None and nemo.vp_of(r)[1] != "table"]
    assert filled == [row["id"]]
