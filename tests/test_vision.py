"""Vision-language models: the tiny VLM checkpoint, the image data path, and the synthetic visual task.

Oracles are independent of the code under test: the HF processor called directly on hand-built content
lists and PIL images opened here; the model's own M-RoPE index (position_ids=None) against ours; pixel
counts of the drawn images against the circle's area.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from hybridflow.data.dataset import DataError, RLDataset
from hybridflow.data.tasks import main_make_data, write_parquet
from hybridflow.data.vision import VisionRLDataset, collate_vision, pack_multi_modal_inputs
from hybridflow.data.vision_task import BACKGROUND, COLOURS, QUESTION, draw_circle, make_vision_task, png_bytes, wrong_colour
from hybridflow.models.tiny import build_char_tokenizer, main_make_model
from hybridflow.models.vlm import is_vlm_dir, load_processor
from hybridflow.rewards.scorers import compute_score
from conftest import free_port, join_gloo


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm") / "qwen2_vl"
    assert main_make_model([str(out), "--arch", "qwen2_vl"]) == 0
    return out


def _load_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()


def _img(colour=(200, 20, 20), size=56):
    return Image.new("RGB", (size, size), colour)


def _oracle(processor, content: list[dict], images: list):
    """The HF processor's own output for a hand-built user message (no hybridflow code)."""
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images, return_tensors="pt")


# ----------------------------------------------------------------------------------------- model
def test_tiny_vlm_builds_loads_and_is_deterministic(vlm_dir):
    from transformers import AutoConfig

    assert is_vlm_dir(vlm_dir)
    cfg = AutoConfig.from_pretrained(str(vlm_dir))
    assert cfg.model_type == "qwen2_vl"
    processor = load_processor(vlm_dir)  # AutoProcessor.from_pretrained(dir)
    tok = processor.tokenizer
    assert [tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")] == [
        cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id]
    assert tok.decode(tok("max 3 8 1", add_special_tokens=False)["input_ids"]) == "max 3 8 1"  # the char tokenizer's text ids
    enc = _oracle(processor, [{"type": "image"}, {"type": "text", "text": "Which colour?"}], [_img()])
    # 56 x 56 px -> grid (1, 4, 4) patches of 14 px -> 16 / 2**2 = 4 image tokens
    assert enc["image_grid_thw"].tolist() == [[1, 4, 4]] and int((enc["input_ids"] == cfg.image_token_id).sum()) == 4
    m1, m2 = _load_model(vlm_dir), _load_model(vlm_dir)
    with torch.no_grad():
        l1, l2 = m1(**enc).logits, m2(**enc).logits
        l_other = m1(**_oracle(processor, [{"type": "image"}, {"type": "text", "text": "Which colour?"}], [_img((20, 20, 200))])).logits
    assert l1.shape == (1, enc["input_ids"].shape[1], len(tok)) and torch.equal(l1, l2)
    assert not torch.equal(l1, l_other)  # the pixels reach the logits
    out = m1.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 4) and torch.equal(out[:, : enc["input_ids"].shape[1]], enc["input_ids"])


def test_tiny_qwen2_5_vl_forward(tmp_path):
    from hybridflow.models.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "q25", arch="qwen2_5_vl")
    processor, model = load_processor(out), _load_model(out)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    enc = _oracle(processor, [{"type": "image"}, {"type": "text", "text": "Hi"}], [_img()])
    with torch.no_grad():
        assert torch.isfinite(model(**enc).logits).all()


# ------------------------------------------------------------------------------------------ data
def _rows(tmp_path):
    """Images as bytes, as a relative path, two in one message, and a text-only row."""
    (tmp_path / "imgs").mkdir(exist_ok=True)
    _img((20, 200, 20), 28).save(tmp_path / "imgs" / "g.png")
    base = {"data_source": "vision_colour", "reward_model": {"style": "rule", "ground_truth": "red"}}
    return [
        dict(base, prompt=[{"role": "user", "content": "<image>Which colour?"}], images=[{"bytes": png_bytes(_img()), "path": None}]),
        dict(base, prompt=[{"role": "user", "content": "Look: <image> ok"}], images=[{"bytes": None, "path": "imgs/g.png"}]),
        dict(base, prompt=[{"role": "user", "content": "<image>and<image>"}],
             images=[{"bytes": png_bytes(_img((0, 0, 255), 56)), "path": None}, {"bytes": png_bytes(_img((9, 9, 9), 28)), "path": None}]),
        dict(base, prompt=[{"role": "user", "content": "no image here"}], images=[]),
    ]


