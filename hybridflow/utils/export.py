"""`hybridflow export CHECKPOINT_DIR OUT_DIR`: a run's checkpoint as a standard HF checkpoint.

CHECKPOINT_DIR is a `global_step_<k>` directory (its `actor/` holds the sharded DCP checkpoint);
the architecture and tokenizer come from the run's model (`actor_rollout_ref.model.path` in the
run's saved `config.yaml`, or `--model-path`). The output (safetensors weights, config.json,
generation config, tokenizer) loads with `AutoModelForCausalLM.from_pretrained` and vLLM.
"""

from __future__ import annotations

import argparse
import os


def _run_model_path(ckpt_dir: str) -> str:
    from hybridflow.config import HybridFlowConfig, load_config

    cfg_path = os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), "config.yaml")
    if not os.path.isfile(cfg_path):
        raise SystemExit(f"error: {cfg_path} not found (the run's saved config names the model); pass --model-path")
    mcfg = load_config(cfg_path, schema=HybridFlowConfig).actor_rollout_ref.model
    return mcfg.path


def export_checkpoint(ckpt_dir: str, out_dir: str, model_path: str | None = None) -> str:
    """Load the actor's DCP shards (no process group needed) into the HF model and save it."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor_dir = os.path.join(ckpt_dir, "actor")
    if not os.path.isdir(actor_dir):
        raise SystemExit(f"error: {actor_dir} not found: CHECKPOINT_DIR must be a global_step_<k> directory of a run")
    model_path = model_path or _run_model_path(ckpt_dir)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=actor_dir, no_dist=True)  # reads exactly these keys, whatever the shard layout
    model.load_state_dict(state["model"])
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    return out_dir


def main_export(argv=None) -> int:
    p = argparse.ArgumentParser(prog="hybridflow export", description="Write a run's checkpoint as an HF checkpoint (safetensors)")
    p.add_argument("checkpoint", help="a global_step_<k> directory")
    p.add_argument("out_dir")
    p.add_argument("--model-path", default=None, help="the run's base model (default: from the run's config.yaml)")
    a = p.parse_args(argv)
    print(export_checkpoint(a.checkpoint, a.out_dir, a.model_path))
    return 0
