"""The web view end to end: the real app on a loopback port, a plan job run to completion by an
in-process worker, and the job page loaded in headless Chromium; the dumped DOM must hold the
drawings (stage-to-device map, timeline, Pareto chart, baselines table).

The browser test skips where Chromium is not installed; the checks that the app serves the page and
its assets run everywhere (and fail, not skip, if the service cannot be imported).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

MODEL = "gpt?layers=2&hidden=64&heads=4&vocab=100"
CLUSTER = "p3.8xlarge"
CHROMIUM_MISSING = "chromium not installed (apt-get install chromium)"


def _chromium() -> str | None:
    if Path("/usr/bin/chromium").is_file():
        return "/usr/bin/chromium"
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Service:
    url: str
    key: str
    job_id: str
    result: dict[str, Any]


def _request(url: str, key: str | None = None, body: dict[str, Any] | None = None) -> tuple[int, bytes, str]:
    headers = {"Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """The real app (uvicorn in a thread, tmp SQLite) with one succeeded plan job."""
    import uvicorn

    from tagplan.service.app import create_app  # must exist: an ImportError fails the tests
    from tagplan.service.db import make_engine
    from tagplan.service.keys import create_key
    from tagplan.service.settings import Settings
    from tagplan.service.worker import run_worker

    home = tmp_path_factory.mktemp("tagplan-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TAGPLAN_HOME", str(home))
        mp.delenv("TAGPLAN_DATABASE_URL", raising=False)
        settings = Settings.from_env()
        key = create_key(make_engine(settings.database_url), "web-test")

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started:
                assert thread.is_alive(), "uvicorn exited while starting"
                assert time.monotonic() < deadline, "uvicorn did not start within 30 s"
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port}"

            status, body, _ = _request(f"{url}/v1/plans", key,
                                       {"model": MODEL, "cluster": CLUSTER, "max_evaluations": 20})
            assert status == 202, body
            job_id = json.loads(body)["id"]
            run_worker(settings, once=True)
            deadline = time.monotonic() + 120
            while True:
                status, body, _ = _request(f"{url}/v1/jobs/{job_id}", key)
                assert status == 200, body
                job = json.loads(body)
                if job["status"] not in ("queued", "running"):
                    break
                assert time.monotonic() < deadline, f"job still {job['status']} after 120 s"
                time.sleep(0.2)
            assert job["status"] == "succeeded", job
            status, body, _ = _request(f"{url}/v1/jobs/{job_id}/result", key)
            assert status == 200, body
            yield Service(url=url, key=key, job_id=job_id, result=json.loads(body))
        finally:
            server.should_exit = True
            thread.join(timeout=15)
            sock.close()


def test_app_serves_the_web_view(service: Service) -> None:
    status, body, ctype = _request(f"{service.url}/")
    assert status == 200 and ctype.startswith("text/html")
    page = body.decode()
    assert '<main id="main"' in page and "/static/app.js" in page and "/static/style.css" in page
    for asset, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        status, body, ctype = _request(f"{service.url}/static/{asset}")
        assert status == 200 and kind in ctype and len(body) > 1000, (asset, status, ctype)
    # no third-party fetches: every src/href in the page is local
    assert "http://" not in page and "https://" not in page


def test_result_has_what_the_page_draws(service: Service) -> None:
    result = service.result
    assert result["best"]["plan"]["stages"] and result["best"]["report"]["iteration_time_s"] > 0
    assert result["pareto"] and isinstance(result["baselines"], dict)
    assert any(e.get("ph") == "X" for e in result["timeline"]["traceEvents"])
    assert result["request"]["cluster"] == CLUSTER


class _DomIndex(HTMLParser):
    """For each element with a data-testid, the start tags (name, attributes) inside it."""

    VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track",
                      "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, str | None]] = []
        self.inside: dict[str, list[tuple[str, dict[str, str]]]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = {k: v or "" for k, v in attrs}
        for _, testid in self.stack:
            if testid:
                self.inside[testid].append((tag, attributes))
        testid = attributes.get("data-testid")
        if testid:
            self.inside.setdefault(testid, [])
        if tag not in self.VOID:
            self.stack.append((tag, testid))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID and self.stack and self.stack[-1][0] == tag:
            self.stack.pop()

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, -1, -1):  # tolerate stray end tags
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def tags(self, testid: str, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.inside.get(testid, [])
                if t == tag and (cls is None or cls in a.get("class", "").split())]


def _dump_dom(url: str, tmp_path: Path) -> str:
    """The DOM of `url` after headless Chromium ran its scripts (skips without Chromium)."""
    chromium = _chromium()
    if chromium is None:
        pytest.skip(CHROMIUM_MISSING)
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--window-size=1280,800", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=10000", "--dump-dom", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "HOME": str(tmp_path)})
    dom = done.stdout
    assert done.returncode == 0 and "<html" in dom, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
    (tmp_path / "dom.html").write_text(dom)
    return dom


def _device_runs(ids: list[int]) -> str:
    """What the page prints for a stage's devices: runs of +1 steps in plan order ("0-3, 8-11")."""
    runs: list[list[int]] = []
    for d in dict.fromkeys(ids):
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _cells(dom: str, job_id: str) -> dict[str, str]:
    """The text of the classed cells of the job list's row of `job_id`."""
    row = re.search(rf'<tr data-job="{job_id}">(.*?)</tr>', dom, re.S)
    assert row, f"no row for job {job_id} in the job list"
    return {cls: html.unescape(re.sub(r"<[^>]+>", "", text)).strip()
            for cls, text in re.findall(r'<td class="([\w ]+)">(.*?)</td>', row.group(1), re.S)}


