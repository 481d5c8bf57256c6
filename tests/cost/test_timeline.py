import json

from tagplan.cost.simulator import Simulator
from tagplan.cost.timeline import chrome_trace
from tagplan.frontends.cluster_spec import load_cluster
from tagplan.frontends.model_spec import load_model
from tagplan.ir import Plan, Stage, Workload


def test_chrome_trace_has_every_task_on_its_lane_in_microseconds() -> None:
    sim = Simulator(load_model("gpt?layers=4&hidden=256&heads=4&vocab=100", seq_len=64), load_cluster("dgx-a100-80gb"),
                    Workload(global_batch=8, seq_len=64))
    plan = Plan(micro_batches=4, stages=(Stage(layers=(0, 3), devices=(0, 1, 2, 3), dp=2, tp=2),
                                         Stage(layers=(3, 6), devices=(4, 5, 6, 7), dp=2, tp=2)))
    result = sim.run(plan)
    trace = json.loads(json.dumps(chrome_trace(result)))  # plain JSON, as Perfetto reads it
    tasks = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert len(tasks) == 2 * 2 * 4  # stages x phases x micro-batches
    assert {e["pid"] for e in tasks} == {0, 1}
    last = max(e["ts"] + e["dur"] for e in trace["traceEvents"] if e["ph"] == "X")
    assert last == __import__("pytest").approx(result.report.iteration_time_s * 1e6, rel=1e-6)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["lane 0: devices 0-3", "lane 1: devices 4-7"]
