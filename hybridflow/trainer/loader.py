"""A resumable prompt loader: seeded shuffle per epoch, position saved in checkpoints."""

from __future__ import annotations

from typing import Callable

import torch

from hybridflow.protocol import Batch


class PromptLoader:
    def __init__(self, dataset, batch_size: int, collate: Callable[[list[dict]], Batch], shuffle: bool = True, seed: int = 1):
        if len(dataset) < batch_size:
            from hybridflow.data.dataset import DataError

            raise DataError(f"the dataset has {len(dataset)} prompts, fewer than data.train_batch_size={batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate = collate
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches already taken from this epoch

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size  # the last partial batch is dropped

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def next_batch(self) -> Batch:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        order = self._order()
        start = self.position * self.batch_size
        self.position += 1
        return self.collate([self.dataset[i] for i in order[start : start + self.batch_size]])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
