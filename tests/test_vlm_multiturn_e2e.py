"""Multi-turn GRPO with images through the trainer (Ray, 2 FSDP2 workers): the ``vision_render`` task's rows start from an
``<image>`` prompt (a grey circle), the ``render`` tool answers with the coloured canvas as an image, and the batch that
reaches the trainer carries the trajectory's pixels.

The committed vision warm start (tests/fixtures/recipes/vision) answers a colour and never calls a tool, so the test's
agent loop (`RenderFirst`, registered here: the loop runs on the driver) acts on the first turn as if it had called
``render``; the model's tokens stay exactly as sampled and the tool runs as in any trajectory.

Oracles are independent of the code under test: the image-token count from the drawn PNG's size (14-px patches merged
2x2: (56/14)**2/4 = 4); the image processor alone on the images drawn again from the rows' circles; the tokens each
backend call returned (recorded at the rollout group's boundary); a plain HF forward of each unpadded row with those
pixels (the model computes its own rope index).
"""

from __future__ import annotations

import math
import pathlib
import time

import pytest
import torch

from conftest import rl_overrides
from test_vlm_multiturn import _runs

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "recipes" / "vision"
RENDER_CALL = '<tool_call>\n{"name": "render", "arguments": {}}\n</tool_call>'


def _register_render_first():
    from hybridflow.agent.loop import AGENT_LOOPS, ToolAgentLoop, register_agent_loop

    if "render_first" in AGENT_LOOPS:
        return

    @register_agent_loop("render_first")
    class RenderFirst(ToolAgentLoop):
        async def after_turn(self, traj, text):
            if traj.num_turns == 1 and not self.fmt.parse(text).calls:
                text += RENDER_CALL  # as if the model had asked for the render (its sampled tokens are unchanged)
            return await super().after_turn(traj, text)


class RecordingGroup:
    """The rollout group as the agent rollout sees it, recording each request's session and the tokens returned."""

    def __init__(self, group, sampled: dict):
        self.group, self.sampled = group, sampled

    def generate_requests(self, data):
        out = self.group.generate_requests(data)
        for r, c in zip(data["request"], out["completion"]):
            self.sampled.setdefault(r.session, []).append(list(c.token_ids))
        return out

    def __getattr__(self, name):
        return getattr(self.group, name)


