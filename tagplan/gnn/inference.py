"""A `PlanGNN`'s forward pass on folded graphs (`gnn.quotient`), its relations fused for speed.

`PlanGNN.forward` (PyG's `HeteroConv` of four `GATv2Conv`s per round) is what training runs;
at search time its cost is mostly per-operation overhead on small graphs (a prior call scores
two or three plans), and its edges mostly say the same thing many times over (every layer to
every device of its stage). `FastForward(model)` computes the same function of the same
weights on folded graphs, with the four relations of each round in one set of tensor operations:

- one linear map per node type gives every relation's sender and receiver projections;
- the edge attributes of every relation and round are projected once per batch (block-diagonal);
- one grouped softmax over (relation, receiver) with log(multiplicity) added to the logits;
- one scatter-sum of the messages, summed per node type over its incoming relations.

Eval only: the message-passing weights are stacked when it is built (the encoders, norms and
heads are the model's own), so build a new one after changing the weights, e.g. by training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional
from torch_geometric.nn import GATv2Conv, HeteroConv
from torch_geometric.utils import scatter, softmax

from tagplan.gnn.features import DEVICE, EDGE_DIMS, EDGE_TYPES, LAYER, NODE_TYPES, PRIOR_FEATURE
from tagplan.gnn.model import PlanGNN
from tagplan.gnn.quotient import FoldedGraph

_SENDS = {t: [et for et in EDGE_TYPES if et[0] == t] for t in NODE_TYPES}  # relations by sender type
_RECEIVES = {t: [et for et in EDGE_TYPES if et[2] == t] for t in NODE_TYPES}  # by receiver type
_ATTR_START = dict(zip(EDGE_TYPES, np.cumsum([0] + [EDGE_DIMS[et] for et in EDGE_TYPES]).tolist(), strict=False))
_ATTR_WIDTH = sum(EDGE_DIMS.values()) + len(EDGE_TYPES)  # every relation's columns, then a one-hot for its bias


@dataclass(frozen=True)
class _Round:
    """One round's weights, stacked across relations."""

    weight: dict[str, Tensor]  # per node type: [(sends + receives) * hidden, hidden]
    bias: dict[str, Tensor]
    out_bias: dict[str, Tensor]  # per receiver type: the sum of its relations' output biases [hidden]
    norms: nn.ModuleDict
    negative_slope: float


@dataclass(frozen=True)
class _Batch:
    """Folded graphs concatenated, with the fused index tables."""

    x: dict[str, Tensor]
    edge_proj: Tensor  # [E, rounds, hidden]: every round's edge-attribute projection
    att: Tensor  # [E, rounds, hidden]: every round's attention vector of the edge's relation (heads concatenated)
    sender: Tensor  # [E] row in the stacked sender table
    receiver: Tensor  # [E] row in the stacked receiver table: a (relation, node) pair
    log_count: Tensor  # [E]
    receivers: int  # rows of the receiver table
    graph_of: dict[str, Tensor]  # per node type: its graph
    device_count: Tensor  # [V_d, 1]
    graph_attr: Tensor  # [B, G]


