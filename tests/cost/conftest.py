"""Tiny, exactly computable models and clusters for cost-model tests."""

from __future__ import annotations

import pytest

from tagplan.cost.calibration import Calibration, EfficiencyCurve
from tagplan.ir import Block, Cluster, DeviceSpec, Layer, LinkKind, ModelGraph, Network, Node, Op, OpKind

IDEAL_CURVE = EfficiencyCurve(flops=(1.0,), efficiency=(1.0,))


@pytest.fixture
def ideal() -> Calibration:
    """Every op at peak, no launch overhead, full memory bandwidth: op time = FLOPs / peak."""
    return Calibration(name="ideal", compute={"*": {OpKind.MATMUL: IDEAL_CURVE}}, memory_efficiency={"*": 1.0},
                       launch_overhead_s=0.0)


def unit_spec(name: str = "U", peak: float = 1e12, mem_bytes: int = 10**12) -> DeviceSpec:
    """A device with `peak` FLOP/s and effectively unlimited memory bandwidth."""
    return DeviceSpec(name=name, peak_flops_bf16=peak, peak_flops_fp16=peak, peak_flops_fp32=peak,
                      mem_bytes=mem_bytes, mem_bandwidth_Bps=1e30)


def matmul_model(layers: int, flops: float, *, output_bytes: float = 0.0, params: int = 0) -> ModelGraph:
    """`layers` identical layers, each one matmul of `flops` forward FLOPs per sample."""
    op = Op(name="mm", kind=OpKind.MATMUL, flops=flops, bytes_read=0.0, bytes_written=output_bytes,
            param_bytes=2.0 * params, saved_bytes=output_bytes)
    block = Block(hash="b", ops=(op,), params=params, output_bytes=output_bytes)
    return ModelGraph(name="mm", seq_len=1, blocks=(block,),
                      layers=tuple(Layer(name=f"l{i}", block="b") for i in range(layers)))


def flat_cluster(devices: int, *, spec: DeviceSpec | None = None, bandwidth_Bps: float = 1e30,
                 latency_s: float = 0.0) -> Cluster:
    """One node of `devices` devices, all pairs at `bandwidth_Bps` and `latency_s`."""
    node = Node(name="n", device=spec or unit_spec(), gpus=devices, fabric=LinkKind.NVSWITCH,
                fabric_bandwidth_Bps=bandwidth_Bps, fabric_latency_s=latency_s)
    return Cluster(name="flat", nodes=(node,), network=Network(latency_s=latency_s))
