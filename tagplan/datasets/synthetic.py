"""Simulator-labelled plans of random (model, cluster, workload) instances, written to disk.

For each instance (a random model from `models`, a random cluster from `clusters`, a workload
with a global batch of 8-512 samples) `generate` labels up to `plans_per_instance` distinct
plans with the simulator: half are random walks through the decision process (a uniformly random
legal action at every step), the rest the best plans a short MCTS (uniform prior + simulator,
`SEARCH_EVALUATIONS` evaluations) visited, so that a group holds both typical and near-optimal
plans. Plans of one instance share a `group` id and are comparable for ranking.

Instance i draws everything from `random.Random` seeded by (seed, i), so the samples of a seed
are the same whatever the number of worker processes. The output directory holds
`samples.jsonl` (one `Sample` per line) and `manifest.json` (what was generated, from what).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from tagplan import __version__
from tagplan.cost.bounds import lower_bound_s
from tagplan.cost.simulator import Simulator
from tagplan.datasets.clusters import TRAIN_GPU_TYPES, random_cluster
from tagplan.datasets.models import ModelRecipe, build_model, random_recipe
from tagplan.frontends.catalog import lookup_device
from tagplan.ir.base import Record
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.ir.workload import Optimizer, Workload
from tagplan.search.mcts import mcts
from tagplan.search.planner import SimulatorEvaluator
from tagplan.search.space import PlanSpace, PlanState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SAMPLES_FILE = "samples.jsonl"
MANIFEST_FILE = "manifest.json"
SEARCH_EVALUATIONS = 20
"""Evaluator calls of the MCTS run on each instance."""
FIT_PROBABILITY = 0.9
"""Share of instances whose model is redrawn until its state (weights, gradients, optimizer)
takes at most `STATE_BUDGET` of the cluster's memory, so that most groups hold plans that fit
(and, near the limit, many that do not); the rest are drawn unconstrained."""
STATE_BUDGET = 1.0
_MODEL_TRIES = 64
_BATCHES = (8, 16, 32, 64, 128, 256, 512)
_OPTIMIZERS = ((Optimizer.ADAM, 0.5), (Optimizer.ADAMW, 0.3), (Optimizer.SGD_MOMENTUM, 0.2))

Source = Literal["random", "search"]


class Sample(Record):
    """One simulator-labelled plan of one (model, cluster, workload) instance."""

    version: int = Field(default=FORMAT_VERSION, ge=1, le=FORMAT_VERSION)
    group: str = Field(min_length=1, description="instance id; plans of one group are comparable")
    source: Source = Field(description="random: a random walk; search: visited by MCTS")
    family: str = Field(min_length=1)
    gpu_types: tuple[str, ...] = Field(description="the cluster's GPU types, sorted")
    model: ModelRecipe
    model_digest: str = Field(min_length=1, description="sha256 of the ModelGraph JSON (first 16 hex digits)")
    cluster: Cluster
    workload: Workload
    plan: Plan
    iteration_time_s: float = Field(gt=0)
    lower_bound_s: float = Field(gt=0, description="3 * global batch * model FLOPs / sum of all devices' peaks")
    fits: bool
    peak_memory_bytes: float = Field(ge=0)

    @property
    def value(self) -> float:
        """lower_bound_s / iteration_time_s: the search's scale-free value (before the fit penalty)."""
        return self.lower_bound_s / self.iteration_time_s


@dataclass(frozen=True)
class Instance:
    """One (model, cluster, workload) to label plans of."""

    group: str
    recipe: ModelRecipe
    model: ModelGraph
    cluster: Cluster
    workload: Workload


def model_digest(model: ModelGraph) -> str:
    """First 16 hex digits of the sha256 of the model's JSON."""
    return hashlib.sha256(model.to_json().encode()).hexdigest()[:16]


def instance_rng(seed: int, index: int) -> random.Random:
    """The generator of instance `index` of dataset `seed` (independent of every other instance)."""
    return random.Random(f"tagplan.datasets:{seed}:{index}")


def random_instance(rng: random.Random, group: str, gpu_types: Sequence[str]) -> Instance:
    """A cluster, then a model (most of the time one whose state fits in the cluster), then a workload."""
    cluster = random_cluster(rng, gpu_types=gpu_types)
    budget = STATE_BUDGET * sum(d.spec.mem_bytes for d in cluster.devices) if rng.random() < FIT_PROBABILITY else None
    optimizer = rng.choices([o for o, _ in _OPTIMIZERS], weights=[w for _, w in _OPTIMIZERS])[0]
    for _ in range(_MODEL_TRIES):
        recipe = random_recipe(rng)
        model = build_model(recipe)
        workload = Workload(global_batch=1, seq_len=model.seq_len, dtype=recipe.dtype, optimizer=optimizer)
        per_param = workload.weight_bytes_per_param + workload.grad_bytes_per_param + workload.optimizer_bytes_per_param
        if budget is None or model.params * per_param <= budget:
            break
    batch = rng.choice(batch_candidates(cluster.num_devices))
    return Instance(group, recipe, model, cluster, workload.model_copy(update={"global_batch": batch}))


