import json
from pathlib import Path

import pytest

from tagplan.errors import SpecError
from tagplan.frontends.plan_file import load_plan


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(("stages", "needle"), [
    ([{"layers": [0, 2], "devices": [0, 1, 2], "dp": 2, "tp": 2}], r"stages.0: .*dp \* tp = 2 \* 2 = 4 but the stage "
                                                                   r"has 3 devices"),
    ([{"layers": [0, 2], "devices": [0, 1], "dp": 2, "batch_shares": [0.5, 0.6]}], r"stages.0: .*sum to 1"),
    ([{"layers": [0, 2], "devices": [0]}, {"layers": [3, 4], "devices": [1]}], r"stages\[1\].layers starts at 3"),
    ([{"layers": [0, 2], "devices": [0]}, {"layers": [2, 4], "devices": [0]}], "device 0 is in stages 0 and 1"),
    ([{"layers": [0, 2], "devices": [0, 0], "dp": 2}], "devices repeat within a stage"),
    ([{"layers": [0, 2], "devices": [0], "zero": 4}], r"stages.0.zero"),
])
def test_bad_plans_name_the_stage_and_field(tmp_path: Path, stages: list[dict[str, object]], needle: str) -> None:
    with pytest.raises(SpecError, match=needle):
        load_plan(write(tmp_path, {"micro_batches": 2, "schedule": "1f1b", "stages": stages}))


def test_plan_json_v1_example_from_the_docs_loads(tmp_path: Path) -> None:
    doc = (Path(__file__).parents[2] / "docs" / "PLAN_FORMAT.md").read_text()
    example = doc.split("```json")[1].split("```")[0]
    plan = load_plan(write(tmp_path, json.loads(example)))
    assert plan.micro_batches == 8 and plan.stages[1].batch_shares == (0.6, 0.4)
    assert load_plan(write(tmp_path, {"plan": json.loads(example)})) == plan


def test_a_bad_stage_is_reported_once_not_again_as_a_short_list(tmp_path: Path) -> None:
    """Pydantic drops the failing stage and then finds `stages` too short: that second line says nothing new."""
    with pytest.raises(SpecError) as err:
        load_plan(write(tmp_path, {"stages": [{"layers": [0, 5], "devices": [0, 1], "dp": 3}]}))
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and lines[0].startswith("  stages.0: ")
    with pytest.raises(SpecError, match="stages: Tuple should have at least 1 item"):
        load_plan(write(tmp_path, {"stages": []}))  # an empty list is still reported


@pytest.mark.parametrize(("change", "needle"), [
    ({"micro_batches": "2"}, r"micro_batches: Input should be a valid integer"),
    ({"stages": [{"layers": [0, 2], "devices": [0, 1], "dp": "2"}]}, r"stages.0.dp: Input should be a valid integer"),
    ({"stages": [{"layers": [0, 2], "devices": [0], "recompute": "yes"}]}, r"stages.0.recompute: .*valid boolean"),
    ({"micro_batches": 2.5}, r"micro_batches: Input should be a valid integer"),
])
def test_a_plan_file_s_numbers_and_flags_are_not_guessed_from_text(tmp_path: Path, change: dict[str, object],
                                                                   needle: str) -> None:
    base = {"micro_batches": 2, "schedule": "1f1b", "stages": [{"layers": [0, 2], "devices": [0]}]}
    with pytest.raises(SpecError, match=needle):
        load_plan(write(tmp_path, {**base, **change}))
    shares = load_plan(write(tmp_path, {**base, "stages": [{"layers": [0, 2], "devices": [0], "batch_shares": [1]}]}))
    assert shares.stages[0].batch_shares == (1.0,)  # a whole number is a number where a float is asked
