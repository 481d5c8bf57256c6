"""GNN benchmark: out-of-distribution accuracy, guidance of the search, inference throughput.

Prints tables and writes bench/results/gnn.json. Run: `.venv/bin/python bench/gnn.py`.
- Accuracy: the shipped checkpoint on freshly generated sets of held-out families (t5, cnn) and
  held-out GPU types (H200, L4, MI300X): Kendall tau within instance groups and MAPE of time.
- Guidance (`--only guidance` recomputes just this table, `--only throughput` the throughput): one
  search of the full budget per prior (uniform, GNN as `--scorer gnn` builds it), the simulator as evaluator;
  the evaluations each needs before its best plan is within 1% of the uniform search's best at
  the full budget (MCTS is anytime: the best after k evaluations is what a budget of k returns,
  up to the Gumbel root the search uses below 50 evaluations).
- Throughput: candidate plans scored per second (one batched forward), on one thread.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tagplan.cost.simulator import Simulator
from tagplan.datasets.clusters import HELD_OUT_GPU_TYPES, TRAIN_GPU_TYPES
from tagplan.datasets.pyg import PlanDataset
from tagplan.datasets.synthetic import generate, load_samples, rebuild
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.gnn.features import PRIOR_FEATURE
from tagplan.gnn.model import load_checkpoint
from tagplan.gnn.scorer import GNNPrior, GNNScorer
from tagplan.ir.workload import Workload
from tagplan.search.mcts import mcts, uniform_prior
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.space import PlanSpace, PlanState
from tagplan.training.metrics import kendall_tau, mape
from tagplan.training.registry import PACKAGED_CHECKPOINT

GUIDANCE_CASES = [
    ("1.3B on p3.8xlarge x3 + g4dn", "gpt3-1.3b", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", 32, 1024),
    ("T5-3B on p3.8xlarge x3 + g4dn", "t5-3b", "p3.8xlarge:nodes=3+g4dn.12xlarge:nodes=1", 64, 512),
    ("13B on A100 + V100 nodes", "gpt3-13b", "dgx-a100-80gb:nodes=2+p3.16xlarge:nodes=2", 128, 2048),
    ("1.3B on rtx4090x4 + g4dn", "gpt3-1.3b", "rtx4090x4:nodes=2+g4dn.12xlarge:nodes=2", 32, 1024),
    ("13B on 4 DGX-A100", "gpt3-13b", "dgx-a100-80gb:nodes=4", 256, 2048),
]
BUDGET = 400


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
        preds, ys, groups, closed = [], [], [], []
        with torch.no_grad():
            for batch in DataLoader(items, batch_size=64):
                preds.append(model(batch)[0])
                ys.append(batch.y.view(-1))
                groups.append(batch.group.view(-1))
                closed.append(batch.graph_attr[:, PRIOR_FEATURE])
        p, y, g = torch.cat(preds).numpy(), torch.cat(ys).numpy(), torch.cat(groups).numpy()
        e = torch.cat(closed).numpy()
        out[name] = {"plans": len(items), "kendall_tau": kendall_tau(p, y, g), "mape": mape(np.exp(p), np.exp(y)),
                     "closed_form_kendall_tau": kendall_tau(e, y, g), "closed_form_mape": mape(np.exp(e), np.exp(y)),
                     "simulator_kendall_tau": 1.0, "simulator_mape": 0.0}
    return out


class Recording:
    """The simulator evaluator, remembering each new evaluation's value in order."""

    def __init__(self, judge: SimulatorEvaluator) -> None:
        self.judge, self.values = judge, []  # type: list[float]

    def __call__(self, state: Any) -> float:
        value = self.judge(state)
        self.values.append(value)
        return value


def search_values(case: tuple[str, str, str, int, int], prior_factory: Any) -> tuple[list[float], float]:
    """(values of the evaluations in order, wall seconds) of one search of BUDGET evaluations."""
    _, model_spec, cluster_spec, batch, seq = case
    m, c = load_model(model_spec, seq_len=seq), load_cluster(cluster_spec)
    w = Workload(global_batch=batch, seq_len=m.seq_len)
    space = PlanSpace(Simulator(m, c, w))
    recording = Recording(SimulatorEvaluator(space))
    prior = prior_factory(space) if prior_factory else uniform_prior
    start = time.perf_counter()
    mcts(space, PlanState(), prior=prior, evaluator=recording, max_evaluations=BUDGET, max_wall_s=600, seed=0)
    return recording.values, time.perf_counter() - start


def first_within(values: list[float], target: float) -> int | None:
    """1-based count of evaluations after which the best value is within 1% of `target` in time."""
    return next((i + 1 for i, v in enumerate(values) if v >= target / 1.01), None)


def evaluations_needed(case: tuple[str, str, str, int, int], scorer: GNNScorer) -> dict[str, Any]:
    """Evaluations to reach within 1% of the uniform search's best at BUDGET, per prior."""
    uniform, uniform_wall = search_values(case, None)
    guided, guided_wall = search_values(case, lambda space: GNNPrior(space, scorer))
    target = max(uniform)
    u, g = first_within(uniform, target), first_within(guided, target)
    return {"case": case[0], "uniform_best_value": target, "gnn_best_value": max(guided),
            "uniform_evaluations": u, "gnn_evaluations": g, "uniform_wall_s": uniform_wall,
            "gnn_wall_s": guided_wall, "reduction": (u / g) if u and g else None}


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
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=("guidance", "throughput"),
                        help="recompute one part only and merge it into the existing results file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, card = load_checkpoint(PACKAGED_CHECKPOINT)
    scorer = GNNScorer(model)
    out = Path(__file__).parent / "results" / "gnn.json"
    if args.only == "throughput":
        tput = throughput(scorer)
        print(f"throughput: {tput:.1f} candidates/s (batched, 1 thread)")
        out.write_text(json.dumps({**json.loads(out.read_text()), "candidates_per_s": tput}, indent=2, default=str))
        print(f"wrote {out}")
        return
    if args.only:
        rows = [evaluations_needed(case, scorer) for case in GUIDANCE_CASES]
        for row in rows:
            print(f"guidance {row['case']:32s} uniform {row['uniform_evaluations']} evals  gnn "
                  f"{row['gnn_evaluations']} evals  reduction {row['reduction']}")
        out.write_text(json.dumps({**json.loads(out.read_text()), "guidance": rows}, indent=2, default=str))
        print(f"wrote {out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        acc = accuracy(model, Path(tmp))
    for name, m in acc.items():
        print(f"accuracy {name:22s} plans {m['plans']:5d}  GNN tau {m['kendall_tau']:.3f} MAPE {m['mape']:.1%}  "
              f"closed form tau {m['closed_form_kendall_tau']:.3f} MAPE {m['closed_form_mape']:.1%}  "
              f"simulator tau 1 MAPE 0 (it made the labels)")
    rows = []
    for case in GUIDANCE_CASES:
        row = evaluations_needed(case, scorer)
        rows.append(row)
        print(f"guidance {row['case']:32s} uniform {row['uniform_evaluations']} evals  gnn {row['gnn_evaluations']} "
              f"evals  reduction {row['reduction']}")
    tput = throughput(scorer)
    print(f"throughput: {tput:.1f} candidates/s (batched, 1 thread)")
    out.write_text(json.dumps({"checkpoint_card": card.get("metrics"), "accuracy": acc, "guidance": rows,
                               "candidates_per_s": tput, "budget": BUDGET}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
