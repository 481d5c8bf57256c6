"""Timeline of a simulated iteration as Chrome trace JSON (open it in Perfetto or chrome://tracing).

One process per pipeline lane (a stage's device group), with a compute track (forward and
backward tasks per micro-batch) and a sync track (data-parallel gradient sync, optimizer step).
Times are microseconds, as the trace format requires.
"""

from __future__ import annotations

from typing import Any

from tagplan.cost.pipeline import Phase
from tagplan.cost.simulator import Simulation
from tagplan.ir.summary import device_ranges

_US = 1e6


def chrome_trace(sim: Simulation) -> dict[str, Any]:
    """The simulation as a Chrome trace document: `{"traceEvents": [...], "displayTimeUnit": "ms"}`."""
    events: list[dict[str, Any]] = []
    for lane, devices in enumerate(sim.lanes):
        name = f"lane {lane}: devices {device_ranges(devices)}"
        events.append({"name": "process_name", "ph": "M", "pid": lane, "args": {"name": name}})
        events.append({"name": "thread_name", "ph": "M", "pid": lane, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": lane, "tid": 1, "args": {"name": "sync"}})
    for task in sim.pipeline.tasks:
        letter = "F" if task.phase is Phase.FORWARD else "B"
        events.append({"name": f"{letter}{task.micro_batch}", "cat": task.phase.value, "ph": "X", "pid": task.lane,
                       "tid": 0, "ts": task.start_s * _US, "dur": (task.end_s - task.start_s) * _US,
                       "args": {"stage": task.stage, "micro_batch": task.micro_batch}})
    for lane, (end, dp, optimizer) in enumerate(sim.lane_tail_s):
        if dp > 0:
            events.append({"name": "gradient sync (exposed)", "cat": "dp_comm", "ph": "X", "pid": lane, "tid": 1,
                           "ts": end * _US, "dur": dp * _US})
        events.append({"name": "optimizer step", "cat": "optimizer", "ph": "X", "pid": lane, "tid": 1,
                       "ts": (end + dp) * _US, "dur": optimizer * _US})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"iteration_time_s": sim.report.iteration_time_s, "producer": "tagplan"}}
