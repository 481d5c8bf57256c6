"""`tagplan export` and `tagplan verify` as users run them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tagplan.cli import main
from tagplan.export.runtime_fork import RANK_SERVER_ENV
from tagplan.ir.workload import DType

pytestmark = pytest.mark.usefixtures("rank_server")  # ranks fork from the session's rank server (tests/conftest.py)

TINY = "gpt?layers=2&hidden=64&heads=4&vocab=128"


def write_plan(path: Path, stages: list[dict], micro_batches: int = 4) -> Path:  # type: ignore[type-arg]
    path.write_text(json.dumps({"version": 1, "micro_batches": micro_batches, "schedule": "1f1b", "stages": stages}))
    return path


def test_export_torch_and_megatron_write_their_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "plan.json", [{"layers": [0, 2], "devices": [0, 1], "dp": 1, "tp": 2},
                                               {"layers": [2, 4], "devices": [2, 3], "dp": 1, "tp": 2}])
    wide = "gpt?layers=2&hidden=64&heads=4&vocab=4096"  # more vocabulary than positions: wte splits by rows
    assert main(["export", "--model", wide, "--plan", str(plan), "--seq", "16", "--format", "torch",
                 "--out", str(tmp_path / "torch"), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)["files"]
    assert {Path(f).name for f in files} == {"train.py", "plan.json", "launch_node0.sh"}
    assert "init_device_mesh" in (tmp_path / "torch" / "train.py").read_text()
    assert main(["export", "--model", wide, "--plan", str(plan), "--seq", "16", "--format", "megatron",
                 "--cluster", "p3.8xlarge", "--out", str(tmp_path / "mg")]) == 0
    text = capsys.readouterr().out  # for people: the files, one a line
    assert text.startswith("wrote the megatron export:") and "megatron_args.txt" in text
    args = (tmp_path / "mg" / "megatron_args.txt").read_text().split()
    assert args[args.index("--tensor-model-parallel-size") + 1] == "2"
    assert args[args.index("--pipeline-model-parallel-size") + 1] == "2"
    assert "--tp-comm-overlap" not in args
    # a plan costed with the TP collectives overlapped (plan --tp-comm-overlap) runs so under Megatron
    # only; the torch program runs them exposed, and the export says the run will be slower
    assert main(["export", "--model", wide, "--plan", str(plan), "--seq", "16", "--format", "megatron",
                 "--tp-comm-overlap", "--out", str(tmp_path / "mg-overlap")]) == 0
    assert "--tp-comm-overlap" in (tmp_path / "mg-overlap" / "megatron_args.txt").read_text().split()
    assert "tensor-parallel collectives: overlapped with compute" in capsys.readouterr().out
    assert main(["export", "--model", wide, "--plan", str(plan), "--seq", "16", "--format", "torch",
                 "--tp-comm-overlap", "--out", str(tmp_path / "torch-overlap"), "--json"]) == 0
    tp_comm = json.loads(capsys.readouterr().out)["tp_comm"]
    assert tp_comm["overlapped"] is False and "slower than predicted" in tp_comm["notes"][0]


def test_an_inexpressible_plan_is_refused_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "uneven.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1,
                                                 "batch_shares": [0.75, 0.25]}], micro_batches=1)
    for fmt in ("megatron", "deepspeed"):
        assert main(["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--format", fmt,
                     "--out", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err
        assert "share" in err, err
        assert not (tmp_path / fmt).exists() or not any((tmp_path / fmt).iterdir())
    assert main(["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--format", "torch",
                 "--out", str(tmp_path / "torch")]) == 0  # 6 and 2 whole samples: the pipeline runtime runs it
    fraction = write_plan(tmp_path / "fraction.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1,
                                                       "batch_shares": [0.7, 0.3]}], micro_batches=1)
    assert main(["export", "--model", TINY, "--plan", str(fraction), "--seq", "16", "--format", "torch",
                 "--out", str(tmp_path / "fraction")]) == 2
    assert "5.6, 2.4 samples each; every replica needs a whole number" in capsys.readouterr().err
    assert not (tmp_path / "fraction").exists()


def test_the_readme_tour_plan_exports_to_torch_with_launch_scripts_in_node_order(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stages = [{"layers": [0, 5], "devices": [12, 13, 14, 15], "dp": 2, "tp": 2},
              {"layers": [5, 12], "devices": [0, 1, 2, 3], "dp": 4, "tp": 1},
              {"layers": [12, 19], "devices": [4, 5, 6, 7], "dp": 4, "tp": 1},
              {"layers": [19, 26], "devices": [8, 9, 10, 11], "dp": 4, "tp": 1}]
    plan = write_plan(tmp_path / "tour.json", stages)
    assert main(["export", "--model", "gpt3-1.3b", "--cluster", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1",
                 "--plan", str(plan), "--batch", "32", "--seq", "1024", "--format", "torch",
                 "--out", str(tmp_path / "run")]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "start launch_node0.sh on the node that runs stage 0" in text
    cfg = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert cfg["runtime"] == "pipeline" and cfg["dtype"] == "bf16"
    assert [r["device"] for r in cfg["ranks"][:5]] == [12, 13, 14, 15, 0]
    node0 = (tmp_path / "run" / "launch_node0.sh").read_text()
    assert "--nnodes 4 --node-rank 0 --nproc-per-node 4" in node0 and "g4dn.12xlarge-0, 4 x T4" in node0
    for fmt, why in (("megatron", "stages[1].tp = 1 but stages[0].tp = 2"),
                     ("deepspeed", "stages[0].tp = 2: DeepSpeed's pipeline engine has no tensor parallelism")):
        assert main(["export", "--model", "gpt3-1.3b", "--plan", str(plan), "--batch", "32", "--seq", "1024",
                     "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        assert why in capsys.readouterr().err


@pytest.mark.slow
def test_verify_runs_a_pipeline_on_gloo_and_compares_with_one_process(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "pp2.json", [{"layers": [0, 2], "devices": [0], "dp": 1, "tp": 1},
                                              {"layers": [2, 4], "devices": [1], "dp": 1, "tp": 1}])
    assert main(["verify", "--model", TINY, "--plan", str(plan), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["max_abs_error"] < 1e-5 and len(out["step_time_s"]) == 2
    assert out["predicted_vs_measured"]["predicted_s"] > 0
    assert main(["verify", "--model", TINY, "--plan", str(plan), "--loss", "fused", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"]  # the program's fused loss against the eager reference


HF_LLAMA = ("hf:LlamaConfig?num_hidden_layers=2&hidden_size=256&intermediate_size=512&num_attention_heads=4"
            "&num_key_value_heads=2&vocab_size=1000")


def test_hugging_face_llama_and_gpt2_configs_export_as_their_families(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from tagplan.export.modules import build_model
    from tagplan.frontends.model_spec import load_model

    for spec in (HF_LLAMA, "hf:GPT2Config?n_layer=2&n_embd=128&n_head=4&vocab_size=1000"):
        graph, module = load_model(spec, seq_len=16), build_model(spec, seq_len=16)
        assert sum(p.numel() for p in module.parameters()) == graph.params  # same shapes as the traced graph
    plan = write_plan(tmp_path / "tp2.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 1, "tp": 2}], 2)
    for fmt in ("torch", "megatron"):
        assert main(["export", "--model", HF_LLAMA, "--plan", str(plan), "--seq", "16", "--format", fmt,
                     "--out", str(tmp_path / fmt)]) == 0, capsys.readouterr().err
    args = (tmp_path / "megatron" / "megatron_args.txt").read_text().split()
    assert args[args.index("--num-query-groups") + 1] == "2" and "--swiglu" in args
    assert main(["export", "--model", "hf:BertConfig", "--plan", str(plan), "--format", "torch",
                 "--out", str(tmp_path / "bert")]) == 2


def test_bad_input_is_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "one.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1}], 1)
    assert main(["export", "--model", "gpt?layerz=2", "--plan", str(tmp_path / "missing.json"),
                 "--out", str(tmp_path / "x")]) == 2  # the SPEC is read first
    assert "layerz" in capsys.readouterr().err
    assert main(["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--cluster", "p3.8xlarge",
                 "--nodes", "2", "--format", "deepspeed", "--out", str(tmp_path / "ds"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "deepspeed"
    assert main(["verify", "--model", TINY, "--plan", str(plan), "--calibration", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_measure_appends_a_real_iteration_record(tmp_path: Path) -> None:
    from tagplan.datasets.traces.bundle import read_bundle

    plan = tmp_path / "plan.json"
    plan.write_text('{"micro_batches": 2, "stages": [{"layers": [0, 3], "devices": [0, 1], "dp": 2, "tp": 1}, '
                    '{"layers": [3, 6], "devices": [2], "dp": 1, "tp": 1}]}')
    args = ["measure", "--model", "gpt?layers=4&hidden=64&heads=4&vocab=128", "--plan", str(plan), "--batch", "8",
            "--seq", "32", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "bundle")]
    assert main(args) == 0
    assert main(args) == 0  # appended to the same bundle
    records = list(read_bundle(tmp_path / "bundle").iterations())
    assert len(records) == 2
    assert all(r.measured_s > 0 and r.repeats == 2 for r in records)
    assert records[0].plan["stages"][1]["devices"] == [2]  # three gloo ranks, in plan order
    assert records[0].workload.grad_reduce_overlap is False  # the pipeline runtime reduces after the flush
    assert records[0].workload.eager  # the torch program runs its modules op by op


def _measure_args(tmp_path: Path, *extra: str) -> list[str]:
    plan = write_plan(tmp_path / "dp2.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1}], 1)
    return ["measure", "--model", TINY, "--plan", str(plan), "--seq", "16", "--batch", "4", "--out",
            str(tmp_path / "bundle"), *extra]


def test_measure_on_gpus_runs_the_ranks_there_and_records_the_gpus(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from tagplan.datasets.traces.bundle import read_bundle
    from tagplan.export import measure as measuring

    asked: dict[str, object] = {}

    def measured(spec: object, plan: object, **kwargs: object) -> measuring.Measurement:
        asked.update(kwargs)
        return measuring.Measurement(0.25, 0.24, 0.27, 5, peak_memory_bytes=3e9)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a host with four H100s, on any host
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(measuring, "measure", measured)
    assert main(_measure_args(tmp_path, "--device", "cuda")) == 0
    assert asked["device"] == "cuda" and asked["dtype"] is DType.BF16  # bf16 autocast unless told
    (record,) = read_bundle(tmp_path / "bundle").iterations()
    group = record.cluster["node_groups"][0]  # type: ignore[index]
    assert group["gpu"]["name"] == "H100-SXM" and group["gpus_per_node"] == 2
    assert record.workload.dtype is DType.BF16 and record.workload.grad_reduce_dtype is DType.FP32  # the program's
    assert record.peak_memory_bytes == 3e9 and "NCCL" in record.source
    assert read_bundle(tmp_path / "bundle").manifest.fingerprint.backend == "cuda"


def test_measure_refuses_what_this_host_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert main(_measure_args(tmp_path, "--dtype", "bf16")) == 2  # the CPU program runs in fp32
    assert "--dtype 'bf16' with --device cpu" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(_measure_args(tmp_path, "--device", "cuda")) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")
    assert main(_measure_args(tmp_path, "--device", "cuda")) == 2
    assert "the plan has 2 devices and this host 1 GPUs" in capsys.readouterr().err
    assert not (tmp_path / "bundle").exists()  # nothing ran, nothing written


def test_grad_reduce_flags_reach_the_files_and_the_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path / "dp2.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1}], 1)
    base = ["export", "--model", TINY, "--plan", str(plan), "--seq", "16"]
    assert main([*base, "--format", "deepspeed", "--out", str(tmp_path / "ds"), "--grad-reduce-dtype", "fp32",
                 "--no-grad-reduce-overlap", "--json"]) == 0
    reduce = json.loads(capsys.readouterr().out)["grad_reduce"]
    assert reduce == {"dtype": "fp32", "overlap": False, "notes": [], "written": [
        'communication_data_type: "fp32"', "fp32_allreduce: true", "zero_optimization.overlap_comm: false"]}
    config = json.loads((tmp_path / "ds" / "ds_config.json").read_text())
    assert config["fp32_allreduce"] is True and config["zero_optimization"]["overlap_comm"] is False
    assert main([*base, "--format", "deepspeed", "--out", str(tmp_path / "ds0")]) == 0  # ZeRO 0, costed overlapped
    text = capsys.readouterr().out
    assert "gradient reduction: bf16, after the backward" in text and "note: DeepSpeed cannot overlap" in text
    assert json.loads((tmp_path / "ds0" / "partition.json").read_text())["tagplan_notes"]
    assert main([*base, "--format", "megatron", "--out", str(tmp_path / "mg"), "--grad-reduce-dtype", "fp32",
                 "--no-grad-reduce-overlap"]) == 0
    args = (tmp_path / "mg" / "megatron_args.txt").read_text().split()
    assert "--accumulate-allreduce-grads-in-fp32" in args and "--overlap-grad-reduce" not in args
    assert "written: --accumulate-allreduce-grads-in-fp32" in capsys.readouterr().out
    assert main([*base, "--format", "torch", "--out", str(tmp_path / "t"), "--grad-reduce-dtype", "bf16"]) == 2
    assert "grad_reduce_dtype=bf16" in capsys.readouterr().err and not (tmp_path / "t").exists()
    with pytest.raises(SystemExit) as stop:  # argparse: no runtime reduces in fp8
        main([*base, "--format", "torch", "--out", str(tmp_path / "t"), "--grad-reduce-dtype", "fp8"])
    assert stop.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_verify_takes_a_time_limit_and_reports_reaching_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RANK_SERVER_ENV)  # plain processes: forked from the rank server, the run takes under 1 s
    plan = write_plan(tmp_path / "dp2.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1}], 1)
    with pytest.raises(SystemExit) as refused:
        main(["verify", "--model", TINY, "--plan", str(plan), "--timeout-s", "0"])
    assert refused.value.code == 2 and "argument --timeout-s: 0 must be a positive number" in capsys.readouterr().err
    # one second does not cover starting torch in two processes: the run is stopped for time, and says so
    assert main(["verify", "--model", TINY, "--plan", str(plan), "--timeout-s", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["worst_parameter"] == "(time limit)" and "did not finish within its time limit" in out["message"]


def test_export_writes_the_loss_as_costed_or_says_what_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--loss fused: Megatron-LM writes Transformer Engine's fused cross-entropy and the torch program runs its own;
    Megatron-Core otherwise runs its own (no flag, nothing to note); a loss the program does not run is noted."""
    plan = write_plan(tmp_path / "plan.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1}])

    def export(fmt: str, *extra: str) -> tuple[dict, list[str]]:
        out = tmp_path / f"{fmt}{''.join(extra)}"
        assert main(["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--format", fmt, "--out", str(out),
                     "--json", *extra]) == 0
        args = (out / "megatron_args.txt").read_text().split() if fmt == "megatron" else []
        return json.loads(capsys.readouterr().out)["loss"], args

    loss, args = export("megatron", "--loss", "fused")
    assert args[args.index("--cross-entropy-loss-fusion") + 1:][:2] == ["--cross-entropy-fusion-impl", "te"]
    assert loss == {"runs": "fused", "fused_written": True, "notes": []}
    for asked in ("eager", "in-place"):
        loss, args = export("megatron", "--loss", asked)
        assert "--cross-entropy-loss-fusion" not in args
        assert loss == {"runs": "in-place", "fused_written": False, "notes": []}  # keeps less than eager: no surprise
    assert export("torch", "--loss", "fused")[0] == {"runs": "fused", "fused_written": True, "notes": []}
    assert json.loads((tmp_path / "torch--lossfused" / "plan.json").read_text())["loss"] == "fused"
    loss, _ = export("torch", "--loss", "in-place")  # the program runs no in-place loss: eager keeps more
    assert loss["runs"] == "eager" and "keeps more memory" in loss["notes"][0]
    assert json.loads((tmp_path / "torch--lossin-place" / "plan.json").read_text())["loss"] == "eager"
    assert export("torch")[0] == {"runs": "eager", "fused_written": False, "notes": []}
    assert main(["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--format", "megatron", "--loss",
                 "fused", "--out", str(tmp_path / "text")]) == 0
    assert "cross-entropy: Transformer Engine's fused kernel" in capsys.readouterr().out
    assert main(["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--format", "torch", "--loss",
                 "fused", "--out", str(tmp_path / "torch-text")]) == 0
    assert "cross-entropy: the program's fused cross-entropy" in capsys.readouterr().out


def test_an_export_in_a_dtype_the_gpus_lack_tensor_cores_for_says_the_run_is_slower(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The planner costs bf16 on a V100 at fp16's rate (it has no bf16 tensor cores) and says so; the export that
    writes --bf16 for it said nothing."""
    plan = write_plan(tmp_path / "plan.json", [{"layers": [0, 4], "devices": [0, 1], "dp": 2, "tp": 1}])
    args = ["export", "--model", TINY, "--plan", str(plan), "--seq", "16", "--format", "megatron", "--json"]
    assert main([*args, "--cluster", "p3.8xlarge", "--out", str(tmp_path / "v100")]) == 0
    note = json.loads(capsys.readouterr().out)["tensor_cores"]
    assert note.startswith("V100-SXM2-16GB: no bf16 tensor cores") and "export with --dtype fp16" in note
    assert main([*args, "--cluster", "p3.8xlarge", "--dtype", "fp16", "--out", str(tmp_path / "fp16")]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_cores"] is None
    assert main([*args, "--cluster", "dgx-a100-80gb", "--out", str(tmp_path / "a100")]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_cores"] is None


def test_a_plan_file_says_what_it_was_searched_for_and_the_commands_take_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --out` records the batch and sequence; `export`, `simulate` and `measure` default to them and refuse
    another (an export at the default batch 8 had refused the README tour's plan, and one at the model's own
    sequence had written twice the searched tokens without a word)."""
    problem = ["--model", TINY, "--cluster", "p3.8xlarge:nodes=1+g4dn.12xlarge:nodes=1"]
    plan = tmp_path / "p.json"
    assert main(["plan", *problem, "--batch", "12", "--seq", "16", "--max-evaluations", "20", "--workers", "1",
                 "--out", str(plan)]) == 0
    assert json.loads(plan.read_text())["searched_for"] == {"global_batch": 12, "seq_len": 16}
    capsys.readouterr()
    assert main(["export", "--model", TINY, "--plan", str(plan), "--format", "torch",
                 "--out", str(tmp_path / "r")]) == 0
    cfg = json.loads((tmp_path / "r" / "plan.json").read_text())
    assert (cfg["global_batch"], cfg["seq_len"]) == (12, 16)
    capsys.readouterr()
    assert main(["simulate", *problem, "--plan", str(plan), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens_per_s"] * report["iteration_time_s"] == pytest.approx(12 * 16)
    for option, value in (("--batch", "8"), ("--seq", "32")):
        assert main(["export", "--model", TINY, "--plan", str(plan), option, value, "--format", "torch",
                     "--out", str(tmp_path / "x")]) == 2
        assert f"{option} {value}: {plan} was searched for {option} " in capsys.readouterr().err
    exportable = tmp_path / "torch.json"  # costed as the torch program reduces: in fp32, and it says so
    assert main(["plan", *problem, "--batch", "12", "--seq", "16", "--max-evaluations", "20", "--workers", "1",
                 "--exportable", "torch", "--out", str(exportable)]) == 0
    assert json.loads(exportable.read_text())["searched_for"]["grad_reduce_dtype"] == "fp32"
    capsys.readouterr()
    in_bf16 = tmp_path / "bf16.json"  # costed in bf16 said outright: exported as the default, noted, not refused
    assert main(["plan", *problem, "--batch", "12", "--seq", "16", "--max-evaluations", "20", "--workers", "1",
                 "--grad-reduce-dtype", "bf16", "--out", str(in_bf16)]) == 0
    capsys.readouterr()
    for path, noted in ((exportable, False), (plan, True), (in_bf16, True)):
        assert main(["export", "--model", TINY, "--plan", str(path), "--format", "torch", "--out",
                     str(tmp_path / "t"), "--json"]) == 0
        notes = json.loads(capsys.readouterr().out)["grad_reduce"]["notes"]
        assert any("costed with gradients reduced in bf16" in n for n in notes) is noted
    bare = write_plan(tmp_path / "bare.json", json.loads(plan.read_text())["stages"])  # no searched_for: defaults
    assert main(["measure", "--model", TINY, "--plan", str(bare), "--batch", "12", "--out", str(tmp_path / "b")]) == 2
    assert "--seq: " in capsys.readouterr().err
