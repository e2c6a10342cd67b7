"""HF `generate` as the rollout backend: the policy's HF model in the generation layout.

The model is tensor-parallel over gen_tp ranks (DTensor, `parallel/tensor_parallel.py`); gen_dp
replicas generate different prompts. Its weights come from a *weight source*: the 3D-HybridEngine
(colocated with the trained actor: moves only what each rank lacks, `hybrid_engine/executor.py`)
or a cross-pool receiver (a generation-only pool: `hybrid_engine/cross_pool.py`). Both expose
`reshard(optimized) -> stats`, `max_abs_diff()`, `release()` / `acquired` and a `trace`.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.hybrid_engine.memory import rss_bytes
from hybridflow.protocol import Batch
from hybridflow.rollout.base import SamplingParams, response_lengths, rollout_batch


class HFRollout:
    def __init__(self, model: torch.nn.Module, tokenizer, device: str, dp_index: int, source, enable_resharding_opt: bool = True):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.dp_index = dp_index  # the TP ranks of one replica must draw the same samples
        self.source = source
        self.optimized = enable_resharding_opt

    @torch.no_grad()
    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if not self.source.acquired:
            raise RuntimeError("generation buffers are released: sync the weights (reshard) before generating")
        tok = self.tokenizer
        torch.manual_seed(params.seed * 1000 + self.dp_index)
        input_ids = prompts["input_ids"].to(self.device)
        attention_mask = prompts["attention_mask"].to(self.device)
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
        logp = logprobs_from_logits(logits, gen)
        pad = params.max_new_tokens - gen.shape[1]
        responses = torch.nn.functional.pad(gen, (0, pad), value=tok.pad_token_id)
        logp = torch.nn.functional.pad(logp, (0, pad), value=0.0)
        return rollout_batch(input_ids, attention_mask, responses, logp, response_lengths(responses, stop_ids, tok.pad_token_id), params)

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
