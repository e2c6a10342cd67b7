"""PromptLoader: seeded per-epoch shuffle, drop-last, epoch wrap, exact resume."""

import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.trainer.loader import PromptLoader

DATASET = [{"id": i, "text": f"p{i}"} for i in range(10)]


def collate(items):
    return Batch.from_dict(tensors={"id": torch.tensor([it["id"] for it in items])}, non_tensors={"text": [it["text"] for it in items]})


def ids(batch):
    return batch["id"].tolist()


def take(loader, n):
    return [ids(loader.next_batch()) for _ in range(n)]


def test_batches_and_collate():
    loader = PromptLoader(DATASET, 3, collate, seed=1)
    b = loader.next_batch()
    assert len(b) == 3 and list(b["text"]) == [f"p{i}" for i in ids(b)]
    assert loader.batches_per_epoch == 3  # 10 // 3, last partial batch dropped


def test_deterministic_for_seed_and_differs_per_epoch():
    a = take(PromptLoader(DATASET, 3, collate, seed=7), 6)
    b = take(PromptLoader(DATASET, 3, collate, seed=7), 6)
    assert a == b
    c = take(PromptLoader(DATASET, 3, collate, seed=8), 6)
    assert a != c
    epoch0, epoch1 = a[:3], a[3:]
    assert epoch0 != epoch1
    # drop-last: each epoch yields 9 distinct prompts, one of the 10 left out
    for ep in (epoch0, epoch1):
        flat = [i for b in ep for i in b]
        assert len(flat) == 9 and len(set(flat)) == 9 and set(flat) <= set(range(10))
    # the epoch orders are the seeded permutations seed+epoch
    for e, ep in enumerate((epoch0, epoch1)):
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(7 + e)).tolist()
        assert [i for b in ep for i in b] == perm[:9]


def test_wraps_epochs():
    loader = PromptLoader(DATASET, 5, collate, shuffle=False)
    assert take(loader, 5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]] * 2 + [[0, 1, 2, 3, 4]]
    assert loader.state_dict() == {"epoch": 2, "position": 1}
    loader = PromptLoader(DATASET, 4, collate, shuffle=False)
    assert take(loader, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]  # 8, 9 dropped


@pytest.mark.parametrize("stop", [0, 1, 2, 3, 4])  # 3 = exactly at an epoch boundary
def test_resume_matches_uninterrupted(stop):
    straight = PromptLoader(DATASET, 3, collate, seed=3)
    expected = take(straight, 8)
    first = PromptLoader(DATASET, 3, collate, seed=3)
    assert take(first, stop) == expected[:stop]
    state = first.state_dict()
    resumed = PromptLoader(DATASET, 3, collate, seed=3)
    resumed.load_state_dict({k: str(v) for k, v in state.items()})  # ints restored from any serialisation
    assert take(resumed, 8 - stop) == expected[stop:]
    assert resumed.state_dict() == straight.state_dict()


def test_dataset_smaller_than_batch():
    with pytest.raises(ValueError, match="train_batch_size=11"):
        PromptLoader(DATASET, 11, collate)
    PromptLoader(DATASET, 10, collate)  # exactly one batch is fine
