"""Shared inputs of the export tests: a GPT and a Llama SPEC whose 4-layer plans fit on 2-4 processes."""

from pathlib import Path

import pytest

from tagplan.datasets.traces.bundle import read_bundle
from tagplan.ir.cluster import DeviceSpec

BUNDLE = Path(__file__).parents[1] / "fixtures" / "traces" / "cpu-quick"


@pytest.fixture
def gpt_spec() -> str:
    """GPT-2 small's width, two blocks: layers embed, h.0, h.1, head (tied to the embedding)."""
    return "gpt?layers=2&hidden=768&heads=12&vocab=50257"


@pytest.fixture
def llama_spec() -> str:
    """Llama-3-8B's width with grouped-query attention (8 kv heads) and an untied head, two blocks."""
    return "llama?layers=2&hidden=4096&heads=32&kv_heads=8&vocab=128256"


@pytest.fixture
def cpu_device() -> DeviceSpec:
    """The measured CPU of the trace fixture (no bandwidth probe at test time)."""
    return read_bundle(BUNDLE).manifest.device


@pytest.fixture(autouse=True)
def _forked_ranks(request: pytest.FixtureRequest) -> None:
    """Ranks started by the slow tests here (those that run ranks) fork from the session's rank server
    (tests/conftest.py); a run of the quick tests alone starts none."""
    if request.node.get_closest_marker("slow") is not None:
        request.getfixturevalue("rank_server")
