"""Verify an exported program by running it: one step's gradients against a single process.

`verify` scales the model down (same family, same layer count, so the plan's stage boundaries
still hold), writes the program into a temporary folder, runs it on N local CPU processes over
gloo in `--verify` mode, and compares the loss and every parameter's full gradient after the
first backward with a plain single-process model (same seed, same synthetic batch, the same
split into replicas and micro-batches, the same gradient averaging).

Tolerance (fp32): an element passes when |program - reference| <= atol + rtol * |reference|,
with rtol = 1e-4 and atol = 1e-6 by default. Only the order of floating-point sums differs
between a correct program and the reference (tensor-parallel partial sums, replica averaging,
micro-batch accumulation). On the scaled-down gpt and llama models, measured over TP x DP, PP,
FSDP + TP, interleaved and recompute plans: at most ~1e-6 relative to a parameter's largest
gradient and 3e-8 absolute, i.e. every element within 1/40 of its bound. Gradients here are
1e-4..1e-1, so atol covers only elements that are zero up to rounding (k's bias, whose true
gradient is 0). A wrong split (a bias added twice, a missing reduction) errs by O(1).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tagplan.cost.calibration import DEFAULT_CALIBRATION, Calibration
from tagplan.cost.simulator import Simulator
from tagplan.export.capability import reduce_overlap
from tagplan.export.checks import ExportError
from tagplan.export.modules import build_model as build_torch_model
from tagplan.export.modules import grads_by_layer
from tagplan.export.runtime_launch import RankRun, launch
from tagplan.export.runtime_loss import eager_loss
from tagplan.export.runtime_train import synthetic_batch
from tagplan.export.shapes import ModelConfig, model_config, parsed, scaled_down
from tagplan.export.torch_checks import check_expressible, torch_config
from tagplan.export.torch_program import write_torch_program
from tagplan.frontends.cpu import build_cpu_cluster
from tagplan.frontends.model_spec import ModelSpec, build_model, load_model
from tagplan.ir.cluster import DeviceSpec
from tagplan.ir.plan import Plan, check_whole_samples
from tagplan.ir.workload import DType, LossKernel, Optimizer, Workload

RTOL, ATOL = 1e-4, 1e-6
SEED = 0


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of one verification run. Errors are absolute gradient units; times are seconds."""

    passed: bool
    max_abs_error: float  # largest |program - reference| over all gradient elements (inf: no gradients)
    max_rel_error: float  # largest per-parameter max|error| / max|reference| (parameters with max|reference| > atol)
    worst_parameter: str  # parameter (or "loss", or the failing op) furthest outside the tolerance
    loss: float | None
    reference_loss: float
    step_time_s: dict[int, float]  # rank -> median seconds per training step (after the first step)
    message: str
    rank_stages: dict[int, tuple[int, ...]] = field(default_factory=dict)  # rank -> plan stages it ran
    model_spec: str = ""  # the scaled-down SPEC that ran
    seq_len: int = 0
    global_batch: int = 0
    plan: Plan | None = None


def verify(model_spec: str | ModelSpec, plan: Plan, *, procs: int | None = None, seq_len: int = 16,
           global_batch: int | None = None, atol: float = ATOL, rtol: float = RTOL, steps: int = 3,
           timeout_s: float = 300.0, keep_dir: Path | None = None,
           loss: LossKernel = LossKernel.EAGER) -> VerifyReport:
    """Run `plan` for `model_spec` scaled down on local processes and compare with one process.

    `procs` caps the processes this machine may run (default: the plan's device count); a plan
    needing more raises ExportError, as does one the program cannot express. `global_batch`
    defaults to 2 samples per replica and micro-batch. `keep_dir` keeps the program and its logs. `loss`: the
    program's cross-entropy (`export.runtime_loss`; the reference runs PyTorch's eager one).
    """
    spec = parsed(model_spec)
    check_expressible(plan, build_model(spec), config=torch_config(spec, seq_len=seq_len))
    world = len(plan.devices)
    if procs is not None and world > procs:
        raise ExportError(f"the plan runs on {world} devices; verify may start at most procs={procs} processes")
    batch = global_batch or default_batch(plan)
    whole = model_config(spec, seq_len=1)
    small = scaled_down(spec, seq_len=seq_len, heads=_heads_for(whole, plan), vocab=_vocab_for(whole, plan))
    with tempfile.TemporaryDirectory(prefix="tagplan-verify-") as tmp:
        folder = keep_dir or Path(tmp)
        program = write_torch_program(small, plan, folder, seq_len=seq_len, global_batch=batch, steps=steps,
                                      seed=SEED, loss=loss)
        dump = folder / "verify"
        shutil.rmtree(dump, ignore_errors=True)  # a kept folder may hold an earlier run's files
        dump.mkdir()
        runs = launch(program, world, ["--verify", str(dump), "--timeout-s", str(min(timeout_s, 120.0))],
                      timeout_s=timeout_s)
        ref_loss, ref_grads = reference(small, seq_len=seq_len, global_batch=batch, micro_batches=plan.micro_batches)
        report = _compare(dump, runs, ref_loss, ref_grads, atol=atol, rtol=rtol)
    return replace(report, model_spec=small, seq_len=seq_len, global_batch=batch, plan=plan)


