"""`TrainEngine`: one role's model in its training layout, and everything done to it.

A worker (actor, reference, critic, reward model) holds one engine per model it trains or scores
with and calls only this interface; FSDP2, tensor and pipeline parallelism are the engine's
internals, built from the role's `ParallelDims` (`parallel/layout.py::build_train_model`):

    forward(batch, fn, micro)                  no-grad outputs of fn(module, mb), concatenated
    log_probs(batch, micro, ...)               per-token (log-prob, entropy) of the responses [b, R]
    train(batch, objective, plan)              a role's whole update: epochs x mini-batches (each one
                                               optimizer step) x micro-batches, metric means
    forward_backward(batch, loss_fn, micro)    gradients of the micro-batches' token losses (accumulated)
    forward_backward_module(batch, loss_fn, m) the same for losses on another head: loss_fn(module, mb)
    step() / scheduler_step()                  clip + optimizer step (DTensor- and pipeline-aware)
    save(path) / load(path) / state_dict()     sharded checkpoint (DCP) / full weights
    save_hf(out_dir, tokenizer, rank)          an HF checkpoint of the full weights
    attach_generation(gen) + weights()         the pieces every generation rank needs (3D-HybridEngine)

Losses are objects built once (`algorithms/objectives.py`); the engine calls them per micro-batch
and never knows which loss it runs. A loss that reads per-token fields under a pipeline gets them packed as the
pipeline's target (`fields`), since only the last stage sees the logits.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hybridflow.algorithms import entropy_from_logits, logprobs_from_logits
from hybridflow.config.schema import FSDPConfig, HybridEngineConfig, OptimConfig
from hybridflow.engine.compile import compile_decoder_layers, compile_stats
from hybridflow.engine.cpu_kernels import prefer_cpu_bf16_attention
from hybridflow.engine.fused_logprobs import token_head as fused_token_head
from hybridflow.engine.model import micro_batches, response_logprobs
from hybridflow.engine import sequence_parallel
from hybridflow.engine.optim import build_optimizer, build_scheduler, clip_and_step
from hybridflow.hybrid_engine.executor import HybridEngine
from hybridflow.parallel import ulysses
from hybridflow.parallel.expert_parallel import full_expert_weights, is_expert_param
from hybridflow.parallel.fsdp import MIXED_PRECISION_DTYPES
from hybridflow.parallel.layout import TrainMesh, build_train_model
from hybridflow.protocol import Batch
from hybridflow.run_plan import UpdatePlan
from hybridflow.models.lora import is_adapter_param, merged_state_dict
from hybridflow.models.routing import clear as clear_routes
from hybridflow.models.vlm_inputs import suppressed_token_ids
from hybridflow.utils.checkpoint import load_sharded, save_sharded

# loss_fn(log_prob [b, R], entropy [b, R], mb) -> scalar: the micro-batch's share of the loss.
TokenLossFn = Callable[[torch.Tensor, torch.Tensor, "Batch | dict[str, torch.Tensor]"], torch.Tensor]
# head(module, mb) -> what a non-token objective reads: values [b, R], sequence log-probs [b], scores [b].
HeadFn = Callable[[nn.Module, Batch], torch.Tensor]


class Objective(Protocol):
    """A loss built once (`algorithms/objectives.py`): per mini-batch a context (None: every rank
    skips it), per micro-batch (its share of the mini-batch loss, metrics)."""

    fields: tuple[str, ...]  # per-token fields a token objective reads (the pipeline's loss target)
    remove_padding: bool | None  # None: the engine's setting

    def mini_batch(self, mini: Batch) -> Any: ...

    def __call__(self, out: Any, mb: Any, ctx: Any) -> tuple[torch.Tensor, dict[str, Any]]: ...


class MetricMeans:
    """Means over an update of per-micro-batch metrics: a value (weight 1) or (weighted sum, weight)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            s, w = v if isinstance(v, tuple) else (float(v), 1.0)
            self.sums[k] = self.sums.get(k, 0.0) + s
            self.weights[k] = self.weights.get(k, 0.0) + w

    def means(self) -> dict[str, float]:
        return {k: (s / self.weights[k] if self.weights[k] else 0.0) for k, s in self.sums.items()}


