"""The exported program's optimizer step (tagplan.export.runtime_optim): ZeRO shards on the pipeline
runtime and fp16 dynamic loss scaling on both runtimes.

The slow tests run the program in `--verify` mode on 2-4 local gloo processes: it dumps step 0's
gradients and, after its last step, every parameter (`params_*.pt`), which is what is compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tagplan.export.runtime_launch import RankRun, launch
from tagplan.export.runtime_optim import LossScaler, make_scaler, shard_bounds
from tagplan.export.shapes import scaled_down
from tagplan.export.torch_program import write_torch_program
from tagplan.export.verify import _compare, reference
from tagplan.ir.plan import Plan, Stage
from tagplan.ir.workload import DType

SEQ, BATCH = 16, 8  # two micro-batches of 4 samples: 3 and 1 on the uneven replicas


def test_loss_scaler_halves_on_overflow_and_doubles_after_its_interval() -> None:
    scaler = LossScaler(scale=1024.0, growth_interval=2)
    scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    scaler.update(found_inf=False)
    assert scaler.scale == 2048.0 and scaler.good_steps == 0
    scaler.update(found_inf=False)
    scaler.update(found_inf=True)  # an overflow also restarts the count
    assert scaler.scale == 1024.0 and scaler.good_steps == 0
    scaler.update(found_inf=False)
    assert scaler.scale == 1024.0


def test_only_fp16_gets_a_scaler_and_plan_json_may_set_it() -> None:
    assert make_scaler({"dtype": "bf16"}) is None and make_scaler({"dtype": "fp32"}) is None
    default = make_scaler({"dtype": "fp16"})
    assert default is not None and default.scale == 2.0**16 and default.growth_interval == 2000
    custom = make_scaler({"dtype": "fp16", "loss_scale": {"init": 8.0, "growth_interval": 3}})
    assert custom is not None and (custom.scale, custom.growth_interval) == (8.0, 3)


def test_shards_are_equal_contiguous_slices_padded_at_the_end() -> None:
    assert [shard_bounds(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]  # 2 padding elements
    assert [shard_bounds(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert shard_bounds(0, 2, 1) == (0, 0)


# --- running the program ---------------------------------------------------------------------------


def _stage(layers: tuple[int, int], devices: tuple[int, ...], **kw: Any) -> Stage:
    return Stage(layers=layers, devices=devices, **kw)


def _two_stages(zero: int) -> Plan:
    """Stage 0 on two uneven replicas (3 and 1 samples) with `zero`, stage 1 on one device; the tied
    head's copy on stage 1."""
    return Plan(micro_batches=2, stages=(_stage((0, 2), (0, 1), dp=2, zero=zero, batch_samples=(3, 1)),
                                         _stage((2, 4), (2,))))


def _run(spec: str, plan: Plan, folder: Path, *, steps: int, dtype: DType = DType.FP32,
         extra: dict[str, object] | None = None) -> tuple[list[RankRun], Path]:
    """Write the program (plan.json updated with `extra`), run it in verify mode; (runs, dump folder)."""
    program = write_torch_program(spec, plan, folder, seq_len=SEQ, global_batch=BATCH, steps=steps, dtype=dtype)
    if extra:
        cfg = json.loads((folder / "plan.json").read_text())
        (folder / "plan.json").write_text(json.dumps({**cfg, **extra}))
    dump = folder / "dump"
    dump.mkdir()
    runs = launch(program, len(plan.devices), ["--verify", str(dump)], timeout_s=300)
    assert all(r.returncode == 0 for r in runs), "\n".join(r.stderr_tail for r in runs)
    return runs, dump


def _params(dump: Path) -> dict[str, torch.Tensor]:
    return {name: t for path in sorted(dump.glob("params_*.pt")) for name, t in torch.load(path).items()}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        err = float((got[name] - w).abs().max())
        assert err <= 1e-7 + 1e-5 * float(w.abs().max()), f"{name}: max abs difference {err:.3g}"


def _grads_match(spec: str, plan: Plan, runs: list[RankRun], dump: Path) -> None:
    ref_loss, ref_grads = reference(spec, seq_len=SEQ, global_batch=BATCH, micro_batches=plan.micro_batches)
    report = _compare(dump, runs, ref_loss, ref_grads, atol=1e-6, rtol=1e-4)
    assert report.passed, report.message


@pytest.mark.slow
def test_zero1_and_zero2_steps_equal_the_unsharded_step_on_uneven_replicas(gpt_spec: str, tmp_path: Path) -> None:
    spec = scaled_down(gpt_spec, seq_len=SEQ)
    dumps = {}
    for zero in (0, 1, 2):
        runs, dumps[zero] = _run(spec, _two_stages(zero), tmp_path / f"zero{zero}", steps=2)
        _grads_match(spec, _two_stages(zero), runs, dumps[zero])  # ZeRO >= 1: gathered back from the slices
    unsharded = _params(dumps[0])
    for zero in (1, 2):
        _assert_close(_params(dumps[zero]), unsharded)
    # the tied table (stage 0, sharded) and the head's copy (stage 1, whole) took the same steps
    torch.testing.assert_close(_params(dumps[2])["layers.0.wte.weight"], _params(dumps[2])["layers.3.lm_head.weight"])


