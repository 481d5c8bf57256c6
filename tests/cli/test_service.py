"""`tagplan serve --demo` (what `make run` does), `tagplan submit` and `tagplan admin create-key`, as users run them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tagplan.cli import main


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_create_key_prints_a_key_that_authenticates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from tagplan.service.db import make_engine
    from tagplan.service.keys import authenticate
    from tagplan.service.settings import Settings

    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))
    monkeypatch.delenv("TAGPLAN_DATABASE_URL", raising=False)
    assert main(["admin", "create-key", "--tenant", "acme"]) == 0
    key = capsys.readouterr().out.strip()
    principal = authenticate(make_engine(Settings.from_env().database_url), key)
    assert principal is not None and principal.tenant == "acme" and not principal.admin
    assert main(["submit", "--model", "gpt3-125m", "--cluster", "p3.8xlarge", "--url", "http://127.0.0.1:9"]) == 2


def test_submit_checks_the_request_with_the_service_s_model_before_sending(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))  # no key anywhere: the request is refused first
    assert main(["submit", "--model", str(tmp_path / "missing.json"), "--cluster", "p3.8xlarge",
                 "--url", "http://127.0.0.1:9"]) == 2
    assert "missing.json" in capsys.readouterr().err
    topo = tmp_path / "topo.txt"
    topo.write_text("GPU0 X\n")
    assert main(["submit", "--model", "gpt3-125m", "--cluster", str(topo), "--url", "http://127.0.0.1:9"]) == 2
    assert "submit: cluster:" in capsys.readouterr().err  # a topology dump is read here, and this one is bad
    assert main(["submit", "--model", "gpt3-125m", "--cluster", "p3.8xlarge:nodes=x", "--key", "tp_x",
                 "--url", "http://127.0.0.1:9"]) == 2
    assert "submit: cluster:" in capsys.readouterr().err


@pytest.mark.slow
def test_serve_demo_plans_the_example_and_submit_reaches_it(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "TAGPLAN_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    env.pop("TAGPLAN_DATABASE_URL", None)
    serve = subprocess.Popen([sys.executable, "-m", "tagplan.cli", "serve", "--demo", "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 240
        assert serve.stdout is not None
        while time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("stop the service"):
                break
        out = "".join(lines)
        assert "best plan:" in out and "baseline megatron" in out, out
        assert f"http://127.0.0.1:{port}/#/jobs/" in out
        key = (tmp_path / "local.key").read_text().strip()
        submitted = subprocess.run([sys.executable, "-m", "tagplan.cli", "submit", "--model",
                                    "gpt?layers=2&hidden=64&heads=4&vocab=100", "--seq", "16", "--cluster",
                                    "p3.8xlarge", "--max-evaluations", "20", "--wait", "--url",
                                    f"http://127.0.0.1:{port}", "--key", key], capture_output=True, text=True,
                                   timeout=180, env=env)
        assert submitted.returncode == 0, submitted.stderr
        assert "best plan:" in submitted.stdout
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=30)


USER_MODULE = """import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def make():
    return Net(), (torch.empty(2, 16, 32),)
"""
CLUSTER_YAML = """node_groups:
  - preset: p3.8xlarge
    nodes: 1
"""


@pytest.fixture
def live_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """A real server (uvicorn on a loopback port, in a thread) on a fresh home: (url, key)."""
    import uvicorn

    from tagplan.service.app import create_app
    from tagplan.service.db import make_engine
    from tagplan.service.keys import create_key
    from tagplan.service.settings import Settings

    monkeypatch.setenv("TAGPLAN_HOME", str(tmp_path))
    monkeypatch.delenv("TAGPLAN_DATABASE_URL", raising=False)
    settings = Settings.from_env()
    key = create_key(make_engine(settings.database_url), "acme")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", key
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def _stored_request(url: str, key: str, job_id: str) -> dict[str, object]:
    from tagplan.service.db import make_engine
    from tagplan.service.settings import Settings
    from tagplan.service.store import JobStore

    settings = Settings.from_env()
    job = JobStore(make_engine(settings.database_url), settings)._get(job_id)
    assert job is not None and job.status == "queued"
    return job.request


def test_submit_sends_local_files_inline(live_service: tuple[str, str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from tagplan.frontends.model_spec import load_model

    url, key = live_service
    graph = tmp_path / "mylm.json"
    graph.write_text(load_model("gpt?layers=2&hidden=64&heads=4&vocab=100", seq_len=16).to_json())
    cluster = tmp_path / "mixed.yaml"
    cluster.write_text(CLUSTER_YAML)
    module = tmp_path / "lm.py"
    module.write_text(USER_MODULE)
    submitted = []
    for model in (str(graph), f"{module}:make"):
        capsys.readouterr()
        assert main(["submit", "--model", model, "--cluster", str(cluster), "--max-evaluations", "5",
                     "--url", url, "--key", key]) == 0, capsys.readouterr().err
        job = json.loads(capsys.readouterr().out)
        assert job["status"] == "queued"
        submitted.append(_stored_request(url, key, job["id"]))
    from_file, traced = submitted
    assert isinstance(from_file["model"], dict) and from_file["model"] == json.loads(graph.read_text())
    assert from_file["cluster"] == {"name": "mixed", "node_groups": [{"preset": "p3.8xlarge", "nodes": 1}]}
    assert isinstance(traced["model"], dict) and len(traced["model"]["layers"]) >= 3  # the traced graph


def test_submit_builds_topology_dumps_and_cluster_options_locally() -> None:
    from tagplan.cli.service import inline_cluster
    from tagplan.frontends.cluster_file import parse_cluster_data
    from tagplan.frontends.cluster_spec import ClusterOptions, load_cluster

    topo = str(Path(__file__).parents[1] / "frontends" / "fixtures" / "topo_dgx_a100.txt")
    options = ClusterOptions(gpu="A100-SXM-80GB", nodes=2, nic_speed_Gbps=200)
    sent = inline_cluster(topo, options)
    assert isinstance(sent, dict)  # the service reads no file: the cluster goes inline
    local, remote = load_cluster(topo, options), parse_cluster_data(sent)
    assert remote.num_devices == local.num_devices == 16
    assert remote.link(0, 8) == local.link(0, 8) and remote.link(0, 1) == local.link(0, 1)
    assert inline_cluster("p3.8xlarge:nodes=2") == "p3.8xlarge:nodes=2"  # a plain SPEC goes as it is
    assert parse_cluster_data(inline_cluster("p3.8xlarge", ClusterOptions(nodes=3))).num_devices == 12


def test_the_service_s_state_is_its_owner_s_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import stat

    home = tmp_path / "new-home"
    monkeypatch.setenv("TAGPLAN_HOME", str(home))
    monkeypatch.delenv("TAGPLAN_DATABASE_URL", raising=False)
    assert main(["admin", "create-key", "--tenant", "acme"]) == 0  # the first command on a new machine
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    later = home / "traces" / "1"
    later.mkdir(parents=True)  # what the same process creates afterwards (an upload's folder) is private too
    (later / "records.jsonl").write_text("{}")
    assert stat.S_IMODE(later.stat().st_mode) == 0o700
    assert stat.S_IMODE((later / "records.jsonl").stat().st_mode) == 0o600
