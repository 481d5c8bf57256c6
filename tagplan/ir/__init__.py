"""Plain typed data at the centre of tagplan: models, clusters, workloads, plans. No torch, no I/O."""

from tagplan.ir.cluster import Cluster, Device, DeviceSpec, Link, LinkKind, Network, Node, PairLink
from tagplan.ir.model import Block, Layer, ModelGraph, Op, OpKind, PartitionDim
from tagplan.ir.plan import Plan, Schedule, ShardStrategy, Stage, check_plan, check_whole_samples
from tagplan.ir.workload import DType, LossKernel, Optimizer, Workload

__all__ = [
    "Block", "Cluster", "DType", "Device", "DeviceSpec", "Layer", "Link", "LinkKind", "LossKernel",
    "ModelGraph", "Network", "Node", "Op", "OpKind", "Optimizer", "PairLink", "PartitionDim",
    "Plan", "Schedule", "ShardStrategy", "Stage", "Workload", "check_plan", "check_whole_samples",
]
