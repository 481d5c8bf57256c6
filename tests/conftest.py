"""Suite-wide test settings."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tagplan.export.runtime_fork import RANK_SERVER_ENV, RankServer


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny graphs and tensors gain nothing from intra-op threads; on a busy 2-core machine their
    spin-waits cost up to 100x. Every test runs on one torch thread and restores the setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def keep_umask() -> Iterator[None]:
    """The service's commands set umask 077 for their process (`service.settings.private_files`); a test that runs
    one in-process gets the pytest process's umask back."""
    umask = os.umask(0o022)
    os.umask(umask)
    yield
    os.umask(umask)


@pytest.fixture(scope="session")
def rank_server() -> Iterator[Path]:
    """One rank server per test process (`tagplan.export.runtime_fork`), named in the environment, so
    that `launch` (in this process and in the `tagplan` commands it starts) forks each rank of an
    exported program from it instead of importing torch again: 4-6 s of CPU per rank, 45% of the
    suite's time before. The ranks are still processes of their own that join gloo; the plain start
    is tested in tests/export/test_runtime_fork.py. Test modules that run ranks use it."""
    with RankServer() as server:
        before = os.environ.get(RANK_SERVER_ENV)
        os.environ[RANK_SERVER_ENV] = str(server.socket_path)
        try:
            yield server.socket_path
        finally:
            if before is None:
                os.environ.pop(RANK_SERVER_ENV, None)
            else:
                os.environ[RANK_SERVER_ENV] = before