def test_data_path_equals_processor(vlm_dir, tmp_path):
    processor = load_processor(vlm_dir)
    f = write_parquet(_rows(tmp_path), tmp_path / "mm.parquet")
    ds = VisionRLDataset(str(f), processor, max_prompt_length=96)
    assert len(ds) == 4
    g = Image.open(tmp_path / "imgs" / "g.png").convert("RGB")
    oracles = [
        _oracle(processor, [{"type": "image"}, {"type": "text", "text": "Which colour?"}], [_img()]),
        _oracle(processor, [{"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " ok"}], [g]),
        _oracle(processor, [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}], [_img((0, 0, 255), 56), _img((9, 9, 9), 28)]),
        processor(text=[processor.apply_chat_template([{"role": "user", "content": "no image here"}], add_generation_prompt=True,
                                                      tokenize=False)], return_tensors="pt"),
    ]
    for i, want in enumerate(oracles):
        item = ds[i]
        assert item["input_ids"] == want["input_ids"][0].tolist(), i
        mm = item["multi_modal_inputs"]
        if "pixel_values" in want:
            assert torch.equal(mm["pixel_values"], want["pixel_values"]) and torch.equal(mm["image_grid_thw"], want["image_grid_thw"]), i
        else:
            assert mm == {}
    assert ds[2]["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]  # 4 + 1 image tokens


def test_collated_batch_runs_the_model_like_its_own_rope_index(vlm_dir, tmp_path):
    from transformers import AutoConfig

    processor, cfg, model = load_processor(vlm_dir), AutoConfig.from_pretrained(str(vlm_dir)), _load_model(vlm_dir)
    ds = VisionRLDataset(str(write_parquet(_rows(tmp_path), tmp_path / "mm.parquet")), processor, max_prompt_length=96)
    batch = collate_vision([ds[i] for i in range(4)], processor.tokenizer.pad_token_id, 96, cfg, padding="longest")
    ids, mask = batch["input_ids"], batch["attention_mask"]  # [4, L]
    assert batch["position_ids"].shape == (4, 3, ids.shape[1]) and len(batch["multi_modal_inputs"]) == 4
    mm = pack_multi_modal_inputs(list(batch["multi_modal_inputs"]))
    assert mm["image_grid_thw"].shape == (4, 3)  # 1 + 1 + 2 images, row order
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"].transpose(0, 1), **mm).logits
        theirs = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == cfg.image_token_id).long(), **mm).logits
    valid = mask.bool()
    assert torch.equal(ours[valid], theirs[valid])
    # the text-only row: M-RoPE degenerates to 0..n-1 in all three sections
    n = int(mask[3].sum())
    assert batch["position_ids"][3, :, -n:].tolist() == [list(range(n))] * 3
    sliced = batch.index([2, 0])  # a Batch op keeps each row's pixel inputs with its row
    assert torch.equal(sliced["multi_modal_inputs"][0]["image_grid_thw"], ds[2]["multi_modal_inputs"]["image_grid_thw"])
    out = model.generate(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == cfg.image_token_id).long(), **mm,
                         max_new_tokens=3, do_sample=False)
    assert out.shape == (4, ids.shape[1] + 3)


