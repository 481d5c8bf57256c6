"""`tagplan serve --demo` (what `make run` does), `tagplan submit` and `tagplan admin create-key`, as users run them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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
    assert main(["submit", "--model", "/etc/passwd", "--cluster", "p3.8xlarge", "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "submit: model:" in err and "file path" in err
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
