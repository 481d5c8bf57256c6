"""`ir.summary`: the JSON-ready summaries tools read (stable keys), with no rendering library behind them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir.summary import cluster_summary, model_summary
from tagplan.ir.workload import DType


def test_model_summary_keys_and_sums() -> None:
    model = load_model("gpt3-125m", seq_len=512)
    out = model_summary(model, batch=4)
    assert {"name", "family", "params", "flops_per_sample", "unique_blocks", "seq_len", "dtype", "batch",
            "flops_per_batch", "layers"} <= set(out)
    assert out["seq_len"] == 512 and out["batch"] == 4
    assert out["flops_per_batch"] == pytest.approx(4 * out["flops_per_sample"])
    assert sum(layer["params"] for layer in out["layers"]) == out["params"]
    assert {"name", "hash", "kind", "params", "flops", "param_bytes", "saved_bytes", "output_bytes"} <= set(
        out["layers"][0])
    json.dumps(out)  # plain JSON values only


def test_cluster_summary_keys_and_dtype() -> None:
    cluster = load_cluster("dgx-a100-80gb:nodes=2")
    bf16, fp32 = cluster_summary(cluster), cluster_summary(cluster, dtype=DType.FP32)
    assert {"name", "num_devices", "device_types", "devices", "nodes", "links", "network"} <= set(bf16)
    assert bf16["num_devices"] == len(bf16["devices"]) == 16
    assert {link["scope"] for link in bf16["links"]} >= {"intra", "nic"}
    assert fp32["devices"][0]["peak_flops"] != bf16["devices"][0]["peak_flops"]
    json.dumps(bf16)


def test_summaries_import_no_rendering_library() -> None:
    code = "import sys, tagplan.ir.summary; print('rich' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_device_ranges_print_runs_in_plan_order() -> None:
    from tagplan.ir.summary import device_ranges

    assert device_ranges(range(24, 32)) == "24-31"
    assert device_ranges([0, 1, 2, 3, 8, 9, 10, 11]) == "0-3, 8-11"
    assert device_ranges([5]) == "5"
    assert device_ranges([28, 27]) == "28, 27"  # never "28..27"
