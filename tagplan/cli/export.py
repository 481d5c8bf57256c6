"""`tagplan export` and `tagplan verify`: a plan as a program, and proof that it runs as planned.

Both read the model SPEC with the frontends' grammar (`parse_model_spec`) before anything else;
`export` builds `--cluster` with the shared cluster options (`ClusterOptions`) and writes the
gradient reduction the plan was costed with (`--grad-reduce-dtype`, `--no-grad-reduce-overlap`, as
`plan` and `simulate` take them); `verify` resolves `--calibration` as every command does and
measures this CPU (one core per rank) for its prediction. Both print a summary for people, or JSON
with `--json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tagplan.cli.options import (
    Subparsers,
    add_calibration_option,
    add_cluster_options,
    add_dtype_option,
    add_grad_reduce_options,
    add_json_option,
    emit,
    load_calibration_option,
    load_cluster_option,
    positive_float,
    positive_int,
    workload_of,
)
from tagplan.errors import SpecError
from tagplan.ir.workload import DEFAULT_GLOBAL_BATCH, DType, LossKernel, Optimizer

if TYPE_CHECKING:
    from tagplan.frontends.model_spec import ModelSpec
    from tagplan.frontends.plan_file import SearchedFor
    from tagplan.ir.cluster import Cluster, DeviceSpec
    from tagplan.ir.plan import Plan


def add_export_commands(sub: Subparsers) -> None:
    """Add `export` and `verify` to the `tagplan` parser."""
    exp = sub.add_parser("export", help="write a plan as a torch program, Megatron-LM arguments or a DeepSpeed config")
    exp.add_argument("--model", required=True, help="model SPEC")
    exp.add_argument("--cluster", default=None, help="cluster SPEC (checked against the plan's devices; each format's "
                                                     "launch takes its nodes, in the plan's rank order, and GPU types)")
    add_cluster_options(exp)
    exp.add_argument("--plan", required=True, help="a Plan JSON file")
    exp.add_argument("--format", choices=["torch", "megatron", "deepspeed"], default="torch", dest="fmt")
    exp.add_argument("--batch", type=positive_int, default=None,
                     help="global batch in samples, as the plan was searched for (default: what the plan file says "
                          f"it was searched for, else {DEFAULT_GLOBAL_BATCH})")
    exp.add_argument("--seq", type=positive_int, default=None,
                     help="tokens per sample (default: what the plan file says it was searched for, else the model's)")
    add_dtype_option(exp)
    exp.add_argument("--optimizer", choices=[o.value for o in Optimizer], default=Optimizer.ADAM.value,
                     help="the optimizer the plan was costed with (torch program)")
    add_grad_reduce_options(exp, costed=True)
    exp.add_argument("--tp-comm-overlap", action="store_true",
                     help="the plan was costed with tensor-parallel collectives overlapped (plan --tp-comm-overlap): "
                          "Megatron-LM writes --tp-comm-overlap; the torch program runs them exposed (noted: slower "
                          "than predicted)")
    exp.add_argument("--loss", choices=[k.value for k in LossKernel], default=LossKernel.EAGER.value,
                     help="the cross-entropy the plan was costed with (plan --loss): fused makes Megatron-LM write "
                          "Transformer Engine's fused loss and the torch program run its own; otherwise Megatron-LM "
                          "runs Megatron-Core's (in-place), the torch program and DeepSpeed PyTorch's eager one "
                          "(noted where the run keeps more than was costed)")
    exp.add_argument("--out", required=True, help="directory to write")
    add_json_option(exp, "the format, the files written and the gradient reduction written")
    exp.set_defaults(func=_export)

    ver = sub.add_parser("verify", help="run the exported plan on CPU (gloo) on a scaled-down model and check it "
                                        "against a one-process reference")
    ver.add_argument("--model", required=True, help="model SPEC: a family or zoo name and hf: SPECs run scaled down "
                                                    "(same class and layer count); a user's nn.Sequential runs as "
                                                    "its factory builds it")
    ver.add_argument("--plan", required=True, help="a Plan JSON file")
    ver.add_argument("--procs", type=positive_int, default=None, help="local processes (default: the plan's devices)")
    ver.add_argument("--timeout-s", type=positive_float, default=300.0,
                     help="time limit of the run in seconds (default 300); a plan of many ranks on few cores needs "
                          "more (32 ranks on 2 cores take about 3 minutes a step)")
    ver.add_argument("--loss", choices=[LossKernel.EAGER.value, LossKernel.FUSED.value],
                     default=LossKernel.EAGER.value,
                     help="the program's cross-entropy: eager (PyTorch's) or fused (the program's own, as export "
                          "--loss fused writes it); the reference runs the eager one")
    add_calibration_option(ver, "the one pinned beside the active GNN version, else the shipped defaults; "
                                "for the predicted step time")
    add_json_option(ver, "the verification report")
    ver.set_defaults(func=_verify)

    mea = sub.add_parser("measure", help="run a plan's torch program on local processes (gloo on CPUs, or one GPU "
                                         "per rank over NCCL) and append its measured step time to a trace bundle "
                                         "as an iteration record")
    mea.add_argument("--model", required=True, help="model SPEC (run as given: keep it small on CPU)")
    mea.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                     help="cpu: one gloo process per plan device, one torch thread each; cuda: one process per "
                          "plan device on this host's GPUs 0..N-1")
    mea.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                     help="compute dtype (bf16/fp16: autocast over fp32 weights); default fp32 on cpu, bf16 on cuda")
    mea.add_argument("--plan", required=True, help="a Plan JSON file")
    mea.add_argument("--batch", type=positive_int, default=None,
                     help=f"global batch in samples (default: the plan file's searched_for, else "
                          f"{DEFAULT_GLOBAL_BATCH})")
    mea.add_argument("--seq", type=positive_int, default=None,
                     help="tokens per sample (default: the plan file's searched_for; required otherwise)")
    mea.add_argument("--steps", type=positive_int, default=5, help="timed steps (their median is recorded)")
    mea.add_argument("--warmup", type=int, default=2, help="steps run first and discarded")
    mea.add_argument("--optimizer", choices=[o.value for o in Optimizer], default=Optimizer.ADAM.value)
    mea.add_argument("--out", required=True, metavar="BUNDLE", help="trace bundle (created, or appended to)")
    add_json_option(mea, "the record written")
    mea.set_defaults(func=_measure)


def _plan_file(args: argparse.Namespace) -> tuple[Plan, SearchedFor | None]:
    """(the plan `--plan` holds, what it was searched for); `args.batch` and `args.seq` set to what it was searched
    for where not given (SpecError where given otherwise), the batch else the default."""
    from tagplan.frontends.plan_file import load_plan_file, searched_workload

    plan, searched = load_plan_file(args.plan)
    batch, args.seq = searched_workload(args.batch, args.seq, searched, args.plan)
    args.batch = batch or DEFAULT_GLOBAL_BATCH
    return plan, searched


def _export(args: argparse.Namespace) -> int:
    from tagplan.export.dispatch import export, grad_reduce_settings, loss_settings, tp_comm_settings
    from tagplan.frontends.model_spec import parse_model_spec

    spec = parse_model_spec(args.model)
    plan, searched = _plan_file(args)
    if args.grad_reduce_dtype is None and searched is not None and searched.grad_reduce_dtype is DType.FP32:
        # costed reducing in fp32 (plan --exportable): every format runs that, so it is the plan's as costed; a
        # 16-bit one is the training dtype's, the default, which a format may refuse by name (the torch program)
        args.grad_reduce_dtype = DType.FP32.value
    cluster = load_cluster_option(args.cluster, args) if args.cluster else None
    dtype = DType(args.dtype)
    reduce_dtype = DType(args.grad_reduce_dtype) if args.grad_reduce_dtype else None
    written = export(spec, plan, Path(args.out), fmt=args.fmt, seq_len=args.seq, global_batch=args.batch,
                     cluster=cluster, dtype=dtype, optimizer=Optimizer(args.optimizer),
                     grad_reduce_dtype=reduce_dtype, grad_reduce_overlap=args.grad_reduce_overlap,
                     tp_comm_overlap=args.tp_comm_overlap, loss=LossKernel(args.loss))
    reduce = grad_reduce_settings(plan, fmt=args.fmt, dtype=dtype, cluster=cluster, grad_reduce_dtype=reduce_dtype,
                                  grad_reduce_overlap=args.grad_reduce_overlap)
    tp_comm = tp_comm_settings(plan, fmt=args.fmt, tp_comm_overlap=args.tp_comm_overlap)
    loss = loss_settings(fmt=args.fmt, loss=LossKernel(args.loss))
    memory = _memory_note(args, spec, plan, cluster) if cluster is not None else None
    tensor_cores = _tensor_core_note(plan, cluster, dtype) if cluster is not None else None
    emit({"format": args.fmt, "files": [str(p) for p in written], "grad_reduce": reduce.as_json(), "tp_comm": tp_comm,
          "loss": loss, "memory": memory, "tensor_cores": tensor_cores}, args.json, _export_text)
    return 0


def _tensor_core_note(plan: Plan, cluster: Cluster, dtype: DType) -> str | None:
    """Where the plan's GPUs lack `dtype`'s tensor cores (V100 and T4 in bf16): the plan was costed at the format
    they have (`DeviceSpec.costed_format`), which the exported run in `dtype` does not reach there. None where
    every GPU has them (a quantized dtype without them is refused by the exporters themselves)."""
    lacking = sorted({cluster.devices[d].spec.name for d in plan.devices
                      if not cluster.devices[d].spec.has_tensor_cores_for(dtype)})
    if not lacking or dtype.quantized:
        return None
    costed = cluster.devices[next(d for d in plan.devices
                                  if cluster.devices[d].spec.name == lacking[0])].spec.costed_format(dtype).value
    return (f"{', '.join(lacking)}: no {dtype.value} tensor cores; this export computes {dtype.value} there without "
            f"them, slower than the plan's figure (costed at the {costed} rate): export with --dtype {costed} for "
            "the run the plan describes")


def _memory_note(args: argparse.Namespace, spec: ModelSpec, plan: Plan, cluster: Cluster) -> str | None:
    """Why the exported runtime will run out of memory on the plan (None: it fits), costed as `plan --exportable`
    costs it (`options.workload_of`, `capability.runtime_workload`): the plan may have been searched for another
    runtime."""
    from tagplan.cost.simulator import Simulator
    from tagplan.export.capability import memory_refusal, runtime_workload
    from tagplan.frontends.model_spec import build_model

    model = build_model(spec, seq_len=args.seq, dtype=DType(args.dtype))
    sim = Simulator(model, cluster, runtime_workload(args.fmt, workload_of(args, model), spec))
    why = memory_refusal(plan, args.fmt, sim)
    return None if why is None else f"{why}: the run will run out of memory (`plan --exportable {args.fmt}` " \
                                    "searches plans this runtime fits)"


def _export_text(result: dict[str, Any]) -> str:
    lines = [f"wrote the {result['format']} export:", *(f"  {f}" for f in result["files"])]
    scripts = [f for f in result["files"] if Path(f).name.startswith("launch_node")]
    if len(scripts) > 1:
        lines.append(f"start {Path(scripts[0]).name} on the node that runs stage 0 (MASTER_ADDR), then the others")
    tp_comm = result["tp_comm"]
    overlap = ["tensor-parallel collectives: overlapped with compute (--tp-comm-overlap written)"] \
        if tp_comm["overlapped"] else []
    loss = result["loss"]
    written = ("Transformer Engine's fused kernel (--cross-entropy-loss-fusion --cross-entropy-fusion-impl te written)"
               if result["format"] == "megatron" else "the program's fused cross-entropy (the 16-bit logits kept)")
    fused = [f"cross-entropy: {written}"] if loss["fused_written"] else []
    memory = [f"warning: {result[key]}" for key in ("memory", "tensor_cores") if result.get(key)]
    return "\n".join(lines + _reduce_lines(result["grad_reduce"]) + overlap + fused
                     + [f"note: {n}" for n in tp_comm["notes"] + loss["notes"]] + memory)


def _reduce_lines(reduce: dict[str, Any]) -> list[str]:
    """The gradient reduction as written: dtype, overlap, the settings, the notes."""
    when = {None: "no data-parallel stage, nothing to reduce", True: "overlapped with the backward",
            False: "after the backward"}[reduce["overlap"]]
    written = ", ".join(reduce["written"]) or "nothing (the runtime's own behaviour)"
    return [f"gradient reduction: {reduce['dtype']}, {when}; written: {written}",
            *(f"note: {n}" for n in reduce["notes"])]


def _verify(args: argparse.Namespace) -> int:
    from tagplan.export.verify import predicted_vs_measured, verify
    from tagplan.frontends.model_spec import parse_model_spec
    from tagplan.frontends.plan_file import load_plan
    from tagplan.profiling.device import cpu_device_spec

    spec = parse_model_spec(args.model)
    calibration = load_calibration_option(args)
    plan = load_plan(args.plan)
    report = verify(spec, plan, procs=args.procs, timeout_s=args.timeout_s, loss=LossKernel(args.loss))
    out = {k: v for k, v in dataclasses.asdict(report).items() if k != "plan"}
    if report.passed:
        try:  # each rank ran one torch thread: the device is this CPU with one core
            comparison = predicted_vs_measured(report, cpu_device_spec(cores=1), calibration=calibration)
            out["predicted_vs_measured"] = dataclasses.asdict(comparison)
        except (SpecError, ValueError) as err:
            out["predicted_vs_measured"] = {"error": str(err)}
    emit(out, args.json, _verify_text)
    if not report.passed:
        print(f"tagplan verify: FAILED: {report.message}", file=sys.stderr)
        return 1
    return 0


def _verify_text(out: dict[str, Any]) -> str:
    verdict = "PASSED" if out["passed"] else "FAILED"
    loss = "none" if out["loss"] is None else f"{out['loss']:.6g}"
    lines = [f"verify {verdict}: {out['message']}",
             f"  loss {loss} vs one-process reference {out['reference_loss']:.6g}; max |error| "
             f"{out['max_abs_error']:.3g}, max relative {out['max_rel_error']:.3g} (worst: {out['worst_parameter']})"]
    for rank, seconds in sorted(out["step_time_s"].items()):
        lines.append(f"  rank {rank} (stages {out['rank_stages'].get(rank, ())}): {seconds * 1e3:.1f} ms per step")
    pvm = out.get("predicted_vs_measured", {})
    if "ratio" in pvm:
        lines.append(f"  measured {pvm['measured_s'] * 1e3:.1f} ms vs predicted {pvm['predicted_s'] * 1e3:.1f} ms "
                     f"(ratio {pvm['ratio']:.2f})")
    elif "error" in pvm:
        lines.append(f"  no prediction: {pvm['error']}")
    return "\n".join(lines)


def _cuda_host(ranks: int) -> DeviceSpec:
    """This host's GPU as the catalog knows it; SpecError unless torch sees `ranks` GPUs of one kind."""
    import torch

    from tagplan.profiling.device import cuda_device_spec

    spec = cuda_device_spec()  # SpecError naming the torch build when it sees no GPU
    count = torch.cuda.device_count()
    if count < ranks:
        raise SpecError(f"--device cuda: the plan has {ranks} devices and this host {count} GPUs; run a plan of at "
                        f"most {count} devices here, or launch it with the exported program's own launcher")
    names = {torch.cuda.get_device_name(i) for i in range(ranks)}
    if len(names) > 1:
        raise SpecError(f"--device cuda: GPUs 0..{ranks - 1} are of {len(names)} kinds ({', '.join(sorted(names))}); "
                        "one record describes one kind of GPU")
    return spec


