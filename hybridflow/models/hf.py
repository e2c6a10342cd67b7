"""Loading a HuggingFace model from a local path, as every role and the rollout do."""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridflow.config.schema import ModelConfig
from hybridflow.models.vlm import is_vlm_dir

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def load_hf_model(cfg: ModelConfig, device: str, kind: str = "causal_lm", pad_token_id: int | None = None, dtype: str | None = None) -> nn.Module:
    """An HF model from a local path; kind "value" puts a 1-output token head on the backbone,
    kind "reward" is a 1-label sequence classifier (from a classifier checkpoint, or a causal LM's
    backbone with a new score head); it pools at the last non-pad token, so it needs pad_token_id.
    dtype: the weights' dtype (None = cfg.dtype; the rollout passes its generation dtype)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    dtype = DTYPES[dtype or cfg.dtype]
    if kind == "reward":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(cfg.path, num_labels=1)
        if pad_token_id is not None:  # HF pools at the last token != config.pad_token_id: it must be the one batches pad with
            config.pad_token_id = pad_token_id
        model = AutoModelForSequenceClassification.from_pretrained(cfg.path, config=config, dtype=dtype)
    elif kind == "value":
        from transformers import AutoConfig

        # No dropout on the value head (HF's token-classification heads default to 0.1): values feed GAE.
        config = AutoConfig.from_pretrained(cfg.path, num_labels=1)
        config.classifier_dropout = 0.0
        model = AutoModelForTokenClassification.from_pretrained(cfg.path, config=config, dtype=dtype)
    elif is_vlm_dir(cfg.path):  # a vision-language checkpoint (its processor saved beside it): the image-text-to-text class
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(cfg.path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=dtype)
    if cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model.to(device)