def _heads_for(config: ModelConfig, plan: Plan) -> int:
    """Heads of the scaled-down model: 4, or more so that tp divides heads and kv heads."""
    tp = max(s.tp for s in plan.stages)
    gqa = config.kv_heads < config.heads
    return math.lcm(4, tp * (2 if gqa else 1))


def _vocab_for(config: ModelConfig, plan: Plan) -> int:
    """Tokens of the scaled-down model: 128, or 127 where some stage's tp does not divide the model's own
    vocabulary (GPT-2's 50,257 at tp 2), so that its uneven split of the embedding and head runs too."""
    return 128 if all(config.vocab % s.tp == 0 for s in plan.stages) else 127


def default_batch(plan: Plan) -> int:
    """The global batch `verify` runs: micro_batches x the micro-batch size every stage splits into
    whole samples (the stages' `batch_samples` sum, else the smallest multiple of 2 x each dp that does)."""
    for stage in plan.stages:
        if stage.batch_samples is not None:
            return sum(stage.batch_samples) * plan.micro_batches
    step = 2 * math.lcm(*(s.dp for s in plan.stages))
    for size in range(step, 64 * step + 1, step):
        try:
            check_whole_samples(plan, size * plan.micro_batches)
        except ValueError:
            continue
        return size * plan.micro_batches
    return step * plan.micro_batches  # the program's own check names the stage


def reference(model_spec: str, *, seq_len: int, global_batch: int, micro_batches: int,
              seed: int = SEED) -> tuple[float, dict[str, torch.Tensor]]:
    """(mean loss, gradient by parameter name) of one step of the plain model: the token mean over
    the global batch, accumulated over the plan's micro-batches."""
    model = build_torch_model(model_spec, seq_len=seq_len, seed=seed)
    tokens, labels = synthetic_batch(model_config(model_spec, seq_len=seq_len).vocab, global_batch, seq_len, step=0,
                                     seed=seed)
    losses = []
    for x, y in zip(tokens.chunk(micro_batches), labels.chunk(micro_batches), strict=True):
        loss = eager_loss(model(x), y)
        (loss * len(x) / global_batch).backward()
        losses.append(loss.item() * len(x) / global_batch)
    return math.fsum(losses), grads_by_layer(model)


def _compare(dump: Path, runs: list[RankRun], ref_loss: float, ref: dict[str, torch.Tensor], *, atol: float,
             rtol: float) -> VerifyReport:
    times = {r.rank: _median_step_s(r) for r in runs if r.lines}
    stages = {r.rank: tuple(r.lines[0]["stages"]) for r in runs if r.lines}
    failed = _failure(dump, runs)
    if failed is not None:
        worst, message = failed
        return VerifyReport(False, math.inf, math.inf, worst, None, ref_loss, times, message, stages)
    got: dict[str, torch.Tensor] = {}
    for path in sorted(dump.glob("grads_*.pt")):
        got.update(torch.load(path))
    loss = float(json.loads((dump / "loss.json").read_text())["loss"])
    return _judge(got, ref, loss, ref_loss, atol=atol, rtol=rtol, times=times, stages=stages)


def _judge(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], loss: float, ref_loss: float, *,
           atol: float, rtol: float, times: dict[int, float], stages: dict[int, tuple[int, ...]]) -> VerifyReport:
    """Compare gradients and loss element-wise against `atol + rtol * |reference|`."""
    missing = sorted(set(ref) - set(got))
    if missing:
        message = f"the program produced no gradient for {len(missing)} parameters, e.g. {missing[:3]}"
        return VerifyReport(False, math.inf, math.inf, missing[0], loss, ref_loss, times, message, stages)
    worst, worst_ratio, max_abs, max_rel = "loss", abs(loss - ref_loss) / (atol + rtol * abs(ref_loss)), 0.0, 0.0
    for name, r in ref.items():
        g = got[name]
        if g.shape != r.shape:
            return VerifyReport(False, math.inf, math.inf, name, loss, ref_loss, times,
                                f"gradient of {name} has shape {tuple(g.shape)}, expected {tuple(r.shape)}", stages)
        err = (g - r).abs()
        max_abs = max(max_abs, float(err.max()))
        if float(r.abs().max()) > atol:  # a gradient zero up to rounding (k's bias) has no relative error
            max_rel = max(max_rel, float(err.max()) / float(r.abs().max()))
        ratio = float((err / (atol + rtol * r.abs())).max())
        if ratio > worst_ratio:
            worst, worst_ratio = name, ratio
    passed = worst_ratio <= 1.0
    verdict = "within" if passed else "OUTSIDE"
    message = (f"{verdict} tolerance (rtol={rtol:g}, atol={atol:g}): worst {worst} at {worst_ratio:.3g}x the "
               f"bound; max abs error {max_abs:.3g}, max relative error {max_rel:.3g}; loss {loss:.6f} vs "
               f"reference {ref_loss:.6f}")
    return VerifyReport(passed, max_abs, max_rel, worst, loss, ref_loss, times, message, stages)


