"""`hybridflow export CHECKPOINT_DIR OUT_DIR`: a run's checkpoint as a standard HF checkpoint.

CHECKPOINT_DIR is a `global_step_<k>` directory (its `actor/` holds the sharded DCP checkpoint);
the architecture and tokenizer come from the run's model (`actor_rollout_ref.model.path` in the
run's saved `config.yaml`, or `--model-path`). The output (safetensors weights, config.json,
generation config, tokenizer) loads with `AutoModelForCausalLM.from_pretrained` and vLLM; a
vision-language model's (`models/vlm.py::is_vlm_dir`) with `AutoModelForImageTextToText` and its
processor with `AutoProcessor`. A LoRA run exports a PEFT adapter, or with `--merge` the merged model.
"""

from __future__ import annotations

import argparse
import os


def _run_model_config(ckpt_dir: str, model_path: str | None):
    """The run's `actor_rollout_ref.model` block (its saved config.yaml), `model_path` overriding its path."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.config.schema import ModelConfig
    from hybridflow.run_plan import resolve

    cfg_path = os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), "config.yaml")
    if not os.path.isfile(cfg_path):
        if model_path is None:
            raise SystemExit(f"error: {cfg_path} not found (the run's saved config names the model); pass --model-path")
        return ModelConfig(path=model_path)
    mcfg = resolve(load_config(cfg_path, schema=HybridFlowConfig)).actor.model
    if model_path:
        mcfg.path = model_path
    return mcfg


def _is_lora_checkpoint(actor_dir: str) -> bool:
    from torch.distributed.checkpoint import FileSystemReader

    from hybridflow.models.lora import is_adapter_param

    return any(is_adapter_param(k) for k in FileSystemReader(actor_dir).read_metadata().state_dict_metadata)


def load_actor_weights(actor_dir: str, model) -> None:
    """The actor's DCP shards (a full, non-LoRA checkpoint) into `model`, no process group needed:
    reads exactly the model's keys, whatever the shard layout that wrote them."""
    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=actor_dir, no_dist=True)
    model.load_state_dict(state["model"])


def export_checkpoint(ckpt_dir: str, out_dir: str, model_path: str | None = None, merge: bool = False) -> str:
    """Load the actor's DCP shards (no process group needed) into the HF model and save it.

    A LoRA run's checkpoint holds the adapters only: they are loaded onto the base model and written
    as a PEFT adapter (adapter_model.safetensors + adapter_config.json, for `PeftModel.from_pretrained`
    and vLLM's LoRA requests), or with `merge` merged into the base as a plain HF checkpoint."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from hybridflow.models.vlm import is_vlm_dir, load_processor

    actor_dir = os.path.join(ckpt_dir, "actor")
    if not os.path.isdir(actor_dir):
        raise SystemExit(f"error: {actor_dir} not found: CHECKPOINT_DIR must be a global_step_<k> directory of a run")
    mcfg = _run_model_config(ckpt_dir, model_path)
    vlm = is_vlm_dir(mcfg.path)  # the training FQNs are the image-text-to-text class's
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(mcfg.path)
    if _is_lora_checkpoint(actor_dir):
        if mcfg.lora_rank <= 0:
            raise SystemExit(f"error: {actor_dir} holds LoRA adapters; the run's config.yaml (next to CHECKPOINT_DIR) gives their rank and targets")
        from peft import get_peft_model

        from hybridflow.models.lora import is_adapter_param, lora_config

        peft_model = get_peft_model(model, lora_config(mcfg))
        inner = peft_model.base_model.model  # the HF model with adapters injected: the training FQNs
        state = {"model": {k: v for k, v in inner.state_dict().items() if is_adapter_param(k)}}
        dcp.load(state, checkpoint_id=actor_dir, no_dist=True)
        inner.load_state_dict(state["model"], strict=False)
        if merge:
            peft_model.merge_and_unload().save_pretrained(out_dir, safe_serialization=True)
        else:
            peft_model.save_pretrained(out_dir)
    else:
        load_actor_weights(actor_dir, model)
        model.save_pretrained(out_dir, safe_serialization=True)
    # a VLM's processor holds its tokenizer (and chat template): saved as one, as AutoProcessor reads it back
    (load_processor(mcfg.path) if vlm else AutoTokenizer.from_pretrained(mcfg.tokenizer_source())).save_pretrained(out_dir)
    return out_dir


def main_export(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow export", description="Write a run's checkpoint as an HF checkpoint (safetensors)")
    p.add_argument("checkpoint", help="a global_step_<k> directory")
    p.add_argument("out_dir")
    p.add_argument("--model-path", default=None, help="the run's base model (default: from the run's config.yaml)")
    p.add_argument("--merge", action="store_true", help="LoRA: write the adapters merged into the base (a plain HF checkpoint) "
                                                        "instead of a PEFT adapter")
    a = p.parse_args(argv)
    print(export_checkpoint(a.checkpoint, a.out_dir, a.model_path, a.merge))
    return 0
