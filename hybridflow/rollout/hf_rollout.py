"""HF `generate` as the rollout backend: the policy's HF model in the generation layout.

The model is tensor-parallel over gen_tp ranks (DTensor, `parallel/tensor_parallel.py`); gen_dp
replicas generate different prompts. Its weights come from a *weight source*: the 3D-HybridEngine
(colocated with the trained actor: moves only what each rank lacks, `hybrid_engine/executor.py`)
or a cross-pool receiver (a generation-only pool: `hybrid_engine/cross_pool.py`). Both expose
`reshard(optimized) -> stats`, `max_abs_diff()`, `release()` / `acquired` and a `trace`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import GenerationConfig

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.hybrid_engine.memory import rss_bytes
from hybridflow.protocol import Batch, Completion, Request, SamplingParams
from hybridflow.rollout.base import generate_batch, response_lengths


class HFRollout:
    def __init__(self, model: torch.nn.Module, tokenizer, device: str, dp_index: int, source, enable_resharding_opt: bool = True):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.dp_index = dp_index  # the TP ranks of one replica must draw the same samples
        self.source = source
        self.optimized = enable_resharding_opt

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return generate_batch(self, prompts, params, self.tokenizer.pad_token_id)

    @torch.no_grad()
    def generate_requests(self, requests: Sequence[Request]) -> list[Completion]:
        """Requests that share their SamplingParams run as one left-padded `generate` call (seeded
        by params.seed and this replica), the groups one after another; completions in order."""
        if not self.source.acquired:
            raise RuntimeError("generation buffers are released: sync the weights (reshard) before generating")
        pad = self.tokenizer.pad_token_id
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.params, []).append(i)
        out: list[Completion | None] = [None] * len(requests)
        for params, rows in groups.items():
            P = max(len(requests[i].prompt_ids) for i in rows)
            input_ids = torch.full((len(rows), P), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(rows), P), dtype=torch.long)
            for j, i in enumerate(rows):  # left padding: the prompts end where generation starts
                ids = requests[i].prompt_ids
                input_ids[j, P - len(ids):] = torch.tensor(ids)
                attention_mask[j, P - len(ids):] = 1
            for i, c in zip(rows, self._generate(input_ids.to(self.device), attention_mask.to(self.device), params)):
                out[i] = c
        return out

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams) -> list[Completion]:
        """One HF `generate` over left-padded prompts [b, P] -> one Completion per row."""
        tok = self.tokenizer
        torch.manual_seed(params.seed * 1000 + self.dp_index)
        stop_ids = [tok.eos_token_id, *params.stop_token_ids]
        sample = params.sampling
        temperature = params.effective_temperature
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=(params.top_k if params.top_k > 0 else 0) if sample else None,
            eos_token_id=stop_ids,
            pad_token_id=tok.pad_token_id,
            stop_strings=list(params.stop) or None,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg, tokenizer=tok)
        gen = out.sequences[:, input_ids.shape[1] :]  # [b, R'] with R' <= R
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [b, R', V]
        logp = logprobs_from_logits(logits, gen).cpu()  # [b, R']
        lengths = response_lengths(gen, stop_ids, tok.pad_token_id).tolist()  # [b]
        completions = []
        for row, n in zip(gen.tolist(), lengths):
            toks = row[:n]
            # "length" only when the limit cut it: the last token is no stop id and no stop string ends it
            stopped = n < params.max_new_tokens or (n > 0 and toks[-1] in stop_ids) or (
                bool(params.stop) and tok.decode(toks).endswith(tuple(params.stop)))
            completions.append(Completion(tuple(toks), tuple(logp[len(completions), :n].tolist()), "stop" if stopped else "length"))
        return completions

    def sync_weights(self, measure_baseline: bool = False, check: bool = False, trace: bool = False) -> dict:
        """Training -> generation layout. measure_baseline also runs (and times) the naive path
        first; check compares the generation buffers with the trained weights bit for bit; trace
        returns Chrome-trace events."""
        src = self.source
        src.trace.enabled = trace
        out: dict = {}
        if measure_baseline:
            out["baseline"] = src.reshard(optimized=False)
        out.update(src.reshard(optimized=self.optimized))
        if check:
            out["max_diff"] = src.max_abs_diff()
        out["rss_bytes"] = rss_bytes()
        if trace:
            out["trace"] = src.trace.drain()
        return out

    def release(self) -> None:
        self.source.release()