def _failure(dump: Path, runs: list[RankRun]) -> tuple[str, str] | None:
    """(worst, message) when the program did not finish: the run's time limit where it was reached (the errors
    after it are ranks losing their stopped peers), else the first error a rank recorded (the others are
    usually their peers losing it), plus any rank that died without recording one."""
    stopped = [r.rank for r in runs if r.timed_out]
    if stopped:
        done = sum(1 for r in runs if r.lines)
        return "(time limit)", (f"the program did not finish within its time limit: {len(stopped)} of {len(runs)} "
                                f"ranks were still running ({done} had reported a step) and were stopped; a plan "
                                "of this many ranks on this machine needs a longer limit (tagplan verify "
                                "--timeout-s)")
    errors = sorted((json.loads(p.read_text()) for p in dump.glob("error_rank*.json")), key=lambda e: e["time"])
    recorded = {e["rank"] for e in errors}
    silent = [r for r in runs if r.returncode != 0 and r.rank not in recorded]
    died = "".join(f"\nrank {r.rank} {_exit(r)}: {_last_line(r.stderr_tail)}" for r in silent)
    if errors:
        first = errors[0]
        return first["op"], (f"the program failed on rank {first['rank']} in {first['op']}: {first['error']} "
                             f"(no gradients to compare){died}")
    if silent or not (dump / "loss.json").exists():
        run = silent[0] if silent else runs[0]
        return "(program)", f"rank {run.rank} {_exit(run)} before the gradients were compared:\n{run.stderr_tail}"
    return None


def _exit(run: RankRun) -> str:
    return "was stopped" if run.returncode is None else f"exited with code {run.returncode}"


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _median_step_s(run: RankRun) -> float:
    times = [float(line["time_s"]) for line in run.lines]
    return statistics.median(times[1:] or times)


@dataclass(frozen=True)
class PredictedVsMeasured:
    """The simulator's iteration time for the verified run against the measured one (seconds)."""

    predicted_s: float
    measured_s: float  # slowest rank's median step time
    ratio: float  # measured / predicted


def predicted_vs_measured(report: VerifyReport, device: DeviceSpec, *,
                          calibration: Calibration = DEFAULT_CALIBRATION) -> PredictedVsMeasured:
    """Simulate the verified (scaled-down) run on a one-node cluster of `len(plan.devices)` CPU
    devices of `device` (fabric `smp`: `frontends.cpu`; fp32, Adam) and compare with its measured
    step time.

    `device`: this CPU as one rank sees it (each rank runs one torch thread; the CLI measures it
    with `tagplan.profiling.device.cpu_device_spec(cores=1)`). `calibration`: the figures to
    simulate with (the CLI resolves `--calibration`). ValueError when the report has no run.
    """
    if report.plan is None or not report.step_time_s:
        raise ValueError("the report has no plan or no measured step times (did the program run?)")
    plan = local_plan(report.plan)
    cluster = build_cpu_cluster(device, len(plan.devices))
    workload = Workload(global_batch=report.global_batch, seq_len=report.seq_len, dtype=DType.FP32,
                        optimizer=Optimizer.ADAM)
    model = load_model(report.model_spec, seq_len=report.seq_len, dtype=DType.FP32)
    predicted = Simulator(model, cluster, workload, calibration=calibration,
                          reduce_overlap=reduce_overlap("torch", workload, cluster)).simulate(plan).iteration_time_s
    measured = max(report.step_time_s.values())
    return PredictedVsMeasured(predicted, measured, measured / predicted)


def local_plan(plan: Plan) -> Plan:
    """`plan` with its devices renumbered 0..N-1 in rank order (the order the program assigns ranks)."""
    index = {d: i for i, d in enumerate(plan.devices)}
    stages = tuple(s.model_copy(update={"devices": tuple(index[d] for d in s.devices)}) for s in plan.stages)
    return plan.model_copy(update={"stages": stages})
