"""`TrainEngine` against plain PyTorch: the engine's FSDP2-sharded log-probs, gradients and gradient
norm over 2 ranks equal those of the unsharded HF model computed in this process by hand (an
independent oracle: `log_softmax` and `autograd` on the whole batch, no hybridflow code).

Tolerances: the two sides run the same fp32 operations on different row groupings (2 rows per rank
vs 4 at once) and FSDP2 sums the two ranks' gradients in a reduce-scatter, so values agree to fp32
rounding of sums of O(100) terms: 1e-5 relative to the largest entry. Compared before any optimizer
step (AdamW's first step divides by |g| and would amplify that rounding).
"""

from __future__ import annotations

import pickle
import socket

import pytest
import torch

from conftest import join_gloo

STARTS_PROCESSES = True
ROWS, PROMPT, RESPONSE = 4, 6, 5


def _batch(vocab: int):
    from hybridflow.protocol import Batch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (ROWS, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    resp_mask = torch.ones(ROWS, RESPONSE, dtype=torch.long)
    resp_mask[1, 3:] = 0  # a response that ended early
    mask[1, PROMPT + 3:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, PROMPT:], "response_mask": resp_mask})




def _two_ranks(fn, model_dir, out) -> list:
    """Run fn(rank, 2, port, model_dir, out) on 2 processes; each pickles its result to out.<rank>."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(fn, args=(2, port, str(model_dir), str(out)), nprocs=2)
    return [pickle.load(open(f"{out}.{r}", "rb")) for r in range(2)]


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_gloo(rank, world, port)
    from hybridflow.config.schema import FSDPConfig, ModelConfig, OptimConfig
    from hybridflow.engine import TrainEngine
    from hybridflow.models.hf import load_hf_model
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.parallel.layout import train_mesh

    model = load_hf_model(ModelConfig(path=model_dir), "cpu")
    engine = TrainEngine(model, train_mesh(ParallelDims(dp=world), "cpu"), "cpu", FSDPConfig(), optim=OptimConfig(lr=1e-3), grad_clip=1e9)
    batch = _batch(model.config.vocab_size).chunk(world)[rank]
    logp, ent = engine.log_probs(batch, micro_batch_size=1, with_entropy=True)
    total = float(_batch(model.config.vocab_size)["response_mask"].sum())

    def loss(log_prob, _entropy, mb):  # mean NLL over all ranks' response tokens; FSDP2 averages over ranks: x world
        return -(log_prob * mb["response_mask"]).sum() / total * world

    engine.forward_backward(batch, loss, micro_batch_size=1)
    grads = {n: p.grad.full_tensor() for n, p in engine.module.named_parameters()}
    norm = engine.step()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"logp": logp, "ent": ent, "grads": grads if rank == 0 else None, "norm": norm, "lr": engine.lr}, f)
    torch.distributed.destroy_process_group()


def test_engine_matches_plain_pytorch(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    got = _two_ranks(_rank, tiny_model_dir, tmp_path / "engine")

    # The oracle: the unsharded model, the whole batch at once, by hand.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    b = _batch(model.config.vocab_size)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[:, PROMPT - 1:-1]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, b["responses"][..., None])[..., 0]  # [4, R]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = -(logp * b["response_mask"]).sum() / b["response_mask"].sum()
    loss.backward()
    want_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))

    got_logp = torch.cat([g["logp"] for g in got])
    assert torch.allclose(got_logp, logp.detach(), atol=1e-5, rtol=0), float((got_logp - logp).abs().max())
    assert torch.allclose(torch.cat([g["ent"] for g in got]), ent.detach(), atol=1e-5, rtol=0)
    for name, p in model.named_parameters():
        g = got[0]["grads"][name]
        scale = float(p.grad.abs().max())
        assert float((g - p.grad).abs().max()) <= 1e-5 * scale + 1e-12, name
    assert got[0]["norm"] == pytest.approx(want_norm, rel=1e-5) and got[1]["norm"] == got[0]["norm"]
    assert got[0]["lr"] == pytest.approx(1e-3)


def test_trimming_right_padding_keeps_every_rows_logits(tiny_model_dir):
    """SFT batches are right-padded to max_length; the worker computes only up to the longest row.
    Oracle: each row alone, unpadded (no hybridflow code). Tolerance 1e-5: other matmul shapes
    reorder fp32 sums."""
    from transformers import AutoModelForCausalLM

    from hybridflow.engine.model import trim_right_padding
    from hybridflow.protocol import Batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lengths, width = [5, 9, 3], 12
    rows = [torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": pos})
    t = trim_right_padding(batch, ("input_ids", "attention_mask", "position_ids"))
    assert {k: tuple(v.shape) for k, v in t.items()} == {k: (3, 9) for k in t}
    with torch.no_grad():
        logits = model(**t).logits
        for i, r in enumerate(rows):
            alone = model(input_ids=r[None]).logits[0]
            torch.testing.assert_close(logits[i, : len(r)], alone, rtol=0, atol=1e-5)
    # a left-padded batch ends in tokens: nothing to cut
    left = Batch.from_dict(tensors={"input_ids": ids.flip(1), "attention_mask": mask.flip(1)})
    assert trim_right_padding(left, ("input_ids",))["input_ids"].shape == (3, width)


class _MeanNLL:
    """A test objective: mean NLL over the response tokens of the GLOBAL mini-batch (FSDP2 averages
    gradients over ranks, hence x world); metric: the rank's mean NLL (sum, tokens)."""

    fields = ("response_mask",)
    remove_padding = None

    def __init__(self, world: int):
        self.world = world

    def mini_batch(self, mini):
        tokens = mini["response_mask"].sum().float()
        torch.distributed.all_reduce(tokens)
        return tokens

    def __call__(self, out, mb, tokens):
        nll = -(out[0] * mb["response_mask"]).sum()
        return nll / tokens * self.world, {"test/nll": (float(nll), float(mb["response_mask"].sum()))}


