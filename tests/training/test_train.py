from pathlib import Path

import pytest
import torch

from tagplan.datasets.pyg import PlanDataset
from tagplan.datasets.synthetic import generate
from tagplan.errors import SpecError
from tagplan.gnn.model import PlanGNN, load_checkpoint, save_checkpoint
from tagplan.training.train import TrainConfig, evaluate, fit, no_training_samples, pairwise_rank_loss, split, train


def test_pairwise_rank_loss_rewards_the_right_order() -> None:
    target = torch.tensor([1.0, 2.0, 3.0])
    group = torch.tensor([0, 0, 0])
    right = pairwise_rank_loss(torch.tensor([0.1, 0.2, 0.3]), target, group)
    wrong = pairwise_rank_loss(torch.tensor([0.3, 0.2, 0.1]), target, group)
    assert right < wrong
    assert pairwise_rank_loss(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), torch.tensor([0, 1])) == 0


@pytest.mark.slow
def test_training_on_a_tiny_generated_set_lowers_validation_loss(tmp_path: Path) -> None:
    generate(tmp_path / "train", instances=12, plans_per_instance=6, seed=5)
    items = list(PlanDataset(str(tmp_path / "train")))
    config = TrainConfig(epochs=12, hidden=32, layers=2, patience=50, held_out_families=())
    splits = split(items, [], config)
    model = PlanGNN(hidden=32, layers=2, prior=False)  # from scratch: the fit must do all the work
    before = evaluate(model, splits.val)["mse_log"]
    run = fit(model, splits, config)
    after = evaluate(model, splits.val)["mse_log"]
    assert after < before
    assert run["epochs_run"] == 12
    save_checkpoint(model, tmp_path / "m.pt", {"note": "test"})
    again, card = load_checkpoint(tmp_path / "m.pt")
    from torch_geometric.data import Batch

    batch = Batch.from_data_list(splits.val[:4])
    model.eval()
    assert torch.equal(model(batch)[0], again(batch)[0]) and card["note"] == "test"


class Item:
    def __init__(self, family: str, group: int) -> None:
        self.family, self.group = family, group


def test_splits_hold_out_families_and_keep_groups_whole() -> None:
    items = [Item(f, g) for g in range(20) for f in (["t5"] if g % 5 == 0 else ["gpt"])]
    s = split(items, [Item("gpt", 99)], TrainConfig())
    assert {i.family for i in s.test_family} == {"t5"}
    assert not {i.group for i in s.train} & {i.group for i in s.val}
    assert len(s.test_gpu) == 1


def test_one_instance_says_the_validation_split_took_it_and_asks_for_two(tmp_path: Path) -> None:
    generate(tmp_path / "train", instances=1, plans_per_instance=2, seed=0)  # one llama instance, two plans
    with pytest.raises(SpecError, match=r"train: no training samples: all 2 samples are of one instance, and the "
                       r"validation split took it \(it takes 20% of the instances, at least one\); training needs "
                       r"at least 2 instances \(`tagplan dataset generate --instances 2` or more\)$"):
        train(tmp_path, tmp_path / "out", TrainConfig(epochs=1))
    assert not (tmp_path / "out").exists()


def test_no_training_samples_names_the_cause() -> None:
    config, where = TrainConfig(), Path("ds")
    one_left = split([Item("gpt", 0), Item("gpt", 0), Item("t5", 1)], [], config)
    with pytest.raises(SpecError, match=r"all 2 samples of families other than the held-out \('t5', 'cnn'\) "
                       r"are of one instance.*at least 2 instances of families other than"):
        raise no_training_samples(where, one_left, config)
    only_held = split([Item("t5", 0), Item("cnn", 1)], [], config)
    with pytest.raises(SpecError, match=r"all 2 samples are of the held-out families \('t5', 'cnn'\)"):
        raise no_training_samples(where, only_held, config)
    with pytest.raises(SpecError, match=r"ds/train: no samples"):
        raise no_training_samples(where, split([], [], config), config)