@pytest.mark.parametrize("case", ["missing_file", "bad_bytes", "eps_bytes", "more_placeholders", "fewer_placeholders", "text_only_model"])
def test_bad_image_names_file_and_row(vlm_dir, tmp_path, case):
    rows = _rows(tmp_path)
    bad = dict(rows[0])
    if case == "missing_file":
        bad["images"] = [{"bytes": None, "path": "imgs/nope.png"}]
        want = "image file not found"
    elif case == "bad_bytes":
        bad["images"] = [{"bytes": b"\x89PNG not really", "path": None}]
        want = "cannot decode image"
    elif case == "eps_bytes":  # a format whose decoder would start Ghostscript: not identified at all (EPS would reach load())
        bad["images"] = [{"bytes": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n", "path": None}]
        want = "UnidentifiedImageError"
    elif case == "more_placeholders":
        bad["prompt"] = [{"role": "user", "content": "<image><image>Which?"}]
        want = "2 <image> placeholder(s), more than the 1 image(s)"
    elif case == "fewer_placeholders":
        bad["prompt"] = [{"role": "user", "content": "Which?"}]
        want = "0 <image> placeholder(s), fewer than the 1 image(s)"
    else:
        want = "text-only"
    f = write_parquet([rows[3], rows[3], bad], tmp_path / f"{case}.parquet")
    with pytest.raises(DataError) as e:
        if case == "text_only_model":
            RLDataset(str(f), build_char_tokenizer(), 96)
        else:
            VisionRLDataset(str(f), load_processor(vlm_dir), 96)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f} row 2:") and want in msg, msg


# ------------------------------------------------------------------------------------------- task
def test_vision_task_images_answers_and_reward(tmp_path):
    files = make_vision_task(tmp_path, n_train=48, n_val=16, sft_copies=4, bias_prob=0.75)
    import pyarrow.parquet as pq

    train, val, sft = (pq.read_table(files[k]).to_pylist() for k in ("train", "val", "sft"))
    assert len(train) == 48 and len(val) == 16 and len(sft) == 48 * 4
    palette = {v: k for k, v in COLOURS.items()}
    for row in train + val:
        assert row["prompt"] == [{"role": "user", "content": QUESTION}] and len(row["images"]) == 1
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        px = np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")).reshape(-1, 3)
        colours = {tuple(int(c) for c in p) for p in np.unique(px, axis=0)}
        assert colours == {BACKGROUND, COLOURS[truth]}  # exactly the stated colour on white, nothing else
        n = int((px == np.array(COLOURS[truth])).all(1).sum())
        area = math.pi * info["r"] ** 2
        assert abs(n - area) < 0.1 * area + 4 * info["r"], (n, area)  # the filled circle's area, up to its rim
        assert palette[tuple(np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB"))[info["cy"], info["cx"]])] == truth
    assert {r["images"][0]["bytes"] for r in val}.isdisjoint({r["images"][0]["bytes"] for r in train})
    # SFT: the wrong rule (the next colour) in about bias_prob of the demonstrations, the truth otherwise
    by_png = {r["images"][0]["bytes"]: r["reward_model"]["ground_truth"] for r in train}
    wrong = [r["response"] == wrong_colour(by_png[r["images"][0]["bytes"]]) for r in sft]
    assert all(w or r["response"] == by_png[r["images"][0]["bytes"]] for w, r in zip(wrong, sft))
    assert 0.6 < sum(wrong) / len(wrong) < 0.9
    # the reward: the last word, case-insensitive
    assert compute_score("vision_colour", "The circle is Blue.", "blue") == {"score": 1.0, "pred": "blue"}
    assert compute_score("vision_colour", "blue? no, red", "blue")["score"] == 0.0
    assert compute_score("vision_colour", "", "blue") == {"score": 0.0, "pred": None}
    assert compute_score("vision_colour", wrong_colour("blue"), "blue")["score"] == 0.0


def test_make_data_vision_cli_rows_load(vlm_dir, tmp_path, capsys):
    assert main_make_data([str(tmp_path / "d"), "--task", "vision", "--sft-copies", "1"]) == 0
    files = json.loads(capsys.readouterr().out)
    ds = VisionRLDataset(files["val"], load_processor(vlm_dir), max_prompt_length=64)
    assert len(ds) == 64 and all(it["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]] for it in ds.items)
    assert draw_circle("red", 10, 10, 5).size == (56, 56)


# -------------------------------------------------------------------------------------- training
PROMPT_IMAGES = [((220, 30, 30), 56), ((30, 170, 50), 28), ((30, 60, 220), 56), ((230, 200, 20), 28)]  # 4, 1, 4, 1 image tokens
RESPONSE = 5


def _vlm_train_batch(processor, config):
    """4 rows: an image prompt each (two sizes, so the left padding differs) + a random response of 3-5 tokens
    (right-padded); the M-RoPE position ids of the whole sequences; advantages for one update."""
    from hybridflow.data.vision import encode_vision_prompt, rows_position_ids
    from hybridflow.protocol import Batch

    items = [encode_vision_prompt(processor, [{"role": "user", "content": "<image>Which colour?" + " x" * i}], [_img(c, s)])
             for i, (c, s) in enumerate(PROMPT_IMAGES)]
    P = max(len(it["input_ids"]) for it in items)
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(items), P + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, it in enumerate(items):
        n, length = len(it["input_ids"]), 3 + r % 3
        ids[r, P - n : P] = torch.tensor(it["input_ids"])
        ids[r, P : P + length] = torch.randint(3, 250, (length,), generator=g)
        mask[r, P - n : P + length] = 1
    rows = [it["multi_modal_inputs"] for it in items]
    resp_mask = mask[:, P:].float()
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": rows_position_ids(config, ids, mask, rows),
                                    "responses": ids[:, P:], "response_mask": resp_mask,
                                    "advantages": torch.randn(len(items), RESPONSE, generator=g) * resp_mask},
                           non_tensors={"multi_modal_inputs": rows}), items, P


def _vlm_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    """Both layouts in one pair of processes (one start-up): dp 2 (FSDP2), then tp 2 (TP over the text layers)."""
    import pickle

    join_gloo(rank, world, port)
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoConfig

    from hybridflow.config.schema import HybridFlowConfig
    from hybridflow.run_plan import resolve
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

    batch, _, _ = _vlm_train_batch(load_processor(path), AutoConfig.from_pretrained(path))
    for tp in (1, 2):
        cfg = HybridFlowConfig()
        arr = cfg.actor_rollout_ref
        arr.model.path, arr.model.freeze_vision_tower = path, True
        arr.actor.ppo_mini_batch_size, arr.actor.ppo_micro_batch_size_per_gpu, arr.actor.tensor_model_parallel_size = 4, 1, tp
        arr.actor.optim.lr = 1e-2
        arr.rollout.n, arr.rollout.log_prob_micro_batch_size_per_gpu = 1, 2
        cfg.trainer.device, cfg.trainer.n_gpus_per_node = "cpu", world
        # dp 2 also holds the HF rollout: the weight switch before and after the update (the frozen tower moves once)
        w = ActorRolloutRefWorker(resolve(cfg).actor, role="actor_rollout" if tp == 1 else "actor", total_training_steps=1)
        w.init_model()
        units = sorted(type(m).__name__ for m in w.actor.module.modules() if isinstance(m, FSDPModule))
        switches = [w.reshard(check=True)] if tp == 1 else []
        part = batch.chunk(w.dp_size)[w.dims.dp_i]
        old = w.compute_log_prob(part)["old_log_probs"]
        before = w.actor.state_dict()
        part.tensors["old_log_probs"] = old
        metrics = w.update_actor(part)
        after = w.actor.state_dict()
        if tp == 1:
            switches.append(w.reshard(check=True))
            switches = [{k: s[k] for k in ("bytes_received", "skipped_bytes", "max_diff")} for s in switches] + [w.plan.min_bytes(rank)]
        with open(f"{out}/tp{tp}_{rank}", "wb") as f:
            pickle.dump({"logp": old, "units": units, "metrics": metrics, "before": before if rank == 0 else None,
                         "after": after if rank == 0 else None, "switches": switches}, f)
    torch.distributed.destroy_process_group()


def _hf_logprobs(path, batch, items, P):
    """The oracle: per row, a plain single-process HF forward of the unpadded prompt + response with the row's
    pixel values; the model computes its own rope index (mm_token_type_ids, as its processor returns); float64
    log-softmax with the vision tokens' logits -inf (tests/test_vision_logprobs.py)."""
    from transformers import AutoConfig

    model, config = _load_model(path), AutoConfig.from_pretrained(str(path))
    out = torch.zeros(batch["responses"].shape)
    with torch.no_grad():
        for r, it in enumerate(items):
            n = int(batch["response_mask"][r].sum())
            ids = torch.tensor([it["input_ids"] + batch["responses"][r, :n].tolist()])
            logits = model(input_ids=ids, mm_token_type_ids=(ids == config.image_token_id).long(), **it["multi_modal_inputs"]).logits
            z = logits[0, len(it["input_ids"]) - 1 : -1].double()  # [n, V]
            z[:, [config.vision_start_token_id, config.vision_end_token_id, config.image_token_id, config.video_token_id]] = float("-inf")
            lp = torch.log_softmax(z, -1)  # the vision tokens left out, as the rollout samples (never them) and the trainer scores
            out[r, :n] = lp.gather(-1, batch["responses"][r, :n, None])[:, 0].float()
    return out


def test_vlm_trainer_logprobs_equal_hf_and_frozen_tower(vlm_dir, tmp_path):
    """The actor worker with image batches on 2 ranks, dp 2 (FSDP2) and tp 2 (TP over the text layers): its
    log-probs equal a plain HF forward of each row with the same pixel values (before any optimizer step); the
    vision blocks are FSDP2 units next to the decoder layers; with freeze_vision_tower one update changes the
    language model and leaves every vision-tower weight as it was. At dp 2 the worker also holds the HF rollout:
    the weight switch before and after the update leaves the generation weights equal to the trained ones, moves
    the planner's minimum the first time and skips exactly the frozen tower's half the second time."""
    import pickle

    import torch.multiprocessing as mp
    from transformers import AutoConfig

    mp.spawn(_vlm_worker, args=(2, free_port(), str(vlm_dir), str(tmp_path)), nprocs=2)
    batch, items, P = _vlm_train_batch(load_processor(vlm_dir), AutoConfig.from_pretrained(str(vlm_dir)))
    ref = _hf_logprobs(vlm_dir, batch, items, P) * batch["response_mask"]
    for tp in (1, 2):
        ranks = [pickle.load(open(tmp_path / f"tp{tp}_{r}", "rb")) for r in range(2)]
        ours = (torch.cat([r["logp"] for r in ranks]) if tp == 1 else ranks[0]["logp"]) * batch["response_mask"]
        # fp32 forwards of a 0.19M-parameter model in another summation order (padding, sharded matmuls): ~1e-6 apart
        torch.testing.assert_close(ours, ref, rtol=0, atol=2e-5, msg=f"tp {tp}")
        assert ranks[0]["units"].count("FSDPQwen2VLVisionBlock") == 2 and ranks[0]["units"].count("FSDPQwen2VLDecoderLayer") == 2, ranks[0]["units"]
        before, after = ranks[0]["before"], ranks[0]["after"]
        vision = [k for k in before if k.startswith("model.visual.")]
        assert vision and all(torch.equal(before[k], after[k]) for k in vision), tp
        changed = [k for k in before if k.startswith("model.language_model.layers.") and not torch.equal(before[k], after[k])]
        assert len(changed) > 10, (tp, changed)
        assert math.isfinite(ranks[0]["metrics"]["actor/pg_loss"])
    # the weight switch (dp 2 -> HF rollout, gen tp 1): generation weights equal the trained ones after each switch; the
    # first moves the planner's minimum (tower included), the second skips the frozen tower's bytes and moves the rest
    tower_bytes = 4 * sum(p.numel() for n, p in _load_model(vlm_dir).named_parameters() if n.startswith("model.visual."))  # fp32
    for rank, r in enumerate(pickle.load(open(tmp_path / f"tp1_{k}", "rb")) for k in range(2)):
        first, second, min_bytes = r["switches"]
        assert first["max_diff"] == 0.0 and second["max_diff"] == 0.0, r["switches"]
        assert first["bytes_received"] == min_bytes and first["skipped_bytes"] == 0, r["switches"]
        assert second["skipped_bytes"] > 0 and second["bytes_received"] == min_bytes - second["skipped_bytes"], r["switches"]
        assert second["skipped_bytes"] == tower_bytes // 2, (rank, r["switches"], tower_bytes)  # each rank receives the half it lacks


# --------------------------------------------------------------------------------------- rollout
def test_hf_rollout_generates_with_each_rows_pixels(vlm_dir):
    """The HF rollout's batch API on image prompts (left-padded, two image sizes) equals a plain HF generate of
    each row alone with its pixel values (greedy); the result carries the rows' image inputs and the M-RoPE
    position ids of prompt + response (the model's own rope index); the continuous-batching path refuses."""
    from transformers import AutoConfig

    from hybridflow.data.vision import encode_vision_prompt
    from hybridflow.protocol import SamplingParams
    from hybridflow.rollout.base import left_padded
    from hybridflow.rollout.hf_rollout import HFRollout

    processor, config = load_processor(vlm_dir), AutoConfig.from_pretrained(str(vlm_dir))
    items = [encode_vision_prompt(processor, [{"role": "user", "content": "<image>Which colour?" + " x" * i}], [_img(c, s)])
             for i, (c, s) in enumerate(PROMPT_IMAGES)]
    ids, mask = left_padded([it["input_ids"] for it in items], processor.tokenizer.pad_token_id)
    rows = [it["multi_modal_inputs"] for it in items]
    from hybridflow.protocol import Batch

    prompts = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask}, non_tensors={"multi_modal_inputs": rows})
    model = _load_model(vlm_dir)
    rollout = HFRollout(model, processor.tokenizer, "cpu", continuous=False)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    out = rollout.generate(prompts, params)
    assert out["responses"].shape == (4, 6) and out["position_ids"].shape == (4, 3, ids.shape[1] + 6)
    assert all(o is r for o, r in zip(out["multi_modal_inputs"], rows))
    with torch.no_grad():
        for r, it in enumerate(items):
            one = torch.tensor([it["input_ids"]])
            want = model.generate(input_ids=one, mm_token_type_ids=(one == config.image_token_id).long(), **it["multi_modal_inputs"],
                                  max_new_tokens=6, do_sample=False)[0, one.shape[1]:]
            n = int(out["response_mask"][r].sum())
            assert out["responses"][r, :n].tolist() == want[:n].tolist(), r
            # the position ids of the valid tokens: the model's own rope index of the unpadded sequence
            full = torch.cat([one[0], out["responses"][r, :n]])[None]
            theirs, _ = model.model.get_rope_index(full, mm_token_type_ids=(full == config.image_token_id).long(),
                                                   image_grid_thw=it["multi_modal_inputs"]["image_grid_thw"])
            valid = out["attention_mask"][r].bool()
            assert torch.equal(out["position_ids"][r][:, valid], theirs[:, 0]), r
    with pytest.raises(RuntimeError, match="continuous_batching=false"):
        HFRollout(model, processor.tokenizer, "cpu", continuous=True).generate(prompts, params)


def test_vlm_config_refusals_name_the_key(vlm_dir, tmp_path):
    """Before any worker starts: what image prompts are not wired through, one line each naming the key; and
    freeze_vision_tower on a text model."""
    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.config.loader import ConfigError
    from hybridflow.config.validate import validate_config
    from hybridflow.models.tiny import make_tiny_model

    for name in ("train.parquet", "val.parquet"):
        (tmp_path / name).write_text("")
    base = [f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'val.parquet'}]", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "algorithm.adv_estimator=grpo"]
    validate_config(load_config(None, [*base, f"actor_rollout_ref.model.path={vlm_dir}", "actor_rollout_ref.model.freeze_vision_tower=true"],
                                schema=HybridFlowConfig))  # the VLM with the hf rollout is fine
    bad = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.continuous_batching=true", "actor_rollout_ref.rollout.exact=true"]
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, [*base, f"actor_rollout_ref.model.path={vlm_dir}", *bad], schema=HybridFlowConfig))
    lines = [line.strip(" -") for line in str(e.value).splitlines()]
    for key in bad:
        assert any(line.startswith(key + ":") and "vision-language" in line for line in lines), (key, lines)
    from hybridflow.models.vlm_checks import vision_model_problems

    distill = vision_model_problems(str(vlm_dir), False, "hf", False, False, 1, 1, False, False, "on_policy_distill")
    assert [line.split(":")[0] for line in distill] == ["algorithm.adv_estimator=on_policy_distill"], distill  # the teacher gets no pixels
    text = make_tiny_model(tmp_path / "text")
    with pytest.raises(ConfigError) as e:
        validate_config(load_config(None, [*base, f"actor_rollout_ref.model.path={text}", "actor_rollout_ref.model.freeze_vision_tower=true"],
                                    schema=HybridFlowConfig))
    assert "actor_rollout_ref.model.freeze_vision_tower=true:" in str(e.value) and "text model" in str(e.value)


