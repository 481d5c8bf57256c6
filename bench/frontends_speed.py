"""Front-end build times: zoo and parametric models (folded) and Hugging Face configs (traced).

Prints a table and writes bench/results/frontends_speed.json. Run: `make bench`.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tagplan.frontends.model_spec import load_model

CASES = [
    ("gpt3-175b", None),
    ("llama3-70b", None),
    ("mixtral-8x7b", None),
    ("t5-11b", None),
    ("gpt?layers=128&hidden=25600&heads=160&vocab=50257", 2048),  # ~1T parameters
    ("hf:GPT2Config", 1024),
    ("hf:LlamaConfig", 2048),
]


def time_build(spec: str, seq: int | None, repeats: int) -> tuple[float, float, int, int]:
    """Median and min wall seconds to build `spec`, its parameter count and layer count."""
    times, graph = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        graph = load_model(spec, seq_len=seq)
        times.append(time.perf_counter() - start)
    assert graph is not None
    return statistics.median(times), min(times), graph.params, len(graph.layers)


def time_cli(args: list[str], repeats: int = 3) -> float:
    """Median wall seconds of the `tagplan` command as a user runs it (a fresh process)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tagplan.cli", *args], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    rows = []
    print(f"{'spec':55s} {'median s':>9s} {'min s':>8s} {'params':>12s} {'layers':>6s}")
    for spec, seq in CASES:
        repeats = 2 if spec.startswith("hf:") else 5
        median, best, params, layers = time_build(spec, seq, repeats)
        rows.append({"spec": spec, "seq_len": seq, "median_s": median, "min_s": best,
                     "params": params, "layers": layers})
        print(f"{spec:55s} {median:9.4f} {best:8.4f} {params / 1e9:11.2f}B {layers:6d}")
    cli = time_cli(["inspect", "model", "gpt3-175b", "--json"])
    print(f"{'CLI: tagplan inspect model gpt3-175b --json':55s} {cli:9.4f}  (whole process, target < 5 s)")
    out = Path(__file__).parent / "results" / "frontends_speed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                               "rows": rows, "cli_inspect_gpt3_175b_s": cli}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