def batch_candidates(devices: int) -> list[int]:
    """Global batches for a cluster of `devices` GPUs: powers of two and multiples of the device count
    in 8..512, none below half the device count."""
    low = max(8, devices // 2)
    options = {b for b in _BATCHES if b >= low} | {k * devices for k in (1, 2, 4, 8) if low <= k * devices <= 512}
    return sorted(options) or [512]


def random_walk(space: PlanSpace, rng: random.Random) -> Plan | None:
    """A plan reached by taking a uniformly random legal action at every step (None at a dead end)."""
    state = PlanState()
    while not space.is_terminal(state):
        actions = space.actions(state)
        if not actions:
            log.debug("random walk: no action at %s", state)
            return None
        state = space.step(state, rng.choice(actions))
    return space.to_plan(state)


def label_instance(instance: Instance, plans_per_instance: int, rng: random.Random) -> list[Sample]:
    """Up to `plans_per_instance` distinct labelled plans: random walks first, then MCTS's best.

    Returns [] when the decision process has no action at its root (no plan exists).
    """
    sim = Simulator(instance.model, instance.cluster, instance.workload)
    space = PlanSpace(sim)
    if not space.actions(PlanState()):
        log.info("instance %s: the plan space is empty; skipped", instance.group)
        return []
    judge = SimulatorEvaluator(space)
    chosen: dict[str, tuple[Plan, Source]] = {}
    walks = plans_per_instance - plans_per_instance // 2
    for _ in range(max(4 * walks, 8)):
        if len(chosen) >= walks:
            break
        plan = random_walk(space, rng)
        if plan is not None:
            chosen.setdefault(plan.to_json(), (plan, "random"))
    found = mcts(space, PlanState(), evaluator=judge, max_evaluations=SEARCH_EVALUATIONS,
                 seed=rng.randrange(2**32))
    ranked = sorted(found.evaluated, key=lambda sv: -sv[1])  # stable: ties keep evaluation order
    for state, _ in ranked:
        if len(chosen) >= plans_per_instance:
            break
        plan = space.to_plan(state)
        chosen.setdefault(plan.to_json(), (plan, "search"))
    return [_sample(instance, plan, source, judge) for plan, source in chosen.values()]


def _sample(instance: Instance, plan: Plan, source: Source, judge: SimulatorEvaluator) -> Sample:
    report = judge.candidate(plan, source).report
    model, cluster, workload = instance.model, instance.cluster, instance.workload
    return Sample(group=instance.group, source=source, family=instance.recipe.family,
                  gpu_types=tuple(sorted(cluster.device_types)), model=instance.recipe,
                  model_digest=model_digest(model), cluster=cluster, workload=workload, plan=plan,
                  iteration_time_s=report.iteration_time_s, lower_bound_s=lower_bound_s(model, cluster, workload),
                  fits=report.fits, peak_memory_bytes=report.peak_memory_bytes)


def instance_samples(seed: int, index: int, plans_per_instance: int, gpu_types: Sequence[str]) -> list[Sample]:
    """The labelled samples of instance `index` of dataset `seed` (a pure function of its arguments)."""
    rng = instance_rng(seed, index)
    instance = random_instance(rng, f"s{seed}-i{index:06d}", gpu_types)
    return label_instance(instance, plans_per_instance, rng)


def _work(job: tuple[int, int, int, tuple[str, ...]]) -> list[str]:
    """Worker entry point (top level, so spawned processes can import it): JSON lines of one instance."""
    seed, index, plans, types = job
    return [s.to_json() for s in instance_samples(seed, index, plans, types)]


def generate(out_dir: Path, *, instances: int, plans_per_instance: int = 16, seed: int = 0, workers: int = 1,
             gpu_types: Sequence[str] = TRAIN_GPU_TYPES, progress: bool = False) -> Path:
    """Write `samples.jsonl` and `manifest.json` for `instances` random instances into `out_dir`.

    The samples depend only on (`seed`, `instances`, `plans_per_instance`, `gpu_types`), not on
    `workers` (processes, spawned) or `progress` (a rich progress bar). Returns `out_dir`.
    """
    types = _check_arguments(instances, plans_per_instance, workers, gpu_types)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(seed, i, plans_per_instance, types) for i in range(instances)]
    tally = _Tally()
    tmp = out_dir / (SAMPLES_FILE + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for lines in _track(_run(jobs, workers), instances, progress):
            tally.add(lines)
            fh.writelines(line + "\n" for line in lines)
    tmp.replace(out_dir / SAMPLES_FILE)
    manifest = tally.manifest(seed=seed, instances=instances, plans_per_instance=plans_per_instance, gpu_types=types)
    (out_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    log.info("wrote %d samples of %d instances to %s", tally.samples, instances, out_dir)
    return out_dir


def _check_arguments(instances: int, plans_per_instance: int, workers: int,
                     gpu_types: Sequence[str]) -> tuple[str, ...]:
    """Canonical catalog names of `gpu_types`; ValueError naming the first bad argument."""
    if instances < 0:
        raise ValueError(f"instances must be >= 0, got {instances}")
    if plans_per_instance < 1:
        raise ValueError(f"plans_per_instance must be >= 1, got {plans_per_instance}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if isinstance(gpu_types, str) or not gpu_types:
        raise ValueError(f"gpu_types must be a non-empty sequence of catalog GPU names, got {gpu_types!r}")
    return tuple(sorted({lookup_device(t).name for t in gpu_types}))


def _run(jobs: list[tuple[int, int, int, tuple[str, ...]]], workers: int) -> Iterator[list[str]]:
    """Each job's JSON lines, in job order."""
    if workers == 1 or len(jobs) <= 1:
        yield from map(_work, jobs)
        return
    with multiprocessing.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        yield from pool.imap(_work, jobs, chunksize=1)


def _track(items: Iterable[list[str]], total: int, enabled: bool) -> Iterable[list[str]]:
    if not enabled:
        return items
    from rich.progress import track

    return track(items, total=total, description="labelling instances")


class _Tally:
    """Counts for the manifest, accumulated from the written lines."""

    def __init__(self) -> None:
        self.samples = self.written = 0
        self.sources: Counter[str] = Counter()
        self.families: Counter[str] = Counter()
        self.family_samples: Counter[str] = Counter()
        self.types: Counter[str] = Counter()
        self.fits = 0

    def add(self, lines: list[str]) -> None:
        if not lines:
            return
        self.written += 1
        self.samples += len(lines)
        first = json.loads(lines[0])
        self.families[first["family"]] += 1
        self.family_samples[first["family"]] += len(lines)
        self.types.update(first["gpu_types"])
        for line in lines:
            record = json.loads(line)
            self.sources[record["source"]] += 1
            self.fits += bool(record["fits"])

    def manifest(self, *, seed: int, instances: int, plans_per_instance: int,
                 gpu_types: tuple[str, ...]) -> dict[str, Any]:
        families = {f: {"instances": n, "samples": self.family_samples[f]} for f, n in sorted(self.families.items())}
        return {
            "format": FORMAT_VERSION, "tagplan_version": __version__,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "seed": seed, "instances": instances, "instances_written": self.written,
            "instances_skipped": instances - self.written, "plans_per_instance": plans_per_instance,
            "search_evaluations": SEARCH_EVALUATIONS, "samples": self.samples, "samples_fit": self.fits,
            "sources": dict(sorted(self.sources.items())),
            "families": families,
            "gpu_types": list(gpu_types), "gpu_types_seen": dict(sorted(self.types.items())),
            "files": {"samples": SAMPLES_FILE},
        }


def load_samples(path: Path | str) -> list[Sample]:
    """Samples of a generated directory (or of a `samples.jsonl` file), in file order.

    Raises ValueError naming the file and line of a record that does not validate.
    """
    file = Path(path)
    if file.is_dir():
        file = file / SAMPLES_FILE
    out: list[Sample] = []
    with file.open(encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                out.append(Sample.model_validate_json(line))
            except ValueError as err:
                raise ValueError(f"{file}:{number}: not a valid sample: {err}") from None
    return out


def rebuild(sample: Sample) -> tuple[ModelGraph, Cluster, Workload, Plan]:
    """(model, cluster, workload, plan) of a sample; the model is rebuilt from its recipe.

    Raises ValueError when the rebuilt model differs from the one labelled (its digest changed:
    the model builders changed since the dataset was generated).
    """
    model = build_model(sample.model)
    digest = model_digest(model)
    if digest != sample.model_digest:
        raise ValueError(f"sample of group {sample.group}: model {sample.model.name!r} rebuilds with digest "
                         f"{digest}, not the labelled {sample.model_digest}; regenerate the dataset")
    return model, sample.cluster, sample.workload, sample.plan
