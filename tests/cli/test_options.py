"""The CLI's shared grammar: one cluster option set, the planner's defaults, `--json` everywhere, no cycles."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

import tagplan.cli
from tagplan.cli import build_parser
from tagplan.cli.options import cluster_options
from tagplan.frontends.cluster_spec import ClusterOptions
from tagplan.ir.workload import LossKernel
from tagplan.search.problem import DEFAULT_BUDGET_S, DEFAULT_GLOBAL_BATCH, DEFAULT_MAX_EVALUATIONS

CLI = Path(tagplan.cli.__file__).parent
FLAGS = ["--nodes", "2", "--gpu", "A100-SXM-80GB", "--nics", "4", "--nic-gbps", "200", "--network-latency-us", "7",
         "--nccl-tests", "a.log", "--nccl-tests", "b.log"]
WANT = ClusterOptions(nodes=2, gpu="A100-SXM-80GB", nics=4, nic_speed_Gbps=200.0, network_latency_us=7.0,
                      nccl_tests=("a.log", "b.log"))
PROBLEM = ["--model", "gpt3-125m", "--cluster", "p3.8xlarge"]
PRINTING = [["inspect", "model", "x"], ["inspect", "cluster", "x"], ["simulate", *PROBLEM, "--plan", "dp"],
            ["plan", *PROBLEM], ["dataset", "generate", "--out", "d"], ["train"], ["models", "list"],
            ["profile", "--out", "t"], ["traces", "import", "f", "--device", "cpu", "--out", "t"],
            ["traces", "show", "t"], ["calibrate", "t", "--out", "c.json"], ["demo"]]


@pytest.mark.parametrize("command", [["inspect", "cluster", "x"], ["simulate", *PROBLEM, "--plan", "dp"],
                                     ["plan", *PROBLEM]])
def test_every_cluster_command_takes_the_same_cluster_options(command: list[str]) -> None:
    assert cluster_options(build_parser().parse_args([*command, *FLAGS])) == WANT
    assert cluster_options(build_parser().parse_args(command)) == ClusterOptions()


def test_plan_defaults_are_the_problem_defaults() -> None:
    from tagplan.cli.options import load_problem

    args = build_parser().parse_args(["plan", *PROBLEM])
    assert (args.budget_s, args.max_evaluations) == (DEFAULT_BUDGET_S, DEFAULT_MAX_EVALUATIONS)
    assert load_problem(args)[2].global_batch == DEFAULT_GLOBAL_BATCH  # --batch unset: the default, resolved there
    simulate = build_parser().parse_args(["simulate", *PROBLEM, "--plan", "dp"])
    assert load_problem(simulate)[2].global_batch == DEFAULT_GLOBAL_BATCH


@pytest.mark.parametrize("command", PRINTING, ids=lambda c: " ".join(c[:2]))
def test_every_command_that_prints_a_result_takes_json(command: list[str]) -> None:
    assert build_parser().parse_args([*command, "--json"]).json is True


@pytest.mark.parametrize("bad", [["plan", *PROBLEM, "--budget-s", "0"], ["plan", *PROBLEM, "--time-bound-s", "-1"],
                                 ["inspect", "cluster", "x", "--nic-gbps", "nan"]])
def test_bad_numbers_are_refused_by_the_parser(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(bad)
    assert stop.value.code == 2 and "must be a positive number" in capsys.readouterr().err


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_command_module_imports_the_entry_point() -> None:
    for path in CLI.glob("*.py"):
        if path.name not in ("__init__.py", "__main__.py", "main.py"):
            assert "tagplan.cli.main" not in _imports(path), path.name
    options = {m for m in _imports(CLI / "options.py") if m.startswith("tagplan.cli")}
    assert not options, "cli.options must import no other cli module"


def test_help_is_built_for_every_command() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert command.format_help(), name


def test_no_grad_reduce_overlap_reaches_the_workload() -> None:
    from tagplan.cli.planning import plan_problem

    def overlap(*extra: str) -> bool:
        return plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workload.grad_reduce_overlap

    assert overlap() is True
    assert overlap("--no-grad-reduce-overlap") is False


def test_tp_comm_overlap_is_off_unless_asked() -> None:
    from tagplan.cli.planning import plan_problem

    def overlap(*extra: str) -> bool:
        return plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workload.tp_comm_overlap

    assert overlap() is False
    assert overlap("--tp-comm-overlap") is True


def test_eager_names_the_runtime_and_its_weights() -> None:
    """`--eager` (default: fused kernels): autocast over fp32 weights, or weights held in 16 bits; and a clear error
    for 16-bit weights at fp32."""
    from tagplan.cli.planning import plan_problem
    from tagplan.errors import SpecError

    def workload(*extra: str) -> tuple[bool, bool, bool]:
        w = plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workload
        return w.eager, w.eager_16bit_weights, w.autocast

    assert workload() == (False, False, False)
    assert workload("--eager", "autocast") == (True, False, True)
    assert workload("--eager", "16bit-weights") == (True, True, False)
    assert workload("--eager", "autocast", "--dtype", "fp32") == (True, False, False)
    assert workload("--eager", "16bit-weights", "--dtype", "fp8") == (True, True, False)  # Composer's fp8 over bf16
    with pytest.raises(SpecError, match=r"--eager 16bit-weights with --dtype fp32: .*\(accepted: any dtype but fp32"):
        workload("--eager", "16bit-weights", "--dtype", "fp32")


def test_a_plan_for_an_export_target_is_costed_as_that_runtime_reduces_gradients() -> None:
    from tagplan.cli.planning import plan_problem
    from tagplan.ir.workload import DType

    def reduce(*extra: str) -> DType | None:
        return plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workload.grad_reduce_dtype

    assert reduce() is None  # the training dtype
    assert reduce("--exportable", "torch") is DType.FP32  # fp32 master weights under autocast
    assert reduce("--exportable", "deepspeed") is None
    assert reduce("--exportable", "megatron", "--grad-reduce-dtype", "bf16") is DType.BF16  # said outright


def test_plan_for_a_target_refuses_a_reduction_it_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from tagplan.cli import main

    assert main(["plan", *PROBLEM, "--exportable", "torch", "--grad-reduce-dtype", "bf16"]) == 2
    assert "grad_reduce_dtype=bf16" in capsys.readouterr().err  # the program reduces in fp32
    assert main(["plan", *PROBLEM, "--exportable", "megatron", "--grad-reduce-dtype", "fp16"]) == 2
    assert "Accepted with dtype bf16: fp32, bf16" in capsys.readouterr().err


def test_plan_runs_the_baselines_beside_the_search_where_cores_are_free(monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tagplan.cli.planning import plan_problem
    from tagplan.search import background

    def workers(*extra: str) -> int:
        return plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workers

    monkeypatch.setattr(background, "usable_cores", lambda: 2)
    assert workers() == 2 and workers("--workers", "1") == 1
    monkeypatch.setattr(background, "usable_cores", lambda: 1)
    assert workers() == 1 and workers("--workers", "3") == 3
    monkeypatch.setattr(background, "usable_cores", lambda: 64)
    assert workers() == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", *PROBLEM, "--workers", "4"])
    assert "invalid choice: 4" in capsys.readouterr().err


def test_attention_is_each_gpus_own_unless_asked() -> None:
    from tagplan.cli.planning import plan_problem

    def fused(*extra: str) -> bool | None:
        return plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workload.fused_attention

    assert fused() is None
    assert fused("--attention", "fused") is True
    assert fused("--attention", "unfused") is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", *PROBLEM, "--attention", "flash"])


def test_the_loss_is_eager_unless_asked() -> None:
    from tagplan.cli.planning import plan_problem

    def loss(*extra: str) -> LossKernel:
        return plan_problem(build_parser().parse_args(["plan", *PROBLEM, *extra])).workload.loss

    assert loss() is LossKernel.EAGER
    assert loss("--loss", "fused") is LossKernel.FUSED
    assert loss("--loss", "in-place") is LossKernel.IN_PLACE
    assert loss("--loss", "eager") is LossKernel.EAGER
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", *PROBLEM, "--loss", "liger"])
