import pytest

from tagplan.cost.memory import model_state_bytes
from tagplan.ir import DType, Optimizer, Workload


@pytest.mark.parametrize(("zero", "expected"), [
    (0, (2.0, 2.0, 12.0)), (1, (2.0, 2.0, 12.0 / 8)), (2, (2.0, 2.0 / 8, 12.0 / 8)), (3, (2.0 / 8, 2.0 / 8, 12.0 / 8)),
])
def test_zero_stages_divide_state_by_dp(zero: int, expected: tuple[float, float, float]) -> None:
    """Mixed-precision Adam: 2 + 2 + 12 bytes per parameter (reference/hardware.md)."""
    assert model_state_bytes(1.0, Workload(), zero=zero, dp=8) == pytest.approx(expected)


def test_optimizer_state_follows_the_workload() -> None:
    assert model_state_bytes(1.0, Workload(dtype=DType.FP32, optimizer=Optimizer.SGD), zero=0, dp=1) == (4, 4, 0)
    assert model_state_bytes(1.0, Workload(optimizer=Optimizer.SGD_MOMENTUM), zero=0, dp=1)[2] == 8
