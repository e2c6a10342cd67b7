"""`make_rl_data_loader`: the RL prompt loader (verl parquet rows -> left-padded prompt batches).

    loader = make_rl_data_loader(["train.parquet"], tokenizer, batch_size=8, max_prompt_length=64)
    loader = make_rl_data_loader(config=cfg)           # data.* and the actor's tokenizer from a HybridFlowConfig
    batch = loader.next_batch()                        # Batch: input_ids/attention_mask/position_ids [B, P] + sample info

Resumable: `loader.state_dict()` / `load_state_dict()` (epoch, position); seeded shuffle per epoch.
"""

from __future__ import annotations

from hybridflow.data.dataset import RLDataset, collate_rl
from hybridflow.trainer.loader import PromptLoader


def make_rl_data_loader(files=None, tokenizer=None, batch_size: int = 8, max_prompt_length: int = 64, *, config=None,
                        shuffle: bool = True, seed: int = 1, prompt_key: str = "prompt", filter_overlong_prompts: bool = True,
                        truncation: str = "error") -> PromptLoader:
    if config is not None:
        from transformers import AutoTokenizer

        d, m = config.data, config.actor_rollout_ref.model
        files, batch_size, max_prompt_length = files or d.train_files, d.train_batch_size, d.max_prompt_length
        shuffle, seed, prompt_key, filter_overlong_prompts, truncation = d.shuffle, d.seed, d.prompt_key, d.filter_overlong_prompts, d.truncation
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(m.tokenizer_path or m.path)
    if files is None or tokenizer is None:
        raise ValueError("make_rl_data_loader needs files and a tokenizer, or config=")
    dataset = RLDataset(files, tokenizer, max_prompt_length, prompt_key, filter_overlong_prompts, truncation)
    return PromptLoader(dataset, batch_size, lambda items: collate_rl(items, tokenizer.pad_token_id, max_prompt_length), shuffle, seed)