@pytest.mark.timeout(300)
def test_multi_turn_grpo_with_a_render_tools_image(ray_cluster, tmp_path):
    """One GRPO step (2 prompts x 2 samples, old log-probs recomputed, KL loss against the reference) and a validation
    after it, multi-turn with images. From the trained batch: each row's response holds the tool message's image tokens
    with mask 0, as many as the drawn image's merged patches; its mask-1 tokens are exactly what the rollout returned for
    its trajectory; its pixel inputs are the image processor's on the prompt's and the tool's images; and the trainer's
    old log-probs (before the update) equal a plain HF forward of the same model with those pixels (the reference's too)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.data.vision_task import HIDDEN, draw_circle, make_vision_render_task
    from hybridflow.models.vlm import load_processor
    from hybridflow.models.vlm_inputs import VISION_TOKEN_KEYS
    from hybridflow.trainer.rl import RLTrainer

    _register_render_first()
    files = make_vision_render_task(tmp_path / "data", n_train=2, n_val=2)
    cfg = load_config(None, rl_overrides(FIXTURE, tmp_path / "data", tmp_path / "out",
                                         "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_prompt_length=128",
                                         "data.max_response_length=64", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=1",
                                         "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.recompute_old_log_prob=true",
                                         "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
                                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
                                         f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files['tool_config']}",
                                         "actor_rollout_ref.rollout.multi_turn.default_agent=render_first", "trainer.test_freq=1"),
                      schema=HybridFlowConfig)
    start = time.monotonic()
    trainer = RLTrainer(cfg)
    sampled: dict[str, list[list[int]]] = {}
    rollouts = []  # per agent call (the step's rollout, then validation): its trajectories
    generate, build = trainer.agent.generate, trainer.build_dataflow
    trained = []

    def recording(group, prompts, params):
        out = generate(RecordingGroup(group, sampled), prompts, params)
        rollouts.append(list(trainer.agent.last))
        return out

    def recording_flow():
        flow = build()
        run = flow.run

        def keep(batch):
            result = run(batch)
            trained.append(result)
            return result

        flow.run = keep
        return flow

    trainer.agent.generate, trainer.build_dataflow = recording, recording_flow
    try:
        out = trainer.fit()
    finally:
        trainer.shutdown()
    print(f"fit: {time.monotonic() - start:.1f} s")
    assert len(rollouts) == 2 and len(trained) == 1  # the step's rollout and the validation after it, both with images
    assert any(k.startswith("val-core/vision_colour/") for k in out["history"][-1])

    processor = load_processor(FIXTURE)
    config = AutoConfig.from_pretrained(str(FIXTURE))
    model = AutoModelForImageTextToText.from_pretrained(str(FIXTURE), dtype=torch.float32).eval()
    tok, merge = processor.tokenizer, processor.image_processor.merge_size
    batch = trained[0]
    R = batch["responses"].shape[1]
    P = batch["input_ids"].shape[1] - R
    assert batch["position_ids"].shape == (len(batch), 3, P + R)  # M-RoPE over prompt + response
    trajs = {tuple(t.prompt_ids + t.response_ids): t for t in rollouts[0]}
    for r in range(len(batch)):
        valid = batch["attention_mask"][r].bool()
        ids = batch["input_ids"][r][valid]
        n = int(valid[P:].sum())
        resp, mask = batch["responses"][r, :n].tolist(), batch["response_mask"][r, :n].tolist()
        assert torch.equal(ids[-n:], torch.tensor(resp)) and all(m == 0 for m in batch["response_mask"][r, n:].tolist())
        # the image tokens: in a tool message, mask 0, as many as the 56x56 canvas's merged 14-px patches: (56/14)**2 / 4
        pads = [k for k, t in enumerate(resp) if t == config.image_token_id]
        assert pads and all(mask[k] == 0 for k in pads) and len(pads) == (56 // 14) ** 2 // 4, (r, len(pads))
        assert "<|im_start|>tool" in tok.decode(resp[: pads[0]])
        mm = batch["multi_modal_inputs"][r]
        grid = mm["image_grid_thw"]  # [2, 3]: the prompt's image, then the tool's
        assert grid.shape == (2, 3) and int(grid[1].prod()) // merge**2 == len(pads)
        # the pixels: the image processor alone on the prompt's grey circle and the tool's coloured one, drawn again
        c = batch["extra_info"][r]["tools_kwargs"]["render"]["create_kwargs"]
        images = [draw_circle(c["colour"], c["cx"], c["cy"], c["r"], c["size"], fill=HIDDEN), draw_circle(c["colour"], c["cx"], c["cy"], c["r"], c["size"])]
        oracle = processor.image_processor(images=images, return_tensors="pt")
        assert torch.equal(mm["pixel_values"], oracle["pixel_values"]) and torch.equal(grid, oracle["image_grid_thw"])
        # the model's tokens: exactly what the rollout returned for this row's trajectory, turn by turn
        traj = trajs[tuple(ids.tolist())]
        assert [resp[a:b] for v, a, b in _runs(mask) if v == 1] == sampled[traj.session] and len(sampled[traj.session]) == 2
        # the trainer's old log-probs (before the update) = a plain HF forward of the unpadded row with the oracle pixels.
        # The trainer leaves the vision tokens out of its softmax, as the rollout samples (not at a position whose token is
        # one, a tool's image token: its log-prob stays finite), so the oracle renormalises without them; the model's tokens
        # are compared.
        full = ids[None]
        with torch.no_grad():
            logits = model(input_ids=full, mm_token_type_ids=(full == config.image_token_id).long(), pixel_values=oracle["pixel_values"],
                           image_grid_thw=oracle["image_grid_thw"]).logits[0, -n - 1 : -1].double()  # [n, V]
        logits[:, [getattr(config, k) for k in VISION_TOKEN_KEYS]] = float("-inf")
        want = torch.log_softmax(logits, -1).gather(-1, full[0, -n:, None])[:, 0].float()  # [n]
        model_tokens = torch.tensor(mask, dtype=torch.bool)
        for key in ("old_log_probs", "ref_log_prob"):
            torch.testing.assert_close(batch[key][r, :n][model_tokens], want[model_tokens], rtol=0, atol=2e-5, msg=key)
    step = next(h for h in out["history"] if h["step"] == 1)
    assert step["agent/tool_calls/mean"] == 1.0 and step["agent/tool_tokens/mean"] > len(pads)
    # the update over rows whose masked-out tokens include image tokens is finite (first update: ppo_kl 0, the ratio 1)
    assert all(math.isfinite(step[k]) for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm")), step
    assert step["actor/ppo_kl"] == 0.0 and step["actor/kl_loss"] == 0.0


def test_vlm_multi_turn_config_is_accepted_and_a_black_box_agent_refused(tmp_path):
    """Before any worker starts: a VLM with multi-turn tools validates; a black-box agent (its row holds no images) and
    continuous batching (token ids only) are refused, one line each naming the key."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.config.loader import ConfigError
    from hybridflow.config.validate import validate_config
    from hybridflow.data.vision_task import make_vision_render_task

    files = make_vision_render_task(tmp_path, n_train=2, n_val=2)
    base = [f"data.train_files=[{files['train']}]", f"data.val_files=[{files['val']}]", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
            "algorithm.adv_estimator=grpo", f"actor_rollout_ref.model.path={FIXTURE}", "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={files['tool_config']}"]
    validate_config(load_config(None, base, schema=HybridFlowConfig))
    bad = {"actor_rollout_ref.rollout.agent.function": "actor_rollout_ref.rollout.agent.function=os:getcwd",
           "actor_rollout_ref.rollout.continuous_batching": "actor_rollout_ref.rollout.continuous_batching=true"}
    for key, override in bad.items():
        with pytest.raises(ConfigError) as e:
            validate_config(load_config(None, [*base, override], schema=HybridFlowConfig))
        assert any(line.strip(" -").startswith(key) and "vision-language" in line for line in str(e.value).splitlines()), (key, str(e.value))
