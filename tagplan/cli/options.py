"""What every `tagplan` command shares: exit codes, argument types, output, and the problem options.

The model, cluster and workload options are defined here once, for every command that takes
them (`inspect cluster`, `simulate`, `plan`; `export` and `service` may adopt them), with the one
function that turns each group into what the core takes: `cluster_options` -> `ClusterOptions`,
`load_problem` -> (ModelGraph, Cluster, Workload). This module imports no other `tagplan.cli` module.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from tagplan.errors import SpecError
from tagplan.ir.workload import (
    EAGER_RUNTIME_TEXT,
    LOSS_KERNEL_TEXT,
    REDUCE_DTYPES,
    DType,
    EagerRuntime,
    LossKernel,
    Optimizer,
    Workload,
    eager_dtype_refusal,
    eager_fields,
)
from tagplan.search.problem import DEFAULT_GLOBAL_BATCH

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from tagplan.cost.calibration import Calibration
    from tagplan.frontends.cluster_spec import ClusterOptions
    from tagplan.ir.cluster import Cluster
    from tagplan.ir.model import ModelGraph

EXIT_BAD_INPUT = 2
EXIT_INFEASIBLE = 1  # `plan`: no plan (--exportable: none the format runs) fits in memory, unless --allow-infeasible
"""The exit code of bad input (a SpecError, or arguments argparse refuses)."""

Subparsers = argparse._SubParsersAction
"""What `add_subparsers` returns; each command group adds its commands to it."""

ATTENTION_KERNELS: dict[str, bool | None] = {"auto": None, "fused": True, "unfused": False}
"""`--attention` -> `Workload.fused_attention`."""


def output_file(text: str) -> str:
    """argparse type: a file this command may write (its folder exists; it is not a folder), checked before the
    command's work, so that a search is not thrown away for a mistyped path."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name in it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(path.parent)!r} does not exist")
    return text


def positive_int(text: str) -> int:
    """argparse type: a whole number above zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: a whole number, zero or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be 0 or more")
    return value


def folds_count(text: str) -> int:
    """argparse type: cross-validation folds, at least 2 (one fold holds nothing out)."""
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value}: cross-validation needs at least 2 folds")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def console() -> Console:
    """Rich's console on stdout; piped output gets a wide page rather than rich's 80-column default."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def add_json_option(parser: argparse.ArgumentParser, what: str = "the result") -> None:
    """`--json`: print `what` as JSON on stdout instead of a table for people."""
    parser.add_argument("--json", action="store_true", help=f"{what} as JSON on stdout (for tools)")


def emit(result: Any, as_json: bool, render: Callable[[Any], RenderableType]) -> None:
    """Print `result` as JSON (a dict or a pydantic model) or as `render(result)` for people."""
    if as_json:
        text = result.model_dump_json(indent=2) if isinstance(result, BaseModel) else json.dumps(result, indent=2)
        sys.stdout.write(text + "\n")
        return
    rendered = render(result)
    if isinstance(rendered, str):  # plain text: paths and sources may hold brackets rich would read as markup
        from rich.text import Text

        rendered = Text(rendered)
    console().print(rendered)


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """The options that complete a cluster SPEC (`frontends.cluster_spec.ClusterOptions`)."""
    group = parser.add_argument_group("cluster options", "defaults for every preset term; what a topology file "
                                                         "leaves out")
    group.add_argument("--nodes", type=positive_int, default=None, help="nodes, for one-node topology files")
    group.add_argument("--gpu", default=None, help="GPU type, for topology files that do not name it")
    group.add_argument("--nics", type=positive_int, default=None, help="NICs per node")
    group.add_argument("--nic-gbps", type=positive_float, default=None, help="NIC speed in Gb/s")
    group.add_argument("--network-latency-us", type=float, default=None,
                       help="one-way latency between nodes in microseconds (default: by NIC class)")
    group.add_argument("--nccl-tests", action="append", default=None, metavar="LOG",
                       help="nccl-tests output whose measured bandwidth replaces the catalog's (repeatable)")


def cluster_options(args: argparse.Namespace) -> ClusterOptions:
    """The ClusterOptions the flags `add_cluster_options` defines ask for."""
    from tagplan.frontends.cluster_spec import ClusterOptions

    return ClusterOptions(nodes=args.nodes, gpu=args.gpu, nic_speed_Gbps=args.nic_gbps, nics=args.nics,
                          network_latency_us=args.network_latency_us, nccl_tests=tuple(args.nccl_tests or ()))


def load_cluster_option(spec: str, args: argparse.Namespace) -> Cluster:
    """The Cluster a SPEC names, completed by the cluster options in `args`."""
    from tagplan.frontends.cluster_spec import load_cluster

    return load_cluster(spec, cluster_options(args))


def add_dtype_option(parser: argparse.ArgumentParser) -> None:
    """`--dtype`: the training precision (and the peak FLOP/s a cluster is shown with)."""
    parser.add_argument("--dtype", choices=[d.value for d in DType], default=DType.BF16.value)


def add_input_shape_option(parser: argparse.ArgumentParser) -> None:
    """`--input-shape`: the example input of a user module (`path/file.py:Name`), e.g. 8x512:long."""
    parser.add_argument("--input-shape", default=None, metavar="BxS[x...][:long]",
                        help="user modules: trace on zeros of this shape instead of the module's example inputs "
                             "(dtype float, or :long/:int/:bool)")


def add_calibration_option(parser: argparse.ArgumentParser, default_help: str) -> None:
    """`--calibration`: a calibration file or a registry version with one pinned."""
    parser.add_argument("--calibration", default=None, metavar="CALIB.json|VERSION",
                        help="cost-model calibration from `tagplan calibrate`, or a registry version with one "
                             f"pinned (default: {default_help})")