def test_vision_sft_rows_equal_processor_and_rope_index(vlm_dir, tmp_path):
    """SFT rows with images: prompt ids = the HF processor's, response + eos after them with loss mask 1, right
    padding; the collated M-RoPE position ids equal the model's own rope index on the valid tokens; a prompt
    that leaves no room for the response is refused naming file and row."""
    from transformers import AutoConfig

    from hybridflow.data.vision import VisionSFTDataset, collate_vision_sft

    processor, config, model = load_processor(vlm_dir), AutoConfig.from_pretrained(str(vlm_dir)), _load_model(vlm_dir)
    rows = [{"prompt": [{"role": "user", "content": "<image>Which colour?"}], "images": [{"bytes": png_bytes(_img(c, s)), "path": None}],
             "response": name} for (c, s), name in zip(PROMPT_IMAGES[:2], ("green", "yellow"))]
    f = write_parquet(rows, tmp_path / "sft.parquet")
    ds = VisionSFTDataset(str(f), processor, max_length=64)
    tok = processor.tokenizer
    batch = collate_vision_sft([ds[0], ds[1]], config)
    assert batch["position_ids"].shape == (2, 3, 64)
    for r, (row, (c, s)) in enumerate(zip(rows, PROMPT_IMAGES)):
        want = _oracle(processor, [{"type": "image"}, {"type": "text", "text": "Which colour?"}], [_img(c, s)])
        p = want["input_ids"][0].tolist()
        resp = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        n = len(p) + len(resp)
        assert batch["input_ids"][r, :n].tolist() == p + resp and batch["attention_mask"][r].tolist() == [1] * n + [0] * (64 - n)
        assert batch["loss_mask"][r].tolist() == [0] * len(p) + [1] * len(resp) + [0] * (64 - n)
        assert torch.equal(batch["multi_modal_inputs"][r]["pixel_values"], want["pixel_values"])
        full = batch["input_ids"][r : r + 1, :n]
        theirs, _ = model.model.get_rope_index(full, mm_token_type_ids=(full == config.image_token_id).long(),
                                               image_grid_thw=want["image_grid_thw"])
        assert torch.equal(batch["position_ids"][r, :, :n], theirs[:, 0])
    with pytest.raises(DataError, match=r"sft.parquet row 0: prompt is \d+ tokens"):
        VisionSFTDataset(str(f), processor, max_length=20)


