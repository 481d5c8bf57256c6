"""A generated sample directory as a PyTorch Geometric dataset of joint graphs with targets.

Each sample becomes the `HeteroData` of `tagplan.gnn.features.featurize(model, cluster,
workload, plan)` (or an injected featurizer) with graph-level attributes:

- `y`: float [1], log(iteration_time_s / lower_bound_s), the scale-free value-head target (>= 0
  for a simulator that never beats the physical lower bound);
- `fit`: float [1], 1.0 when the plan fits in every device's memory;
- `group`: long [1], the index of the sample's (model, cluster, workload) instance, in order of
  first appearance (plans of one group are comparable for ranking);
- `family`, `gpu_types`, `source`, `group_name`: python values for splitting (held-out model
  families, held-out GPU types) and joining back to `samples.jsonl`.

Processed data is saved under `<root>/processed/` (named after the manifest's hash, so a
regenerated directory is processed again); `samples.jsonl` is read from `<root>` itself.
`split` separates held-out families and GPU types for evaluation.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch_geometric.data import HeteroData, InMemoryDataset

from tagplan.datasets.synthetic import MANIFEST_FILE, SAMPLES_FILE, Sample, load_samples, rebuild
from tagplan.ir.cluster import Cluster
from tagplan.ir.model import ModelGraph
from tagplan.ir.plan import Plan
from tagplan.ir.workload import Workload

Featurize = Callable[[ModelGraph, Cluster, Workload, Plan], HeteroData]
"""(model, cluster, workload, plan) -> the joint graph."""


class PlanDataset(InMemoryDataset):
    """The labelled plans of a directory written by `tagplan.datasets.synthetic.generate`.

    Arguments:
        root: the generated directory (holding `samples.jsonl`).
        featurize: the graph builder; None imports `tagplan.gnn.features.featurize` when processing.
        transform, pre_transform, pre_filter: as for every PyG dataset.
        force_reload: process again even if `<root>/processed/` holds data.
    """

    def __init__(self, root: str | Path, *, featurize: Featurize | None = None,
                 transform: Callable[[HeteroData], HeteroData] | None = None,
                 pre_transform: Callable[[HeteroData], HeteroData] | None = None,
                 pre_filter: Callable[[HeteroData], bool] | None = None, force_reload: bool = False,
                 log: bool = False) -> None:
        self._featurize = featurize  # set before InMemoryDataset.__init__, which may process
        super().__init__(str(root), transform, pre_transform, pre_filter, log=log, force_reload=force_reload)
        self.load(self.processed_paths[0], data_cls=HeteroData)

    @property
    def raw_dir(self) -> str:
        """The generated directory itself (samples.jsonl sits at its top)."""
        return str(self.root)

    @property
    def raw_file_names(self) -> list[str]:
        """The samples file."""
        return [SAMPLES_FILE]

    @property
    def processed_file_names(self) -> list[str]:
        """The collated graphs, named after the manifest so that a regenerated directory is processed again."""
        manifest = Path(self.raw_dir) / MANIFEST_FILE
        if not manifest.is_file():
            return ["data.pt"]
        return [f"data-{hashlib.sha256(manifest.read_bytes()).hexdigest()[:12]}.pt"]

    @property
    def families(self) -> list[str]:
        """Model family of each graph, in dataset order."""
        return [self._data.family[i] for i in self.indices()]

    @property
    def graph_gpu_types(self) -> list[list[str]]:
        """GPU types of each graph's cluster, in dataset order."""
        return [self._data.gpu_types[i] for i in self.indices()]

    def split(self, *, held_out_families: Iterable[str] = (),
              held_out_gpu_types: Iterable[str] = ()) -> tuple[PlanDataset, PlanDataset]:
        """(seen, held out): a graph is held out when its family or any of its GPU types is listed."""
        families, types = set(held_out_families), set(held_out_gpu_types)
        held = [i for i, (f, g) in enumerate(zip(self.families, self.graph_gpu_types, strict=True))
                if f in families or types.intersection(g)]
        held_set = set(held)
        seen = [i for i in range(len(self)) if i not in held_set]
        return self.index_select(seen), self.index_select(held)

    def download(self) -> None:
        """Nothing to download: the samples are generated locally."""
        raise FileNotFoundError(
            f"{Path(self.raw_dir) / SAMPLES_FILE} does not exist; generate it first with "
            "tagplan.datasets.synthetic.generate(out_dir, instances=...) (or `tagplan dataset generate`)"
        )

    def process(self) -> None:
        """Featurize every sample, attach its targets and save the collated graphs."""
        featurize = self._featurize or _default_featurize()
        samples = load_samples(self.raw_paths[0])
        if not samples:
            raise ValueError(f"{self.raw_paths[0]} holds no samples; generate a dataset with instances > 0")
        groups: dict[str, int] = {}
        instances: dict[str, tuple[ModelGraph, Cluster, Workload]] = {}
        graphs: list[HeteroData] = []
        for sample in samples:
            if sample.group not in instances:  # the model is rebuilt (and its digest checked) once per group
                model, cluster, workload, _ = rebuild(sample)
                instances[sample.group] = (model, cluster, workload)
            data = featurize(*instances[sample.group], sample.plan)
            attach_targets(data, sample, groups.setdefault(sample.group, len(groups)))
            if self.pre_filter is not None and not self.pre_filter(data):
                continue
            graphs.append(self.pre_transform(data) if self.pre_transform is not None else data)
        self.save(graphs, self.processed_paths[0])


def attach_targets(data: HeteroData, sample: Sample, group_index: int) -> HeteroData:
    """Set `y`, `fit`, `group` and the python attributes of the module docstring on `data` (in place)."""
    data.y = torch.tensor([math.log(sample.iteration_time_s / sample.lower_bound_s)], dtype=torch.float)
    data.fit = torch.tensor([1.0 if sample.fits else 0.0], dtype=torch.float)
    data.group = torch.tensor([group_index], dtype=torch.long)
    data.family = sample.family
    data.gpu_types = list(sample.gpu_types)
    data.source = sample.source
    data.group_name = sample.group
    return data


def _default_featurize() -> Featurize:
    """`tagplan.gnn.features.featurize` with one cache for the whole pass (samples of a group share objects)."""
    from tagplan.gnn.features import FeatureCache, featurize  # imported here: loading samples needs no gnn

    return functools.partial(featurize, cache=FeatureCache())
