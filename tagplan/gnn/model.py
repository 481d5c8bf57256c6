"""PlanGNN: a heterogeneous GATv2 network over the joint graph that predicts a plan's time and fit.

Checkpoints are single `.pt` files of plain dicts (tensors and primitive types only), loaded with
`torch.load(weights_only=True)`, so opening one runs no code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional
from torch_geometric.data import Batch, HeteroData
from torch_geometric.nn import GATv2Conv, HeteroConv, global_max_pool, global_mean_pool

from tagplan.gnn.features import DEVICE, EDGE_DIMS, EDGE_TYPES, GRAPH_DIM, LAYER, NODE_DIMS, NODE_TYPES, PRIOR_FEATURE

CHECKPOINT_FORMAT = "tagplan.gnn.PlanGNN/1"


class PlanGNN(nn.Module):
    r"""Predicts log(T / T_lb) and a memory-fit logit from a plan's joint graph (`gnn.features`).

    Each node type is embedded, then `layers` rounds of heterogeneous GATv2 message passing
    (Brody et al., "How Attentive are Graph Attention Networks?", ICLR 2022) run over the
    relations flows, link, placed_on and hosts, each with a residual connection:

    .. math::
        \mathbf{h}_v^{(0)} &= \mathbf{W}_{\tau(v)} \mathbf{x}_v + \mathbf{b}_{\tau(v)}

        \mathbf{m}_v^{(k)} &= \sum_{r = (s, \cdot, \tau(v))} \sum_{j \in \mathcal{N}_r(v)}
            \alpha^{r,k}_{vj} \mathbf{\Theta}^{r,k}_s \mathbf{h}_j^{(k)}, \qquad
        \alpha^{r,k}_{vj} = \mathrm{softmax}_j\big(\mathbf{a}^\top \mathrm{LeakyReLU}(
            \mathbf{\Theta}_t \mathbf{h}_v + \mathbf{\Theta}_s \mathbf{h}_j + \mathbf{\Theta}_e \mathbf{e}_{vj})\big)

        \mathbf{h}_v^{(k+1)} &= \mathrm{Dropout}\big(\mathrm{ReLU}(\mathrm{LayerNorm}_{\tau(v)}(
            \mathbf{h}_v^{(k)} + \mathbf{m}_v^{(k)}))\big)

    (with `heads` attention heads concatenated), then a readout per graph :math:`G`:

    .. math::
        \mathbf{z}_G = \mathrm{MLP}\big([\mathrm{mean}_{l} \mathbf{h}_l \,\|\, \max_{l} \mathbf{h}_l
            \,\|\, \mathrm{mean}_{d} \mathbf{h}_d \,\|\, \max_{d} \mathbf{h}_d \,\|\, \mathbf{g}_G]\big), \qquad
        \hat{y}_G = [g_{G,\mathrm{prior}}] + \mathbf{w}_y^\top \mathbf{z}_G + b_y, \qquad
        \hat{f}_G = \mathbf{w}_f^\top \mathbf{z}_G + b_f

    over layer nodes :math:`l`, device nodes :math:`d` and graph scalars :math:`\mathbf{g}_G`.
    :math:`\hat{y}` estimates :math:`\log(T / T_{lb}) \geq 0` and :math:`\sigma(\hat{f})` the
    probability that the plan fits in memory. With `prior` (the default) the value head predicts
    a correction to the closed-form estimate :math:`g_{G,\mathrm{prior}} = \log(T_{est} / T_{lb})`
    of `cost.estimate` (graph column `features.PRIOR_FEATURE`); without it, the whole value.

    Args:
        hidden (int): width of every node embedding; divisible by `heads`. (default: 64)
        layers (int): rounds of message passing. (default: 3)
        heads (int): attention heads per GATv2 convolution. (default: 2)
        dropout (float): dropout after each round, in training mode. (default: 0.0)
        prior (bool): add the closed-form estimate to the value head's output. (default: True)

    Shapes:
        - **input:** a `HeteroData` from `features.featurize`, or a `Batch` of B of them:
          layer features :math:`(|\mathcal{V}_l|, F_l)`, device features :math:`(|\mathcal{V}_d|, F_d)`,
          edge indices :math:`(2, |\mathcal{E}_r|)`, edge attributes :math:`(|\mathcal{E}_r|, D_r)`,
          `graph_attr` :math:`(B, G)`, batch vectors :math:`(|\mathcal{V}_t|)` (absent for one graph)
        - **output:** `(value, fit_logit)`, each :math:`(B)`
    """

    def __init__(self, *, hidden: int = 64, layers: int = 3, heads: int = 2, dropout: float = 0.0,
                 prior: bool = True) -> None:
        super().__init__()
        if hidden < 1 or layers < 0 or heads < 1 or hidden % heads:
            raise ValueError(f"PlanGNN: need hidden >= 1 divisible by heads >= 1 and layers >= 0; got "
                             f"hidden={hidden}, heads={heads}, layers={layers}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"PlanGNN: dropout must be in [0, 1), got {dropout}")
        self.config: dict[str, Any] = {"hidden": hidden, "layers": layers, "heads": heads, "dropout": dropout,
                                       "prior": prior}
        self.dropout, self.prior = dropout, prior
        self.encoders = nn.ModuleDict({t: nn.Linear(NODE_DIMS[t], hidden) for t in NODE_TYPES})
        self.convs = nn.ModuleList([
            HeteroConv({et: GATv2Conv((hidden, hidden), hidden // heads, heads=heads, edge_dim=EDGE_DIMS[et],
                                      add_self_loops=False) for et in EDGE_TYPES}, aggr="sum")
            for _ in range(layers)
        ])
        self.norms = nn.ModuleList([nn.ModuleDict({t: nn.LayerNorm(hidden) for t in NODE_TYPES})
                                    for _ in range(layers)])
        self.readout = nn.Sequential(nn.Linear(4 * hidden + GRAPH_DIM, hidden), nn.ReLU(),
                                     nn.Linear(hidden, hidden), nn.ReLU())
        self.value_head = nn.Linear(hidden, 1)
        self.fit_head = nn.Linear(hidden, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise every learnable parameter; with `prior`, the value head starts at zero,
        so that an untrained model predicts the closed-form estimate itself."""
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is not self and callable(reset):
                reset()
        if self.prior:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def _update(self, norm: nn.Module, h: Tensor, message: Tensor | None) -> Tensor:
        """h <- Dropout(ReLU(LayerNorm(h + m))), with m = 0 when no relation sent the node type messages."""
        h = norm(h if message is None else h + message)
        return functional.dropout(functional.relu(h), self.dropout, self.training)

    def forward(self, data: HeteroData | Batch) -> tuple[Tensor, Tensor]:
        """(predicted log(T / T_lb), fit logit), one of each per graph."""
        x = {t: self.encoders[t](data[t].x) for t in NODE_TYPES}  # [V_t, hidden]
        for conv, norms in zip(self.convs, self.norms, strict=True):
            messages = conv(x, data.edge_index_dict, edge_attr_dict=data.edge_attr_dict)
            x = {t: self._update(cast(nn.ModuleDict, norms)[t], x[t], messages.get(t)) for t in NODE_TYPES}
        graphs = data.graph_attr.size(0)
        pooled = [pool(x[t], _batch(data, t), size=graphs) for t in (LAYER, DEVICE)
                  for pool in (global_mean_pool, global_max_pool)]  # 4 x [B, hidden]
        z = self.readout(torch.cat([*pooled, data.graph_attr], dim=-1))  # [B, hidden]
        value = self.value_head(z).squeeze(-1)  # [B]
        if self.prior:
            value = value + data.graph_attr[:, PRIOR_FEATURE]
        return value, self.fit_head(z).squeeze(-1)  # [B], [B]


