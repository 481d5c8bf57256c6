"""Launching an exported program on the plan's nodes: the rank table, one torchrun script per node,
and the start-up check each rank runs (no torch here).

torchrun numbers ranks node by node: node rank k's processes take the world ranks after those of
nodes 0..k-1. The plan numbers devices node-major in the cluster's order, but its stage 0 may sit
on any node, and the rendezvous host (node rank 0) should be the node that starts the pipeline.
So nodes are launched in the order their first device appears in the plan (stage 0's node first,
`runtime_layout.node_order`), and `rank_table` says, per world rank, the cluster device it runs,
its node, that node's launch rank, the local GPU index and the GPU type the plan was costed on.
The program checks at start (`startup_problems`) that the rank it was given sits where the table
says, on the GPU type the table names, and refuses to train otherwise, naming the mismatch.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tagplan.export.runtime_layout import node_order, rank_devices
from tagplan.ir.cluster import Cluster
from tagplan.ir.plan import Plan

RENDEZVOUS_ENV = "TAGPLAN_RENDEZVOUS"
"""Where set (`runtime_launch`: a file:// URL unique to one local launch), the program's ranks meet through that store
instead of torchrun's MASTER_ADDR:MASTER_PORT, which another launch on the same host can have picked too."""

DEFAULT_PORT = 29500


def rank_table(plan: Plan, cluster: Cluster | None) -> list[dict[str, Any]]:
    """Per world rank: `device`, `node` (name), `node_rank` (launch order), `local_gpu`, `gpu` (type).

    Without a cluster the plan runs on one host, ranks in the plan's device order, no GPU type."""
    if cluster is None:
        return [{"device": d, "node": None, "node_rank": 0, "local_gpu": i, "gpu": None}
                for i, d in enumerate(plan.devices)]
    return fixed_rank_table(rank_devices(plan.devices, {d: cluster.device(d).node for d in plan.devices}), cluster)


def fixed_rank_table(ranked: Sequence[int], cluster: Cluster) -> list[dict[str, Any]]:
    """`rank_table`'s rows for a launcher that fixes which device each world rank runs (`ranked[i]`:
    rank i's device), as Megatron-LM and DeepSpeed do (`checks.check_rank_order` has checked that
    each node's devices follow one another), and for `rank_table`'s torchrun order: the node of rank 0
    is node rank 0, and so on."""
    node_rank = {node: k for k, node in enumerate(node_order(ranked, {d: cluster.device(d).node for d in ranked}))}
    rows = []
    for d in ranked:
        dev = cluster.device(d)
        rows.append({"device": d, "node": cluster.nodes[dev.node].name, "node_rank": node_rank[dev.node],
                     "local_gpu": dev.local, "gpu": dev.spec.name})
    return rows


LAUNCH_MANIFEST = ".tagplan-launch"
"""Lists the launch files an export wrote in its `--out` (`record_launch_files`), so the next export there removes
those and nothing else (`clear_launch_files`): a user's own `hostfile` or `launch.sh` beside them stays."""


def clear_launch_files(out_dir: Path) -> None:
    """Remove the launch files an earlier export wrote in `out_dir` (its `LAUNCH_MANIFEST`): a 2-node plan's
    `launch_node1.sh` left beside a 1-node plan's `launch_node0.sh` would start a rank the new plan does not have."""
    manifest = out_dir / LAUNCH_MANIFEST
    if not manifest.is_file():
        return
    for name in manifest.read_text().split():
        path = out_dir / Path(name).name  # a name in this folder, never a path elsewhere
        if path.is_file():
            path.unlink()
    manifest.unlink()


def record_launch_files(out_dir: Path, paths: Sequence[Path]) -> None:
    """Write `out_dir`'s `LAUNCH_MANIFEST`: the launch files this export wrote there (a new file: one planted as a
    link is removed first, never written through)."""
    manifest = out_dir / LAUNCH_MANIFEST
    manifest.unlink(missing_ok=True)
    manifest.write_text("".join(f"{p.name}\n" for p in paths))


def launch_scripts(table: list[dict[str, Any]], program: str = "train.py", *, setup: Sequence[str] = (),
                   command: str | None = None, pin_gpus: bool = False) -> dict[str, str]:
    """File name -> text of one bash script per node (`launch_node{k}.sh`, k = node rank): torchrun
    with `--nnodes`, `--node-rank`, `--nproc-per-node` and one static rendezvous at $MASTER_ADDR,
    running `program` with the script's arguments, or the shell text `command` (after the `setup`
    lines). `pin_gpus`: CUDA_VISIBLE_DEVICES lists the node's GPUs of the table in rank order, so local
    rank j runs the j-th, for programs that take their GPU from torchrun's LOCAL_RANK."""
    nodes = sorted({row["node_rank"] for row in table})
    out = {}
    for k in nodes:
        mine = [row for row in table if row["node_rank"] == k]
        first = next(row for row in table if row["node_rank"] == 0)
        host = first["node"] or "this host"
        lines = [
            "#!/usr/bin/env bash",
            f"# node rank {k} of {len(nodes)}: {mine[0]['node'] or 'this host'}"
            + (f", {len(mine)} x {mine[0]['gpu']}" if mine[0]["gpu"] else f", {len(mine)} processes"),
            f"# plan devices {[row['device'] for row in mine]} (local GPUs {[row['local_gpu'] for row in mine]}),"
            f" world ranks {table.index(mine[0])}..{table.index(mine[-1])}",
            f"# start every node's script; MASTER_ADDR is node rank 0 ({host}), which holds stage 0.",
            "set -euo pipefail",
            f': "${{MASTER_ADDR:?set MASTER_ADDR to the address of node rank 0 ({host})}}"',
            f'MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"',
            'cd "$(dirname "$0")"',
        ]
        if pin_gpus:
            gpus = ",".join(str(row["local_gpu"]) for row in mine)
            lines.append(f"export CUDA_VISIBLE_DEVICES={gpus}  # local rank j runs the j-th")
        lines += setup
        lines.append(f"exec torchrun --nnodes {len(nodes)} --node-rank {k} --nproc-per-node {len(mine)} "
                     f'--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" '
                     + (command if command is not None else f'{shlex.quote(program)} "$@"'))
        out[f"launch_node{k}.sh"] = "\n".join(lines) + "\n"
    return out


def gpu_matches(expected: str, found: str) -> bool:
    """Whether the device name torch reports (`found`, e.g. 'Tesla V100-SXM2-16GB') is of the catalog
    type `expected` (e.g. 'V100-SXM2-32GB'): its model ('V100') is a word of the name, or two adjacent
    words ('RTX 4090')."""
    model = expected.split("-")[0].lower()
    words = [w for w in re.split(r"[\s\-_]+", found.lower()) if w]
    return model in words or model in {a + b for a, b in itertools.pairwise(words)}


def startup_problems(table: list[dict[str, Any]], *, rank: int, world: int, local_world: int | None,
                     node_rank: int | None, gpu_name: str | None, gpu_count: int | None) -> list[str]:
    """Why this process cannot run rank `rank` of the plan (empty: it can).

    `local_world`, `node_rank` (torchrun's LOCAL_WORLD_SIZE, GROUP_RANK), `gpu_name` (the name of the
    GPU it would use) and `gpu_count` are None where unknown (a CPU run), and then not checked."""
    if world != len(table):
        return [f"the plan runs on {len(table)} processes but WORLD_SIZE={world}: launch every node's "
                "launch_node*.sh (their --nproc-per-node add up to the plan's devices)"]
    row = table[rank]
    where = f"rank {rank} (plan device {row['device']}" + (f" on node {row['node']})" if row["node"] else ")")
    expected_local = sum(1 for r in table if r["node_rank"] == row["node_rank"])
    out = []
    if node_rank is not None and node_rank != row["node_rank"]:
        out.append(f"{where} belongs to node rank {row['node_rank']} but was started as node rank {node_rank}: "
                   f"run launch_node{row['node_rank']}.sh on {row['node'] or 'that node'}")
    if local_world is not None and local_world != expected_local:
        out.append(f"{where}: node rank {row['node_rank']} runs {expected_local} processes but this node started "
                   f"{local_world}")
    if gpu_count is not None and row["local_gpu"] >= gpu_count:
        out.append(f"{where} needs local GPU {row['local_gpu']} but this node has {gpu_count} GPUs")
    elif gpu_name is not None and row["gpu"] and not gpu_matches(row["gpu"], gpu_name):
        out.append(f"{where} was planned on a {row['gpu']} but local GPU {row['local_gpu']} is a {gpu_name}")
    return out