def _train_rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    join_gloo(rank, world, port)
    from hybridflow.config.schema import FSDPConfig, ModelConfig, OptimConfig
    from hybridflow.engine import TrainEngine
    from hybridflow.models.hf import load_hf_model
    from hybridflow.parallel.dims import ParallelDims
    from hybridflow.parallel.layout import train_mesh
    from hybridflow.run_plan import UpdatePlan

    model = load_hf_model(ModelConfig(path=model_dir), "cpu")
    # lr 0: the weights never move, so every step's gradient is taken at the same point as the oracle's
    engine = TrainEngine(model, train_mesh(ParallelDims(dp=world), "cpu"), "cpu", FSDPConfig(), optim=OptimConfig(lr=0.0), grad_clip=1e9)
    batch = _batch(model.config.vocab_size).chunk(world)[rank]  # rank r: rows 2r, 2r + 1
    metrics = engine.train(batch, _MeanNLL(world), UpdatePlan(micro_rows=1, mini_rows=1, epochs=2))
    steps = {int(s["step"]) for s in engine.optimizer.state.values()}
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"metrics": metrics, "steps": steps}, f)
    torch.distributed.destroy_process_group()


def test_the_engines_update_loop_matches_plain_pytorch(tiny_model_dir, tmp_path):
    """`TrainEngine.train` over 2 ranks, 2 rows each, mini-batches of 1 row per rank, 2 epochs: 4
    optimizer steps, each on the global mini-batch j = rows {j, 2 + j}; grad_norm is the mean of the
    steps' norms and the objective's metric the rank's token-weighted mean. Oracle: the unsharded HF
    model and autograd by hand (no hybridflow code), at lr 0 so no optimizer step amplifies the fp32
    reordering of FSDP2's reduce-scatter (tolerance 1e-5 relative, as above)."""
    from transformers import AutoModelForCausalLM

    got = _two_ranks(_train_rank, tiny_model_dir, tmp_path / "train")

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    b = _batch(model.config.vocab_size)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits[:, PROMPT - 1:-1]
    nll_tok = -torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None])[..., 0] * b["response_mask"]  # [4, R]
    norms = []
    for rows in ([0, 2], [1, 3]):  # the two global mini-batches
        model.zero_grad()
        (nll_tok[rows].sum() / b["response_mask"][rows].sum()).backward(retain_graph=True)
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
    for r, g in enumerate(got):
        rows = [2 * r, 2 * r + 1]
        want_nll = float(nll_tok[rows].sum() / b["response_mask"][rows].sum())
        assert g["steps"] == {4}  # 2 epochs x 2 mini-batches
        assert g["metrics"]["test/nll"] == pytest.approx(want_nll, rel=1e-5)
        assert g["metrics"]["actor/grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-5)
        assert g["metrics"]["actor/lr"] == 0.0
