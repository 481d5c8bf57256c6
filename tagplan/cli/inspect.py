"""`tagplan inspect model|cluster`: a model or a cluster as tagplan sees it."""

from __future__ import annotations

import argparse

from tagplan.cli.options import (
    Subparsers,
    add_cluster_options,
    add_dtype_option,
    add_input_shape_option,
    add_json_option,
    emit,
    load_cluster_option,
    positive_int,
)
from tagplan.ir.workload import DType


def add_inspect_commands(sub: Subparsers) -> None:
    """Add `inspect model` and `inspect cluster` to the `tagplan` parser."""
    inspect = sub.add_parser("inspect", help="show a model or a cluster as tagplan sees it")
    kinds = inspect.add_subparsers(dest="what", required=True)
    model = kinds.add_parser("model", help="a model SPEC: zoo name, FAMILY?k=v, hf:ConfigClass|Architecture?k=v, "
                                           "a config.json, a graph file, or module.py:Name")
    model.add_argument("spec")
    model.add_argument("--batch", type=positive_int, default=1, help="samples (for flops_per_batch)")
    model.add_argument("--seq", type=positive_int, default=None, help="tokens per sample (default: the model's)")
    add_input_shape_option(model)
    add_dtype_option(model)
    add_json_option(model, "the summary (`ir.summary.model_summary`)")
    model.set_defaults(func=_inspect_model)
    cluster = kinds.add_parser("cluster", help="a cluster SPEC: PRESET[:nodes=N][+...] or a file")
    cluster.add_argument("spec")
    add_cluster_options(cluster)
    add_dtype_option(cluster)
    add_json_option(cluster, "the summary (`ir.summary.cluster_summary`)")
    cluster.set_defaults(func=_inspect_cluster)


def _inspect_model(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import model_table
    from tagplan.frontends.model_spec import load_model
    from tagplan.ir.summary import model_summary

    graph = load_model(args.spec, seq_len=args.seq, dtype=DType(args.dtype), input_shape=args.input_shape)
    emit(model_summary(graph, batch=args.batch), args.json, model_table)
    return 0


def _inspect_cluster(args: argparse.Namespace) -> int:
    from tagplan.cli.tables import cluster_table
    from tagplan.ir.summary import cluster_summary

    cluster = load_cluster_option(args.spec, args)
    emit(cluster_summary(cluster, dtype=DType(args.dtype)), args.json, cluster_table)
    return 0
