import pytest

from tagplan.training.metrics import kendall_tau, mape, top_k_regret


def test_kendall_tau_is_per_group() -> None:
    true = [1.0, 2.0, 3.0, 10.0, 20.0]
    groups = [0, 0, 0, 1, 1]
    assert kendall_tau([1, 2, 3, 5, 6], true, groups) == pytest.approx(1.0)
    assert kendall_tau([3, 2, 1, 6, 5], true, groups) == pytest.approx(-1.0)
    # a perfect order within groups even though the groups' scales differ completely
    assert kendall_tau([100, 200, 300, 0.1, 0.2], true, groups) == pytest.approx(1.0)


def test_mape_and_regret() -> None:
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(0.1)
    true, groups = [1.0, 2.0, 4.0], [0, 0, 0]
    assert top_k_regret([3, 2, 1], true, groups, k=1) == pytest.approx(3.0)  # picked the 4.0 plan
    assert top_k_regret([3, 2, 1], true, groups, k=3) == pytest.approx(0.0)
    assert top_k_regret([1, 2, 3], true, groups, k=1) == pytest.approx(0.0)
