"""Report: what the simulator predicts for one plan (the JSON keys are a contract)."""

from __future__ import annotations

from pydantic import Field

from tagplan.ir.base import Record


class Breakdown(Record):
    """Where the critical device's iteration goes, in seconds; the parts sum to the iteration time."""

    compute: float = Field(ge=0)
    tp_comm: float = Field(ge=0)
    dp_comm: float = Field(ge=0)
    pp_comm: float = Field(ge=0)
    bubble: float = Field(ge=0)
    optimizer: float = Field(ge=0)

    @property
    def total_s(self) -> float:
        """Sum of the parts (seconds)."""
        return self.compute + self.tp_comm + self.dp_comm + self.pp_comm + self.bubble + self.optimizer


class DeviceMemoryReport(Record):
    """Peak memory of one device of the plan, by part (bytes); `mem_bytes` is the device's memory
    (`DeviceSpec.mem_bytes`, the one name for it), `memory_bytes` the plan's peak use of it."""

    device: int
    type: str
    memory_bytes: float
    mem_bytes: float
    fits: bool
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    other_bytes: float


class StageReport(Record):
    """Per pipeline stage: per-micro-batch times of its slowest replica and its sync."""

    index: int
    layers: tuple[int, int]
    dp: int
    tp: int
    cp: int = Field(default=1, description="context-parallel degree")
    forward_s: float
    backward_s: float
    tp_comm_s: float = Field(description="tensor- and context-parallel communication inside the stage's tasks")
    dp_sync_s: float
    p2p_s: float
    in_flight: int
    samples_per_micro_batch: float
    memory: DeviceMemoryReport = Field(description="the stage's device with the highest memory_bytes / mem_bytes")
    compute_source: str = Field(default="ops", description="per block kind: the op model or a measured layer profile")


class Report(Record):
    """The simulator's prediction for one iteration of a plan."""

    iteration_time_s: float
    throughput_samples_s: float
    tokens_per_s: float
    tflops_per_device: float = Field(description="model FLOPs (no recomputation) per device per second / 1e12")
    mfu: float = Field(description="model FLOPs / (iteration time x sum of the devices' dense peaks)")
    peak_memory_bytes: float
    worst_device: int = Field(description="the device with the highest memory_bytes / mem_bytes ratio")
    fits: bool
    breakdown: Breakdown
    devices: tuple[int, ...] = Field(description="the plan's devices, ascending")
    memory_per_device_bytes: tuple[float, ...] = Field(description="peak bytes of each of `devices`")
    worst_device_memory: DeviceMemoryReport
    stages: tuple[StageReport, ...]
    devices_used: int
    model_flops_per_iteration: float
    comm_mode: str = "topology"