def token_head(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(log-prob, entropy) [b, T, 2] of `targets` [b, T] under logits [b, T, V]: what the last
    pipeline stage returns, so activations, not vocabulary-sized logits, cross the stages (with
    logits_chunk the stage computes the same from its hidden states, `fused_logprobs.token_head`)."""
    return torch.stack([logprobs_from_logits(logits, targets), entropy_from_logits(logits)], dim=-1)


class TrainEngine:
    """`model` (an unsharded HF model on `device`) built in `mesh`'s layout; an optimizer and a
    learning-rate schedule when `optim` is given, else frozen (reference, scoring reward model)."""

    def __init__(self, model: nn.Module, mesh: TrainMesh, device: str, fsdp: FSDPConfig, *, optim: OptimConfig | None = None,
                 total_steps: int = 1, grad_clip: float = 1.0, pipeline_schedule: str = "1f1b", remove_padding: bool = False,
                 exact: bool = False, logits_chunk: int | None = None, compile: bool = False):
        """exact: token log-probs run each sequence alone (`models/exact.py`), as the exact
        rollout mode's sampler does (actor_rollout_ref.rollout.exact). logits_chunk: token
        log-probs and entropies go through the LM head this many tokens at a time, never as
        [tokens, vocab] logits (`engine/fused_logprobs.py`, model.use_fused_kernels); None = plain.
        compile: each decoder layer's forward torch.compile'd (`engine/compile.py`, use_torch_compile)."""
        self.mesh, self.layout, self.device = mesh, mesh.layout, device
        self.grad_clip, self.remove_padding, self.exact, self.logits_chunk = grad_clip, remove_padding, exact, logits_chunk
        # The whole model's parameters (a pipeline stage keeps only its own): the resharding plan's.
        self.full_shapes = {n: (tuple(p.shape), p.element_size()) for n, p in model.named_parameters()}
        self.lora = any(is_adapter_param(n) for n in self.full_shapes)  # LoRA adapters injected (models/lora.py)
        # A VLM's vision tokens, which the rollout never samples: every token log-prob and entropy here (old, reference,
        # the update's) leaves them out of the softmax too, so the policy trained is the one sampled (models/vlm_inputs.py)
        self.suppress = suppressed_token_ids(getattr(model, "config", None))
        # bf16 compute on CPU: attention as two AMX matmuls (engine/cpu_kernels.py); not in the exact mode, whose
        # sampler (the generation model at gen_tp 1) must run the trainer's very kernels
        if fsdp.mixed_precision in MIXED_PRECISION_DTYPES and not exact:
            prefer_cpu_bf16_attention(model, MIXED_PRECISION_DTYPES[fsdp.mixed_precision], device)
        self.compiled = compile
        if compile:  # before FSDP2: the compiled code replaces each layer's forward, FSDP2's hooks wrap it eagerly
            compile_decoder_layers(model)
        self.sp_group = mesh.sp_group  # Ulysses: token log-probs run with the packed sequence split over it (parallel/ulysses.py)
        if self.suppress and (self.sp_group is not None or mesh.layout.pp > 1):
            raise ValueError("a vision-language model's token log-probs run on FSDP2 / TP only: Ulysses and pipeline stages carry no "
                             "pixel inputs (set the sequence-parallel and pipeline sizes to 1)")
        if self.sp_group is not None:
            ulysses.install(model)
        self.module, self.pipe = build_train_model(model, mesh, device, fsdp, pipeline_schedule, head=token_head,
                                                   fused_head=None if logits_chunk is None else (fused_token_head, logits_chunk))
        self.optimizer = self.scheduler = None
        if optim is not None:
            self.optimizer = build_optimizer([p for p in self.module.parameters() if p.requires_grad], optim)
            self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        else:
            self.module.eval().requires_grad_(False)
        self.hybrid = None  # the 3D-HybridEngine, once a generation layout is attached

    @property
    def recording(self) -> bool:
        """False during a pipeline schedule's shape-inference call of the loss (its gradient is
        discarded): a loss function keeps its metrics out of that call."""
        return self.pipe is None or not self.pipe.inferring

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, batch: Batch, fn: Callable[[nn.Module, Batch], torch.Tensor], micro_batch_size: int,
                max_tokens: int | None = None) -> torch.Tensor:
        """cat over micro-batches of fn(module, mb) (any head: values, scores, sequence log-probs)."""
        if self.pipe is not None or self.sp_group is not None:
            raise ValueError("a pipeline- or sequence-parallel engine computes token log-probs only (TrainEngine.log_probs)")
        self.module.eval()
        batch = batch.to(self.device)
        clear_routes(self.module)  # heads other than token log-probs route naturally
        return torch.cat([fn(self.module, mb) for mb in micro_batches(batch, micro_batch_size, max_tokens)])

    @torch.no_grad()
    def log_probs(self, batch: Batch, micro_batch_size: int, max_tokens: int | None = None, temperature: float = 1.0,
                  with_entropy: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Response log-probs [b, R] (and entropies); under a pipeline only the last stage has them
        (None elsewhere: its result is not collected)."""
        self.module.eval()
        batch = batch.to(self.device)
        if self.pipe is not None:
            out = self.pipe.run(batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"], micro_batch_size, temperature)
            return (None, None) if out is None else (out[..., 0], out[..., 1] if with_entropy else None)
        logps, ents = [], []
        for mb in micro_batches(batch, micro_batch_size, max_tokens):
            logp, ent = self._token_logprobs(mb, temperature, self.remove_padding, self.exact, with_entropy)
            logps.append(logp)
            ents.append(ent)
        return torch.cat(logps), (torch.cat(ents) if with_entropy else None)

    # ------------------------------------------------------------------ training
    def train(self, batch: Batch, objective: Objective, plan: UpdatePlan, *, head: HeadFn | None = None, temperature: float = 1.0,
              optimizer_step: bool = True, loss_scale: float = 1.0) -> dict[str, float]:
        """One update call on this rank's rows: plan.epochs passes over mini-batches of plan.mini_rows
        rows, each one optimizer step (clip, step), cut into micro-batches whose gradients accumulate;
        the schedule steps once per call. Returns the objective's metrics averaged over the call,
        `<prefix>/grad_norm` (mean over steps) and `<prefix>/lr`.

        head None: the objective reads (log_prob, entropy) [b, R] of the responses (pipeline-capable);
        else what head(module, mb) returns. Gradient accumulation ACROSS calls (DataFlow
        grad_accum_steps): optimizer_step=False only accumulates (loss x loss_scale), the next call
        with optimizer_step=True steps on the sum; each such call must be at most one mini-batch."""
        rows = plan.mini_rows or len(batch)
        if not optimizer_step and (plan.epochs > 1 or len(batch) > rows):
            raise ValueError(f"gradient accumulation across calls needs each call to be at most one mini-batch "
                             f"({rows} sequences per rank) and ppo_epochs == 1; got {len(batch)} sequences, "
                             f"ppo_epochs={plan.epochs}: lower the stage's batch_size")
        means = MetricMeans()

        def loss(out, mb, ctx) -> torch.Tensor:
            value, metrics = objective(out, mb, ctx)
            if self.recording:  # not a pipeline's shape-inference call
                means.add(metrics)
            return value * loss_scale

        for _ in range(plan.epochs):
            for mini in batch.split(rows):
                mini = mini.to(self.device)
                ctx = objective.mini_batch(mini)
                if ctx is None:  # e.g. DPO's all-tie mini-batch: every rank skips it together
                    continue
                if head is None:
                    self.forward_backward(mini, lambda lp, ent, mb: loss((lp, ent), mb, ctx), plan.micro_rows, plan.max_tokens, temperature,
                                          objective.fields, objective.remove_padding)
                else:
                    self.forward_backward_module(mini, lambda module, mb: loss(head(module, mb), mb, ctx), plan.micro_rows)
                if optimizer_step:
                    means.add({f"{plan.metric_prefix}/grad_norm": self.step()})
        metrics = means.means()
        metrics[f"{plan.metric_prefix}/lr"] = self.lr
        if self.compiled:  # dynamo's process-wide counts so far: graphs built, graph breaks, recompiles (engine/compile.py)
            metrics.update({f"{plan.metric_prefix}/{k}": float(v) for k, v in compile_stats().items()})
        if optimizer_step:
            self.scheduler_step()
        return metrics

    def forward_backward(self, batch: Batch, loss_fn: TokenLossFn, micro_batch_size: int, max_tokens: int | None = None,
                         temperature: float = 1.0, fields: tuple[str, ...] = (), remove_padding: bool | None = None) -> None:
        """Accumulate the gradient of sum over micro-batches of loss_fn(log_prob, entropy, mb) on the
        responses of `batch` (one mini-batch). Under a pipeline, mb is {field: [b, R]} for the
        per-token `fields` the loss reads (those present in the batch)."""
        self.module.train()
        batch = batch.to(self.device)
        if self.pipe is not None:
            present = [k for k in fields if k in batch]
            target = torch.stack([batch[k].float() for k in present], dim=-1)  # [b, R, len(present)]

            def loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
                return loss_fn(out[..., 0], out[..., 1], {k: tgt[..., i] for i, k in enumerate(present)})

            self.pipe.run(batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["responses"], micro_batch_size,
                          temperature, loss=loss, target=target)
            return
        packed = self.remove_padding if remove_padding is None else remove_padding
        exact = self.exact and remove_padding is None  # (an objective with its own layout, SFT's, keeps it)
        for mb in micro_batches(batch, micro_batch_size, max_tokens):
            loss_fn(*self._token_logprobs(mb, temperature, packed, exact), mb).backward()

    def _token_logprobs(self, mb: Batch, temperature: float, packed: bool, exact: bool, with_entropy: bool = True):
        """(log-prob, entropy) [b, R] of mb's responses; under Ulysses always packed with the sequence split over the sp group."""
        if self.sp_group is not None:
            return sequence_parallel.response_logprobs(self.module, mb, self.sp_group, temperature, self.logits_chunk, with_entropy)
        return response_logprobs(self.module, mb, temperature, packed, exact, self.logits_chunk, with_entropy, self.suppress)

    def forward_backward_module(self, batch: Batch, loss_fn: Callable[[nn.Module, Batch], torch.Tensor], micro_batch_size: int) -> None:
        """Accumulate the gradient of sum over micro-batches of loss_fn(module, mb), for losses on
        another head than token log-probs (values, reward scores, sequence log-probs); no pipeline."""
        if self.pipe is not None or self.sp_group is not None:
            raise ValueError("a pipeline- or sequence-parallel engine trains on token losses only (TrainEngine.forward_backward)")
        self.module.train()
        clear_routes(self.module)  # heads other than token log-probs route naturally
        for mb in micro_batches(batch.to(self.device), micro_batch_size):
            loss_fn(self.module, mb).backward()

    def step(self) -> float:
        """Clip the global gradient norm, step (skipped on inf/nan), zero the gradients; the norm."""
        lay = self.layout
        experts = [p for n, p in self.module.named_parameters() if is_expert_param(n)] if lay.ep > 1 else []  # sharded by expert over ep
        return clip_and_step(self.module, self.optimizer, self.grad_clip, None if lay.trivial else lay.tp * lay.dp, experts, lay.ep)

    def scheduler_step(self) -> None:
        self.scheduler.step()

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ state
    def save(self, path: str) -> None:
        """Sharded model + optimizer + schedule (DCP), every rank its own shards; with LoRA the
        adapters and their optimizer state only (the frozen base is the model.path checkpoint)."""
        save_sharded(path, self.module, self.optimizer, self.scheduler, flatten_optimizer=self.layout.pp > 1, trainable_only=self.lora)

    def load(self, path: str) -> None:
        load_sharded(path, self.module, self.optimizer, self.scheduler, flatten_optimizer=self.layout.pp > 1, trainable_only=self.lora)

    def trainable_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: parameters (its shards), gradients (one per trainable shard, alive
        from backward to the step) and optimizer state (AdamW's moments, after the first step)."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = list(self.module.parameters())
        state = [t for s in (self.optimizer.state.values() if self.optimizer else ()) for t in s.values() if isinstance(t, torch.Tensor)]
        return {"param_bytes": sum(local(p).nbytes for p in params),
                "grad_bytes": sum(local(p).nbytes for p in params if p.requires_grad),
                "optimizer_bytes": sum(local(t).nbytes for t in state if t.dim() > 0)}  # not AdamW's scalar step counts

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) weights on CPU; a collective: every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.layout.ep > 1:  # its expert weights hold this EP rank's experts only (parallel/expert_parallel.py)
            sd.update({k: v.cpu() for k, v in full_expert_weights(self.module).items() if k in sd})
        return sd

    def save_hf(self, out_dir: str, tokenizer, rank: int) -> str:
        """The full weights as an HF checkpoint (+ tokenizer, or a VLM's processor: anything with
        save_pretrained), written by rank 0; a collective."""
        full = self.state_dict()
        if rank == 0:
            if self.lora:  # the adapters merged into the base: a plain HF checkpoint
                full = merged_state_dict(full, self.module)
            self.module.save_pretrained(out_dir, state_dict=full)
            tokenizer.save_pretrained(out_dir)
        torch.distributed.barrier()
        return out_dir

    # ------------------------------------------------------------------ weights for generation
    def attach_generation(self, gen_model, gen_shard_dims: dict[str, int | None], gen_tp: int, cfg: HybridEngineConfig,
                          consecutive: bool | None = None, dtype: torch.dtype | None = None):
        """The 3D-HybridEngine from this engine's layout to a generation layout (`rollout.GenLayout`):
        gen_model is the backend's own storages (written in place) or None (staged pieces); dtype:
        the generation weights' (None = the training parameters')."""
        self.hybrid = HybridEngine(self.module, gen_model, gen_shard_dims, gen_tp, cfg, self.device, layout=self.layout,
                                   full_shapes=self.full_shapes, consecutive=consecutive, dtype=dtype)
        return self.hybrid

    def weights(self, optimized: bool = True) -> Iterator:
        """The `WeightPiece`s (name, shape, box, tensor) this rank's generation slices need, moved
        with the planner's minimum (optimized) or the naive all-gather."""
        if self.hybrid is None:
            raise RuntimeError("no generation layout attached: call attach_generation first")
        return self.hybrid.pieces(optimized=optimized)
