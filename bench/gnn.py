"""GNN benchmark: out-of-distribution accuracy, guidance of the search, inference throughput.

Prints tables and writes bench/results/gnn.json. Run: `.venv/bin/python bench/gnn.py`.
- Accuracy: the shipped checkpoint on freshly generated sets of held-out families (t5, cnn) and
  held-out GPU types (H200, L4, MI300X): Kendall tau within instance groups and MAPE of time.
- Guidance: evaluations the search needs to come within 1% of the unguided search's result at
  its full budget, with the GNN prior and with the uniform prior.
- Throughput: candidate plans scored per second (one batched forward), on one thread.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tagplan.datasets.clusters import HELD_OUT_GPU_TYPES, TRAIN_GPU_TYPES
from tagplan.datasets.pyg import PlanDataset
from tagplan.datasets.synthetic import generate, load_samples, rebuild
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.gnn.model import load_checkpoint
from tagplan.gnn.scorer import GNNPrior, GNNScorer
from tagplan.ir.workload import Workload
from tagplan.search.planner import plan
from tagplan.training.metrics import kendall_tau, mape
from tagplan.training.registry import PACKAGED_CHECKPOINT

GUIDANCE_CASES = [
    ("1.3B on p3.8xlarge x3 + g4dn", "gpt3-1.3b", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", 32, 1024),
    ("T5-3B on p3.8xlarge x3 + g4dn", "t5-3b", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", 64, 512),
    ("13B on A100 + V100 nodes", "gpt3-13b", "dgx-a100-80gb:nodes=2+p3.16xlarge:nodes=2", 128, 2048),
    ("1.3B on rtx4090x4 + g4dn", "gpt3-1.3b", "rtx4090x4:nodes=2+g4dn.12xlarge:nodes=2", 32, 1024),
    ("13B on 4 DGX-A100", "gpt3-13b", "dgx-a100-80gb:nodes=4", 256, 2048),
]
BUDGETS = (10, 25, 50, 100, 200, 400)


def accuracy(model: torch.nn.Module, work: Path) -> dict[str, Any]:
    """Tau and MAPE on held-out families and on held-out GPU types (fresh data, seed 77)."""
    out: dict[str, Any] = {}
    generate(work / "ood_gpu", instances=40, plans_per_instance=12, seed=77, gpu_types=HELD_OUT_GPU_TYPES)
    generate(work / "ood_all", instances=80, plans_per_instance=12, seed=78, gpu_types=TRAIN_GPU_TYPES)
    sets = {"held_out_gpu_types": list(PlanDataset(str(work / "ood_gpu"))),
            "held_out_families": [d for d in PlanDataset(str(work / "ood_all")) if d.family in ("t5", "cnn")]}
    from torch_geometric.loader import DataLoader

    model.eval()
    for name, items in sets.items():
        preds, ys, groups = [], [], []
        with torch.no_grad():
            for batch in DataLoader(items, batch_size=64):
                preds.append(model(batch)[0])
                ys.append(batch.y.view(-1))
                groups.append(batch.group.view(-1))
        p, y, g = torch.cat(preds).numpy(), torch.cat(ys).numpy(), torch.cat(groups).numpy()
        out[name] = {"plans": len(items), "kendall_tau": kendall_tau(p, y, g), "mape": mape(np.exp(p), np.exp(y)),
                     "simulator_kendall_tau": 1.0, "simulator_mape": 0.0}
    return out


def evaluations_needed(case: tuple[str, str, str, int, int], scorer: GNNScorer) -> dict[str, Any]:
    """Smallest budget from BUDGETS reaching within 1% of the unguided result at 400, per prior."""
    name, model_spec, cluster_spec, batch, seq = case
    m, c = load_model(model_spec, seq_len=seq), load_cluster(cluster_spec)
    w = Workload(global_batch=batch, seq_len=m.seq_len)
    reference = plan(m, c, w, max_evaluations=BUDGETS[-1], budget_s=600).best.report.iteration_time_s
    row: dict[str, Any] = {"case": name, "unguided_best_s": reference}
    for label, factory in (("uniform", None), ("gnn", lambda space: GNNPrior(space, scorer))):
        needed, wall = None, 0.0
        for budget in BUDGETS:
            start = time.perf_counter()
            got = plan(m, c, w, max_evaluations=budget, budget_s=600, prior_factory=factory)
            wall = time.perf_counter() - start
            if got.best.report.iteration_time_s <= reference * 1.01:
                needed = budget
                break
        row[f"{label}_evaluations"] = needed
        row[f"{label}_wall_s"] = wall
    u, g = row["uniform_evaluations"], row["gnn_evaluations"]
    row["reduction"] = (u / g) if u and g else None
    return row


def throughput(scorer: GNNScorer) -> float:
    """Candidates of one instance scored per second in one batch of 64 (one thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), instances=2, plans_per_instance=16, seed=3)
        samples = load_samples(Path(tmp))
    first = [s for s in samples if s.group == samples[0].group]
    model, cluster, workload, _ = rebuild(first[0])
    plans = [rebuild(s)[3] for s in first]
    plans = (plans * (64 // len(plans) + 1))[:64]
    scorer.predict(model, cluster, workload, plans[:2])  # warm up
    start = time.perf_counter()
    scorer.predict(model, cluster, workload, plans)
    return len(plans) / (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(1)
    model, card = load_checkpoint(PACKAGED_CHECKPOINT)
    scorer = GNNScorer(model)
    with tempfile.TemporaryDirectory() as tmp:
        acc = accuracy(model, Path(tmp))
    for name, m in acc.items():
        print(f"accuracy {name:22s} plans {m['plans']:5d}  tau {m['kendall_tau']:.3f}  MAPE {m['mape']:.1%}")
    rows = []
    for case in GUIDANCE_CASES:
        row = evaluations_needed(case, scorer)
        rows.append(row)
        print(f"guidance {row['case']:32s} uniform {row['uniform_evaluations']} evals  gnn {row['gnn_evaluations']} "
              f"evals  reduction {row['reduction']}")
    tput = throughput(scorer)
    print(f"throughput: {tput:.1f} candidates/s (batched, 1 thread)")
    out = Path(__file__).parent / "results" / "gnn.json"
    out.write_text(json.dumps({"checkpoint_card": card.get("metrics"), "accuracy": acc, "guidance": rows,
                               "candidates_per_s": tput, "budgets": list(BUDGETS)}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