class FastForward:
    """`model`'s (value, fit_logit) on folded graphs, as `PlanGNN.forward` gives on the full ones."""

    def __init__(self, model: PlanGNN) -> None:
        off_cpu = sorted({p.device.type for p in model.parameters()} - {"cpu"})
        if off_cpu:
            raise ValueError(f"FastForward: runs on the CPU; the model's parameters are on {off_cpu} "
                             "(use GNNScorer(model, folded=False) to run the model on its device)")
        self.model = model
        self.hidden = int(model.config["hidden"])
        self.heads = int(model.config["heads"])
        rounds = []
        edge_weight, att = [], []
        with torch.no_grad():
            for hetero, norms in zip(model.convs, model.norms, strict=True):
                convs = {et: cast(GATv2Conv, cast(HeteroConv, hetero).convs[et]) for et in EDGE_TYPES}
                if any(c.res is not None or not c.concat or c.add_self_loops or c.share_weights
                       or c.negative_slope != convs[EDGE_TYPES[0]].negative_slope for c in convs.values()):
                    raise ValueError("FastForward: needs GATv2Conv without residual, self loops or shared "
                                     "weights, heads concatenated (as PlanGNN builds it)")
                weight, bias = {}, {}
                for t in NODE_TYPES:
                    lins = [convs[et].lin_l for et in _SENDS[t]] + [convs[et].lin_r for et in _RECEIVES[t]]
                    weight[t] = torch.cat([lin.weight for lin in lins])
                    bias[t] = torch.cat([lin.bias if lin.bias is not None else torch.zeros(lin.weight.size(0))
                                         for lin in lins])
                edge = torch.zeros(self.hidden, _ATTR_WIDTH)
                for r, et in enumerate(EDGE_TYPES):
                    lin_edge = cast(nn.Linear, convs[et].lin_edge)
                    start = _ATTR_START[et]
                    edge[:, start:start + EDGE_DIMS[et]] = lin_edge.weight
                    if lin_edge.bias is not None:
                        edge[:, _ATTR_WIDTH - len(EDGE_TYPES) + r] = lin_edge.bias
                edge_weight.append(edge)
                att.append(torch.cat([convs[et].att.reshape(1, -1) for et in EDGE_TYPES]))  # [relations, H]
                out_bias = {t: sum((convs[et].bias for et in _RECEIVES[t] if convs[et].bias is not None),
                                   torch.zeros(self.hidden)) for t in NODE_TYPES}
                rounds.append(_Round(weight, bias, out_bias, cast(nn.ModuleDict, norms),
                                     float(convs[EDGE_TYPES[0]].negative_slope)))
        self.rounds = rounds
        self.edge_weight = torch.cat(edge_weight) if edge_weight else torch.zeros(0, _ATTR_WIDTH)  # [R*H, W]
        self.att = torch.stack(att, dim=1) if att else torch.zeros(len(EDGE_TYPES), 0, self.hidden)  # [rel, R, H]

    def __call__(self, graphs: Sequence[FoldedGraph]) -> tuple[Tensor, Tensor]:
        """(predicted log(T / T_lb), fit logit), one of each per graph."""
        model = self.model  # nothing below depends on train / eval mode (no dropout, no batch norm)
        with torch.no_grad():
            batch = self._collate(graphs)
            x = {t: model.encoders[t](batch.x[t]) for t in NODE_TYPES}
            for k, rnd in enumerate(self.rounds):
                messages = self._messages(rnd, x, batch, k)
                x = {t: functional.relu(rnd.norms[t](x[t] + messages[t])) for t in NODE_TYPES}
            size = len(graphs)
            w = batch.device_count
            pooled = [
                scatter(x[LAYER], batch.graph_of[LAYER], dim=0, dim_size=size, reduce="mean"),
                scatter(x[LAYER], batch.graph_of[LAYER], dim=0, dim_size=size, reduce="max"),
                scatter(x[DEVICE] * w, batch.graph_of[DEVICE], dim=0, dim_size=size, reduce="sum")
                / scatter(w, batch.graph_of[DEVICE], dim=0, dim_size=size, reduce="sum"),
                scatter(x[DEVICE], batch.graph_of[DEVICE], dim=0, dim_size=size, reduce="max"),
            ]
            z = model.readout(torch.cat([*pooled, batch.graph_attr], dim=-1))
            value = model.value_head(z).squeeze(-1)
            if model.prior:
                value = value + batch.graph_attr[:, PRIOR_FEATURE]
            return value, model.fit_head(z).squeeze(-1)

    def _messages(self, rnd: _Round, x: dict[str, Tensor], batch: _Batch, k: int) -> dict[str, Tensor]:
        """Every node's summed GATv2 messages of round `k`, all relations at once."""
        hidden, heads = self.hidden, self.heads
        senders, receivers = [], []
        for t in NODE_TYPES:
            projected = functional.linear(x[t], rnd.weight[t], rnd.bias[t])  # [V_t, (sends + receives) * H]
            n_send = len(_SENDS[t]) * hidden
            senders.append(projected[:, :n_send].reshape(-1, hidden))  # row v * sends + j
            receivers.append(projected[:, n_send:].reshape(-1, hidden))
        x_l = torch.cat(senders).index_select(0, batch.sender)  # [E, H]
        x_r = torch.cat(receivers).index_select(0, batch.receiver)
        mixed = functional.leaky_relu(x_l + x_r + batch.edge_proj[:, k], rnd.negative_slope)
        logit = (mixed * batch.att[:, k]).view(-1, heads, hidden // heads).sum(dim=-1) \
            + batch.log_count.unsqueeze(-1)  # [E, heads]
        alpha = softmax(logit, batch.receiver, num_nodes=batch.receivers)
        message = (x_l.view(-1, heads, hidden // heads) * alpha.unsqueeze(-1)).view(-1, hidden)
        summed = scatter(message, batch.receiver, dim=0, dim_size=batch.receivers, reduce="sum")
        out, start = {}, 0
        for t in NODE_TYPES:
            n, m = batch.x[t].size(0), len(_RECEIVES[t])
            out[t] = summed[start:start + n * m].view(n, m, hidden).sum(dim=1) + rnd.out_bias[t]
            start += n * m
        return out

    def _collate(self, graphs: Sequence[FoldedGraph]) -> _Batch:
        """Concatenate the graphs and build the stacked sender / receiver rows of every edge."""
        x = {LAYER: np.concatenate([g.layer_x for g in graphs]), DEVICE: np.concatenate([g.device_x for g in graphs])}
        sizes = {LAYER: [len(g.layer_x) for g in graphs], DEVICE: [len(g.device_x) for g in graphs]}
        offset = {t: np.concatenate([[0], np.cumsum(sizes[t])[:-1]]).astype(np.int64) for t in NODE_TYPES}
        total = {t: int(sum(sizes[t])) for t in NODE_TYPES}
        send_base = {LAYER: 0, DEVICE: total[LAYER] * len(_SENDS[LAYER])}
        recv_base = {LAYER: 0, DEVICE: total[LAYER] * len(_RECEIVES[LAYER])}
        attr, relation, sender, receiver, log_count = [], [], [], [], []
        for r, et in enumerate(EDGE_TYPES):
            src_t, _, dst_t = et
            s_slot, d_slot = _SENDS[src_t].index(et), _RECEIVES[dst_t].index(et)
            for g, (src_off, dst_off) in enumerate(zip(offset[src_t], offset[dst_t], strict=True)):
                edges = graphs[g].edges[et]
                n = edges.index.shape[1]
                if n == 0:
                    continue
                block = np.zeros((n, _ATTR_WIDTH), dtype=np.float32)
                block[:, _ATTR_START[et]:_ATTR_START[et] + EDGE_DIMS[et]] = edges.attr
                block[:, _ATTR_WIDTH - len(EDGE_TYPES) + r] = 1.0
                attr.append(block)
                relation.append(np.full(n, r, dtype=np.int64))
                sender.append(send_base[src_t] + (edges.index[0] + src_off) * len(_SENDS[src_t]) + s_slot)
                receiver.append(recv_base[dst_t] + (edges.index[1] + dst_off) * len(_RECEIVES[dst_t]) + d_slot)
                log_count.append(edges.log_count)
        attr_t = torch.from_numpy(np.concatenate(attr))
        edge_proj = functional.linear(attr_t, self.edge_weight).view(len(attr_t), len(self.rounds), self.hidden)
        graph_of = {t: torch.from_numpy(np.repeat(np.arange(len(graphs)), sizes[t])) for t in NODE_TYPES}
        return _Batch(
            x={t: torch.from_numpy(x[t]) for t in NODE_TYPES}, edge_proj=edge_proj,
            att=self.att.index_select(0, torch.from_numpy(np.concatenate(relation))),
            sender=torch.from_numpy(np.concatenate(sender)),
            receiver=torch.from_numpy(np.concatenate(receiver)),
            log_count=torch.from_numpy(np.concatenate(log_count)),
            receivers=sum(total[t] * len(_RECEIVES[t]) for t in NODE_TYPES), graph_of=graph_of,
            device_count=torch.from_numpy(np.concatenate([g.device_count for g in graphs])).unsqueeze(-1),
            graph_attr=torch.from_numpy(np.stack([g.graph_attr for g in graphs])))
