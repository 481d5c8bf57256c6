"""Suite-wide test settings."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny graphs and tensors gain nothing from intra-op threads; on a busy 2-core machine their
    spin-waits cost up to 100x. Every test runs on one torch thread and restores the setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