def _measure(args: argparse.Namespace) -> int:
    from tagplan.datasets.traces.bundle import (
        MANIFEST_FILE,
        IterationRecord,
        Manifest,
        append_records,
        now_iso,
        write_bundle,
    )
    from tagplan.export.capability import runtime_workload
    from tagplan.export.measure import measure
    from tagplan.export.torch_program import reduce_overlaps, runtime_on
    from tagplan.frontends.cpu import cpu_cluster, gpu_cluster
    from tagplan.frontends.model_spec import parse_model_spec
    from tagplan.ir.workload import Workload
    from tagplan.profiling.device import cpu_device_spec, fingerprint

    spec = parse_model_spec(args.model)
    plan, _ = _plan_file(args)
    if args.seq is None:
        raise SpecError(f"--seq: {args.plan} does not say what it was searched for; give the tokens per sample")
    optimizer = Optimizer(args.optimizer)
    cuda = args.device == "cuda"
    dtype = DType(args.dtype or ("bf16" if cuda else "fp32"))
    if cuda:
        device = _cuda_host(len(plan.devices))
    elif dtype is not DType.FP32:
        raise SpecError(f"--dtype {dtype.value!r} with --device cpu: the CPU program runs in fp32; accepted: fp32, "
                        "or bf16/fp16 with --device cuda")
    else:
        device = cpu_device_spec(cores=1)  # each rank runs one torch thread
    result = measure(spec, plan, seq_len=args.seq, global_batch=args.batch, steps=args.steps, warmup=args.warmup,
                     optimizer=optimizer, dtype=dtype, device=args.device)
    local = plan.model_copy(update={"stages": tuple(s.model_copy(update={"devices": tuple(
        plan.devices.index(d) for d in s.devices)}) for s in plan.stages)})  # ranks 0..N-1 in plan order
    # the program's own rule: its pipelines reduce after the flush (only ZeRO-3 stages, which the
    # model costs per layer whatever the flag says, overlap there), so one flag describes the run
    overlaps = reduce_overlaps(local, runtime_on(local, None))
    workload = Workload(global_batch=args.batch, seq_len=args.seq, dtype=dtype, optimizer=optimizer,
                        grad_reduce_overlap=all(overlaps.values()), eager=True)  # modules run op by op
    if cuda:  # as the program runs it under autocast: fp32 gradient reduction, its own fused SwiGLU
        workload = runtime_workload("torch", workload, spec)
    where = f"NCCL, {len(plan.devices)} GPUs ({device.name})" if cuda else f"gloo, {len(plan.devices)} processes"
    record = IterationRecord(model=spec.text, cluster=(gpu_cluster if cuda else cpu_cluster)(device, len(plan.devices)),
                             workload=workload, plan=local.model_dump(mode="json"), measured_s=result.median_s,
                             repeats=result.steps, peak_memory_bytes=result.peak_memory_bytes,
                             source=f"tagplan measure ({where}, {dtype.value}; steps "
                                    f"{result.min_s:.4g}-{result.max_s:.4g} s)")
    out = Path(args.out)
    if (out / MANIFEST_FILE).is_file():
        total = append_records(out, [record])
    else:
        manifest = Manifest(created=now_iso(), source="tagplan measure", fingerprint=fingerprint(args.device),
                            device=device, notes="measured iterations of exported plans on local "
                                                 + ("GPUs (NCCL)" if cuda else "gloo processes"))
        write_bundle(out, manifest, [record])
        total = 1
    emit({"record": record.model_dump(mode="json"), "bundle": str(out), "records": total}, args.json,
         lambda r: f"{r['bundle']}: {r['record']['measured_s']:.4f} s per iteration ({r['records']} records)")
    return 0