def load_calibration_option(args: argparse.Namespace) -> Calibration:
    """The calibration `--calibration` names (`training.calibrations.resolve_calibration`)."""
    from tagplan.training.calibrations import resolve_calibration
    from tagplan.training.registry import Registry

    return resolve_calibration(args.calibration, Registry(), allow_paths=True)


def add_problem_options(parser: argparse.ArgumentParser) -> None:
    """--model, --cluster (with the cluster options), the workload and the calibration options."""
    parser.add_argument("--model", required=True, help="model SPEC")
    parser.add_argument("--cluster", required=True, help="cluster SPEC")
    add_cluster_options(parser)
    parser.add_argument("--batch", type=positive_int, default=None,
                        help=f"global batch in samples (default {DEFAULT_GLOBAL_BATCH}; simulate: what the plan file "
                             "says it was searched for)")
    parser.add_argument("--seq", type=positive_int, default=None, help="tokens per sample (default: the model's)")
    add_input_shape_option(parser)
    add_dtype_option(parser)
    parser.add_argument("--optimizer", choices=[o.value for o in Optimizer], default=Optimizer.ADAM.value)
    add_grad_reduce_options(parser)
    parser.add_argument("--tp-comm-overlap", action="store_true",
                        help="the runtime runs tensor-parallel collectives in chunks under the GEMMs (Megatron-Core's "
                             "--tp-comm-overlap with Transformer Engine); default: every TP collective exposed")
    parser.add_argument("--attention", choices=list(ATTENTION_KERNELS), default="auto",
                        help="the runtime's attention kernel: auto = FlashAttention-2 where the GPU has it (sm80 and "
                             "later), scores materialised before; fused = a fused kernel on every device (PyTorch's "
                             "scaled_dot_product_attention); unfused = scores materialised everywhere (runtimes before "
                             "FlashAttention, e.g. Megatron-LM of 2021, and eager attention)")
    parser.add_argument("--loss", choices=[k.value for k in LossKernel], default=None,
                        help="the runtime's cross-entropy, which sets the memory of the stage holding the head: "
                             + "; ".join(f"{k.value} = {LOSS_KERNEL_TEXT[k]}" for k in LossKernel)
                             + " (default eager)")
    parser.add_argument("--eager", choices=[r.value for r in EagerRuntime], default=None,
                        help="the runtime runs the model op by op as eager PyTorch: the host issues every kernel and "
                             "the unfused kernels move more memory than fused ones; "
                             + "; ".join(f"{r.value} = {EAGER_RUNTIME_TEXT[r]}" for r in EagerRuntime)
                             + " (default: fused kernels, as Megatron-Core and Transformer Engine run)")
    add_calibration_option(parser, "the one pinned beside the active GNN version, else the shipped defaults")


def add_grad_reduce_options(parser: argparse.ArgumentParser, *, costed: bool = False) -> None:
    """`--grad-reduce-dtype` and `--no-grad-reduce-overlap` (dest `grad_reduce_overlap`): how the
    runtime reduces data-parallel gradients (`costed`: as the plan being exported was costed)."""
    said = ", as the plan was costed" if costed else ""
    parser.add_argument("--grad-reduce-dtype", choices=[d.value for d in REDUCE_DTYPES], default=None,
                        help=f"dtype gradients cross the data-parallel group in{said} (default: the training dtype; "
                             "fp32 as DeepSpeed's fp32_allreduce or Megatron's --accumulate-allreduce-grads-in-fp32)")
    parser.add_argument("--no-grad-reduce-overlap", dest="grad_reduce_overlap", action="store_false",
                        help=f"the runtime reduces gradients after the backward instead of overlapping it{said} "
                             "(DeepSpeed's pipeline engine, DeepSpeed without ZeRO, Megatron-LM before Megatron-Core)")


def load_problem(args: argparse.Namespace) -> tuple[ModelGraph, Cluster, Workload]:
    """(ModelGraph, Cluster, Workload) from the options `add_problem_options` defines."""
    from tagplan.frontends.model_spec import load_model

    model = load_model(args.model, seq_len=args.seq, dtype=DType(args.dtype),
                       input_shape=getattr(args, "input_shape", None))
    return model, load_cluster_option(args.cluster, args), workload_of(args, model)


def workload_of(args: argparse.Namespace, model: ModelGraph) -> Workload:
    """The Workload the workload options describe (those a command lacks take their defaults), at `model`'s
    sequence length: what `plan` and `simulate` cost, and `export` checks memory with."""
    dtype = DType(args.dtype)
    reduce = getattr(args, "grad_reduce_dtype", None)
    eager = EagerRuntime(args.eager) if getattr(args, "eager", None) else None
    refusal = eager_dtype_refusal(eager, dtype)
    if refusal:
        raise SpecError(f"--eager {args.eager} with --dtype {dtype.value}: {refusal}")
    return Workload(global_batch=args.batch or DEFAULT_GLOBAL_BATCH, seq_len=model.seq_len, dtype=dtype,
                    optimizer=Optimizer(args.optimizer), grad_reduce_dtype=DType(reduce) if reduce else None,
                    grad_reduce_overlap=getattr(args, "grad_reduce_overlap", True),
                    tp_comm_overlap=getattr(args, "tp_comm_overlap", False),
                    fused_attention=ATTENTION_KERNELS[getattr(args, "attention", "auto")],
                    loss=LossKernel(getattr(args, "loss", None) or LossKernel.EAGER.value),
                    **eager_fields(eager))
