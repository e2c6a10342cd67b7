"""Can the tiny VLM learn the visual task on CPU? A plain PyTorch SFT loop (not hybridflow's trainer: VLM
training is not wired into it yet) over `make-data --task vision`'s demonstrations, with held-out greedy
accuracy (the `vision_colour` reward) every `--eval-every` steps.

    .venv/bin/python bench/vision_sft.py --bias-prob 0.0 --steps 300     # right labels: the task is learnable
    .venv/bin/python bench/vision_sft.py --bias-prob 0.75 --steps 600    # the wrong-rule demos: SFT learns the wrong rule

Batches go through the data path of `hybridflow/data/vision.py` (processor inputs, M-RoPE position ids,
packed pixel values), so this also exercises it end to end. Prints one JSON line per evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bias-prob", type=float, default=0.75)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the tiny model is faster single-threaded on a shared 2-core CPU)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForImageTextToText

    from hybridflow.data.dataset import load_rows
    from hybridflow.data.vision import VisionRLDataset, collate_vision, encode_vision_prompt, mrope_position_ids, pack_multi_modal_inputs, row_images
    from hybridflow.data.vision_task import make_vision_task
    from hybridflow.models.tiny import make_tiny_model
    from hybridflow.models.vlm import load_processor
    from hybridflow.rewards.vision import colour_score

    work = tempfile.mkdtemp(prefix="vision_sft_")
    model_dir = make_tiny_model(os.path.join(work, "model"), arch="qwen2_vl", seed=a.seed)
    files = make_vision_task(os.path.join(work, "data"), bias_prob=a.bias_prob, seed=a.seed)
    proc, cfg = load_processor(model_dir), AutoConfig.from_pretrained(str(model_dir))
    tok = proc.tokenizer
    torch.manual_seed(a.seed)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)

    samples = []  # (prompt + response + eos ids, prompt length, the row's multi_modal_inputs)
    for f, i, row in load_rows(str(files["sft"])):
        enc = encode_vision_prompt(proc, row["prompt"], row_images(f, i, row, row["prompt"]))
        resp = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        samples.append((enc["input_ids"] + resp, len(enc["input_ids"]), enc["multi_modal_inputs"]))
    val = VisionRLDataset(str(files["val"]), proc, max_prompt_length=64)
    val_batch = collate_vision([val[i] for i in range(len(val))], tok.pad_token_id, 64, cfg, padding="longest")

    def evaluate() -> float:
        model.eval()
        b = val_batch
        mm = pack_multi_modal_inputs(list(b["multi_modal_inputs"]))
        with torch.no_grad():
            out = model.generate(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                 mm_token_type_ids=(b["input_ids"] == cfg.image_token_id).long(), **mm, max_new_tokens=8, do_sample=False)
        texts = tok.batch_decode(out[:, b["input_ids"].shape[1]:], skip_special_tokens=True)
        model.train()
        return sum(colour_score(t, rm["ground_truth"])["score"] for t, rm in zip(texts, b["reward_model"])) / len(texts)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    rng = random.Random(a.seed)
    t0 = time.time()
    print(json.dumps({"step": 0, "val_acc": evaluate(), "bias_prob": a.bias_prob}), flush=True)
    for step in range(1, a.steps + 1):
        items = rng.sample(samples, a.batch_size)
        L = max(len(s) for s, _, _ in items)
        ids = torch.full((len(items), L), tok.pad_token_id)  # [B, L], right-padded
        mask = torch.zeros(len(items), L, dtype=torch.long)  # [B, L]
        loss_mask = torch.zeros(len(items), L)  # [B, L]: 1 on the response and its eos
        for r, (s, n_prompt, _) in enumerate(items):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
            loss_mask[r, n_prompt : len(s)] = 1
        mm = pack_multi_modal_inputs([m for _, _, m in items])
        pos = mrope_position_ids(cfg, ids, mask, mm["image_grid_thw"]).transpose(0, 1)  # [3, B, L]
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, **mm).logits[:, :-1]  # [B, L-1, V]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        loss = (nll * loss_mask[:, 1:].reshape(-1)).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.eval_every == 0 or step == a.steps:
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "val_acc": evaluate(), "elapsed_s": round(time.time() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
