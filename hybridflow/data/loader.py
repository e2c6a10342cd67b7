"""The prompt loader: `PromptLoader` (any dataset + collate fn) and `make_rl_data_loader` (verl
parquet rows -> left-padded prompt batches).

    loader = make_rl_data_loader(["train.parquet"], tokenizer, batch_size=8, max_prompt_length=64)
    loader = make_rl_data_loader(config=cfg)           # data.* and the actor's tokenizer from a HybridFlowConfig
    batch = loader.next_batch()                        # Batch: input_ids/attention_mask/position_ids [B, P] + sample info

Resumable: `loader.state_dict()` / `load_state_dict()` (epoch, position); seeded shuffle per epoch.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridflow.data.dataset import DataError, RLDataset, collate_rl
from hybridflow.protocol import Batch


class PromptLoader:
    """Batches of `collate`d dataset items; the last partial batch of an epoch is dropped."""

    def __init__(self, dataset, batch_size: int, collate: Callable[[list[dict]], Batch], shuffle: bool = True, seed: int = 1):
        if len(dataset) < batch_size:
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


def make_rl_data_loader(files=None, tokenizer=None, batch_size: int = 8, max_prompt_length: int = 64, *, config=None,
                        shuffle: bool = True, seed: int = 1, prompt_key: str = "prompt", filter_overlong_prompts: bool = True,
                        truncation: str = "error") -> PromptLoader:
    if config is not None:
        from transformers import AutoTokenizer

        d = config.data
        files, batch_size, max_prompt_length = files or d.train_files, d.train_batch_size, d.max_prompt_length
        shuffle, seed, prompt_key, filter_overlong_prompts, truncation = d.shuffle, d.seed, d.prompt_key, d.filter_overlong_prompts, d.truncation
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.policy_tokenizer_path())
    if files is None or tokenizer is None:
        raise ValueError("make_rl_data_loader needs files and a tokenizer, or config=")
    dataset = RLDataset(files, tokenizer, max_prompt_length, prompt_key, filter_overlong_prompts, truncation)
    return PromptLoader(dataset, batch_size, lambda items: collate_rl(items, tokenizer.pad_token_id, max_prompt_length), shuffle, seed)
