"""The batch keys the RL stages exchange (`hybridflow.trainer.rl` re-exports them).

    PROMPT_KEYS   what generation reads: left-padded prompt token ids, mask, positions
    GEN_OUTPUTS   what generation writes (prompt + response, per-token rollout log-probs)
    TRAIN_KEYS    what every training forward reads
    REWARD_KEYS   what the rule reward reads (responses and the rows' per-sample reward inputs)
"""

from __future__ import annotations

from hybridflow.protocol import Batch

PROMPT_KEYS = ["input_ids", "attention_mask", "position_ids"]
SAMPLE_INFO_KEYS = ["data_source", "reward_model", "extra_info", "raw_prompt"]
REWARD_KEYS = ["responses", "response_mask"] + SAMPLE_INFO_KEYS
GEN_OUTPUTS = ["prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs", "rollout_untruncated_log_probs"]
TRAIN_KEYS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]


def with_sample_info(generated: Batch, prompts: Batch) -> Batch:
    """Attach the prompts' per-sample reward inputs to a generation result (same rows)."""
    for key in SAMPLE_INFO_KEYS:
        generated[key] = prompts[key]
    return generated