DEVICE_CASES = [(list(range(24, 32)), "24-31"), ([0, 1, 2, 3, 8, 9, 10, 11], "0-3, 8-11"), ([5], "5"),
                ([28, 27], "28, 27"), ([28, 29, 30, 31, 24, 25, 26, 27], "28-31, 24-27"), ([], "")]


def test_device_runs_in_plan_order() -> None:
    """`deviceRuns` of app.js (under Node, where installed) and the reference above agree."""
    assert [_device_runs(ids) for ids, _ in DEVICE_CASES] == [text for _, text in DEVICE_CASES]
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js not installed (apt-get install nodejs; .ci/services.sh does): app.js cannot run "
                    "outside a browser; the Chromium job-page test checks the same runs on the rendered page")
    app_js = Path(__file__).resolve().parents[2] / "tagplan" / "service" / "web" / "app.js"
    script = (f"const p = require({json.dumps(str(app_js))}); "
              f"console.log(JSON.stringify({json.dumps([ids for ids, _ in DEVICE_CASES])}.map(p.deviceRuns)));")
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [text for _, text in DEVICE_CASES]


def test_job_list_shows_model_cluster_objective_and_time_in_chromium(service: Service, tmp_path: Path) -> None:
    dom = _dump_dom(f"{service.url}/?key={urllib.parse.quote(service.key)}#/", tmp_path)
    for column in ("model", "cluster", "objective", "iteration"):
        assert re.search(rf"<th [^>]*>{column}</th>", dom), column
    cells = _cells(dom, service.job_id)
    assert cells["model"] == MODEL, cells
    assert (cells["cluster"], cells["objective"]) == (CLUSTER, "time"), cells
    seconds = service.result["best"]["report"]["iteration_time_s"]
    assert re.fullmatch(r"[\d.]+ (µs|ms|s|min)", cells["iteration num"]), cells
    unit = {"µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0}
    number, suffix = cells["iteration num"].split()
    assert float(number) * unit[suffix] == pytest.approx(seconds, rel=0.01), (cells, seconds)


def test_job_page_renders_in_chromium(service: Service, tmp_path: Path) -> None:
    url = f"{service.url}/?key={urllib.parse.quote(service.key)}#/jobs/{service.job_id}"
    dom = _dump_dom(url, tmp_path)
    index = _DomIndex()
    index.feed(dom)
    index.close()
    found = sorted(index.inside)
    assert "result-error" not in index.inside and "need-key" not in index.inside, found

    result = service.result
    best = result["best"]["plan"]
    for testid in ("best-summary", "stage-map", "timeline", "pareto", "baselines"):
        assert testid in index.inside, f"{testid} not rendered; rendered: {found}"

    # stage map: an SVG with one coloured rect per (device, stage) of the chosen plan
    assert index.tags("stage-map", "svg")
    devices = index.tags("stage-map", "rect", "device")
    coloured = {(int(a["data-device"]), int(a["data-stage"])) for a in devices if "data-stage" in a}
    wanted = {(d, s) for s, stage in enumerate(best["stages"]) for d in stage["devices"]}
    assert coloured == wanted
    assert len(index.tags("stage-legend", "li")) == len(best["stages"])

    # timeline: one bar per complete ("X") event of the trace
    assert index.tags("timeline", "svg")
    events = [e for e in result["timeline"]["traceEvents"] if e.get("ph") == "X"]
    assert len(index.tags("timeline", "rect", "bar")) == len(events)

    # Pareto chart: a marker per candidate and baseline, the chosen plan highlighted once
    assert index.tags("pareto", "svg")
    points = index.tags("pareto", "g", "point")
    baselines = [name for name, cand in result["baselines"].items() if cand]
    assert len(points) == len(result["pareto"]) + len(baselines) + 1
    assert len(index.tags("pareto", "g", "best")) == 1

    # baselines table: the chosen plan, then every baseline (simulated or with its reason)
    rows = index.tags("baselines", "tr", "baseline")
    names = set(result["baselines"]) | set(result.get("baseline_reasons", {}))
    assert {r["data-baseline"] for r in rows} == names
    assert len(index.tags("baselines", "tr", "chosen")) == 1
    # each plan's "runs under": the formats whose verdict on it is null (the chosen plan's and each baseline's own)

    def runs(exporters: dict[str, str | None]) -> str:
        return ",".join(f for f, why in exporters.items() if why is None)

    assert index.tags("baselines", "tr", "chosen")[0]["data-runs"] == runs(result["exporters"])
    simulated = {r["data-baseline"]: r["data-runs"] for r in rows if result["baselines"].get(r["data-baseline"])}
    assert simulated and simulated == {name: runs(result["baselines"][name]["exporters"]) for name in simulated}
    assert "runs under</th>" in dom

    # stage legend: each stage's devices as runs in plan order ("24-31", "0-3, 8-11"), never backwards
    legend = {int(a["data-stage"]): a["data-devices"] for a in index.tags("stage-legend", "li")}
    assert legend == {s: _device_runs(stage["devices"]) for s, stage in enumerate(best["stages"])}
    for s, stage in enumerate(best["stages"]):
        assert f"devices {_device_runs(stage['devices'])}</li>" in dom, (s, stage["devices"])
    assert not re.search(r"devices \d+\.\.\d+", dom)

    # downloads: the whole result and the plan alone; the job followed over its event stream
    buttons = {a.get("id") for a in index.tags("downloads", "button")}
    assert {"download", "download-plan"} <= buttons, buttons
    assert ">Download plan JSON</button>" in dom
    # a finished job is drawn from one GET; a queued or running one is followed over the event stream
    assert re.search(r'<div id="job-head"[^>]*data-live="done"', dom), "the finished job was not drawn at once"
    app_js = (Path(__file__).resolve().parents[2] / "tagplan" / "service" / "web" / "app.js").read_text()
    assert 'live("events");\n    const followed = await streamJob(id, gen, show);' in app_js