@pytest.mark.slow
def test_zero2_over_tensor_parallel_pieces_equals_the_unsharded_step(gpt_spec: str, tmp_path: Path) -> None:
    spec = scaled_down(gpt_spec, seq_len=SEQ)

    def plan(zero: int) -> Plan:  # uneven shares: the pipeline runtime; the tied copies on one stage
        return Plan(micro_batches=2, stages=(_stage((0, 4), (0, 1, 2, 3), dp=2, tp=2, zero=zero,
                                                    batch_samples=(3, 1)),))

    _, unsharded = _run(spec, plan(0), tmp_path / "zero0", steps=2)
    _, sharded = _run(spec, plan(2), tmp_path / "zero2", steps=2)
    _assert_close(_params(sharded), _params(unsharded))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])  # ZeroShard's slices; FSDP2's sharded DTensor gradients
def test_fp16_gradients_match_after_unscaling_and_an_overflow_skips_every_rank(gpt_spec: str, tmp_path: Path,
                                                                                 zero: int) -> None:
    spec = scaled_down(gpt_spec, seq_len=SEQ)
    plan = _two_stages(zero=zero)
    runs, one_step = _run(spec, plan, tmp_path / "fp16", steps=1, dtype=DType.FP16)
    _grads_match(spec, plan, runs, one_step)  # verify mode computes fp32, the 2**16 loss scale divided out
    assert {(line["loss_scale"], line["skipped"]) for r in runs for line in r.lines} == {(2.0**16, False)}
    # an inf gradient on rank 1 (of the sharded stage) alone at step 1: every rank skips it, the weights
    # stay as after step 0
    runs, skipped = _run(spec, plan, tmp_path / "overflow", steps=2, dtype=DType.FP16,
                         extra={"inject_inf": {"rank": 1, "step": 1}})
    assert [[(line["loss_scale"], line["skipped"]) for line in r.lines] for r in runs] == [
        [(2.0**16, False), (2.0**16, True)]] * 3
    _assert_close(_params(skipped), _params(one_step))


@pytest.mark.slow
def test_an_overflow_on_the_mesh_runtime_halves_the_scale_on_every_rank(gpt_spec: str, tmp_path: Path) -> None:
    spec = scaled_down(gpt_spec, seq_len=SEQ)
    plan = Plan(micro_batches=2, stages=(_stage((0, 4), (0, 1), dp=2, zero=1),))
    runs, _ = _run(spec, plan, tmp_path / "mesh", steps=2, dtype=DType.FP16,
                   extra={"inject_inf": {"rank": 0, "step": 0}, "loss_scale": {"init": 1024.0}})
    assert json.loads((tmp_path / "mesh" / "plan.json").read_text())["runtime"] == "mesh"
    assert [[(line["loss_scale"], line["skipped"]) for line in r.lines] for r in runs] == [
        [(1024.0, True), (512.0, False)]] * 2


@pytest.mark.slow
def test_zero3_shards_the_weights_between_steps_and_steps_as_the_unsharded_run(gpt_spec: str,
                                                                                tmp_path: Path) -> None:
    spec = scaled_down(gpt_spec, seq_len=SEQ)
    # FSDP2 reduce-scatters after each micro-batch, so the sums round in another order than the
    # unsharded run's; Adam would turn that noise on the key bias (whose gradient is exactly zero)
    # into lr-sized steps, so the weights are compared under SGD with momentum (its state sharded too)
    sgd = {"optimizer": "sgd_momentum"}
    runs, sharded = _run(spec, _two_stages(3), tmp_path / "zero3", steps=2, extra=sgd)
    # the first backward's gradients (dumped before any optimizer step): FSDP2's summed shards, gathered
    _grads_match(spec, _two_stages(3), runs, sharded)
    unsharded_runs, unsharded = _run(spec, _two_stages(0), tmp_path / "zero0", steps=2, extra=sgd)
    _assert_close(_params(sharded), _params(unsharded))
    params = _params(sharded)  # the tied table (stage 0, sharded) and the head's copy took the same steps
    torch.testing.assert_close(params["layers.0.wte.weight"], params["layers.3.lm_head.weight"])
    whole = {r.rank: r.lines[-1]["param_elements"] for r in unsharded_runs}
    held = {r.rank: [line["param_elements"] for line in r.lines] for r in runs}
    stage0 = whole[0]
    assert whole[1] == stage0 and held[2] == [whole[2]] * 2  # stage 1 (dp 1) stays whole
    for rank in (0, 1):  # each dp rank of stage 0 holds about half of its weights, after every step
        assert all(abs(n / stage0 - 0.5) < 0.05 for n in held[rank]), (held, stage0)
    assert held[0][-1] + held[1][-1] == stage0


@pytest.mark.slow
def test_zero3_over_a_dp_by_tp_mesh_equals_the_unsharded_step(gpt_spec: str, tmp_path: Path) -> None:
    spec = scaled_down(gpt_spec, seq_len=SEQ)

    def plan(zero: int) -> Plan:  # uneven shares: the pipeline runtime; FSDP2 on the "dp" axis of (dp, tp)
        return Plan(micro_batches=2, stages=(_stage((0, 4), (0, 1, 2, 3), dp=2, tp=2, zero=zero,
                                                    batch_samples=(3, 1)),))

    sgd = {"optimizer": "sgd_momentum"}  # see the test above
    sharded_runs, sharded = _run(spec, plan(3), tmp_path / "zero3", steps=2, extra=sgd)
    _grads_match(spec, plan(3), sharded_runs, sharded)  # the first backward's, before any step
    unsharded_runs, unsharded = _run(spec, plan(0), tmp_path / "zero0", steps=2, extra=sgd)
    _assert_close(_params(sharded), _params(unsharded))
    whole = {r.rank: r.lines[-1]["param_elements"] for r in unsharded_runs}  # this rank's tp pieces
    held = {r.rank: r.lines[-1]["param_elements"] for r in sharded_runs}
    assert all(abs(held[r] / whole[r] - 0.5) < 0.05 for r in range(4)), (held, whole)