def _batch(data: HeteroData | Batch, node_type: str) -> Tensor:
    """The graph index of each node of `node_type` (all zeros for a single graph)."""
    store = data[node_type]
    batch = getattr(store, "batch", None)
    return batch if batch is not None else torch.zeros(store.num_nodes, dtype=torch.long, device=store.x.device)


def parameter_count(model: nn.Module) -> int:
    """Number of learnable scalars."""
    return sum(p.numel() for p in model.parameters())


def save_checkpoint(model: PlanGNN, path: str | os.PathLike[str], card: Mapping[str, Any]) -> None:
    """Write `model` (state dict and constructor arguments) and its model `card` to one .pt file.

    The card may hold only str, int, float, bool, None, lists and dicts with str keys, so the file
    loads with `weights_only=True`; TypeError names the first other value. The write is atomic.
    """
    _check_plain(card, "card")
    blob = {
        "format": CHECKPOINT_FORMAT,
        "kwargs": dict(model.config),
        "features": {"nodes": dict(NODE_DIMS), "edges": {"__".join(k): v for k, v in EDGE_DIMS.items()},
                     "graph": GRAPH_DIM},
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "card": dict(card),
    }
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    torch.save(blob, partial)
    partial.replace(target)


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[PlanGNN, dict[str, Any]]:
    """The model (in eval mode, on CPU) and card saved by `save_checkpoint`.

    ValueError when the file is not such a checkpoint or was written for other feature sizes.
    """
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
        found = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"{path}: not a PlanGNN checkpoint (format {found!r}; expected {CHECKPOINT_FORMAT!r})")
    expected = {"nodes": dict(NODE_DIMS), "edges": {"__".join(k): v for k, v in EDGE_DIMS.items()}, "graph": GRAPH_DIM}
    if blob["features"] != expected:
        raise ValueError(f"{path}: written for feature sizes {blob['features']}; this featurizer has {expected}")
    model = PlanGNN(**blob["kwargs"])
    model.load_state_dict(blob["state_dict"])
    model.eval()
    return model, blob["card"]


def _check_plain(value: object, where: str) -> None:
    """Raise TypeError unless `value` is built of JSON-like primitives."""
    if value is None or isinstance(value, str | bool | int | float):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} must be a str")
            _check_plain(item, f"{where}.{key}")
        return
    raise TypeError(f"{where}: {type(value).__name__} is not allowed in a checkpoint card "
                    "(use str, int, float, bool, None, lists and dicts)")