# ------------------------------------------------------------------------------------------ recipe
FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "recipes"


@pytest.mark.timeout(600)
def test_vision_recipe_grpo_fixes_the_wrong_rule(ray_cluster, tmp_path):
    """`hybridflow demo --recipe vision`, short: from the committed warm start (the recipe's 300-step SFT on
    demonstrations that name the next colour 75% of the time, tests/fixtures/recipes/vision; scripts/
    build_recipe_fixtures.py), 10 GRPO steps on image prompts instead of 40, with the weight check on every
    switch. Measured (docs/vision.md): held-out 0.25 after SFT, 0.81 at step 10."""
    from hybridflow.cli import main as cli_main

    out = tmp_path / "vision"
    assert cli_main(["demo", "--recipe", "vision", "--output-dir", str(out), "--sft-model", str(FIXTURES / "vision"), "--rl-steps", "10",
                     "trainer.progress_bar=false", "trainer.logger=[jsonl]", "trainer.check_weight_sync=true"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["val_acc_after_sft"] < 0.3, s  # greedy: the wrong rule
    assert s["val_acc_final"] >= s["val_acc_after_sft"] + 0.3, s
    steps = [json.loads(line) for line in (out / "vision_grpo" / "metrics.jsonl").read_text().splitlines()]
    synced = [h for h in steps if "reshard/weight_max_diff" in h]
    assert synced and all(h["reshard/weight_max_diff"] == 0.0 and h["reshard/bytes_per_rank"] == h["reshard/min_bytes_per_rank"] for h in synced)
