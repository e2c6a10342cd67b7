"""HF `generate` as the rollout backend ("hf"): the policy's HF model in the generation layout.

The model is tensor-parallel over gen_tp ranks (DTensor, `parallel/tensor_parallel.py`); gen_dp
replicas generate different prompts. Its weights are pushed in as `WeightPiece`s by a weight
source (the colocated 3D-HybridEngine or the cross-pool receiver, `hybrid_engine/`): its
`layout()` offers the model's own parameter storages, so the colocated engine writes there in
place and its pieces alias them (nothing is copied); pieces from elsewhere are copied in.
The backend owns that memory: `sleep()` frees the storages after generation unless
`keep_buffers` (the hybrid engine's keep_generation_buffers; a generation-only pool keeps them),
keeping the static pieces (frozen parameters, never sent again), and `wake()` re-allocates them
before the next sync.

Batching: with `continuous` (actor_rollout_ref.rollout.continuous_batching; the builder's default is
off) requests run through a continuous-batching scheduler (`rollout/scheduler.py`): a request
joins the running batch at the next step, whichever call brought it, and leaves it (its completion
returned) the step it finishes; a session's cache is kept between its requests. Weight updates,
sleep and wake hold the scheduler between two steps (`pause()`). Three cases keep the per-call
path (`_generate`: the requests of one call that share their SamplingParams as one left-padded HF
`generate`, the groups one after another): `continuous=False` (the default of a run, and the baseline
`bench/continuous_batching.py` compares), gen_tp > 1 (a replica's TP ranks would each need the same steps: rank 0's schedule
broadcast every step, not built), and a model the dense padded cache does not fit (sliding-window
layers). The exact mode (`_generate_exact`) keeps its own path: `generate` drafts, the trainer's
computation decides each token (speculative sampling, `rollout/exact_sampler.py`), bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterable, Sequence

import torch
from transformers import GenerationConfig

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.parallel.dtensor import free_storage, held_slice, own_storage, restore_storage
from hybridflow.protocol import Batch, Completion, GenLayout, Request, SamplingParams, WeightPiece
from hybridflow.rollout.base import Continuation, PrefixMissing, RolloutContext, generate_batch, left_padded, response_lengths
from hybridflow.rollout.exact_sampler import Draft, sample_exact
from hybridflow.rollout.scheduler import ContinuousScheduler, unsupported_reason
from hybridflow.models.vlm_inputs import MULTI_MODAL_KEY, forward_inputs, pack_multi_modal_inputs, request_images, suppress_logits, suppressed_token_ids


class HFRollout:
    def __init__(self, model: torch.nn.Module, tokenizer, device: str, tp_index: int = 0, dp_index: int = 0, gen_tp: int = 1,
                 keep_buffers: bool = True, exact: bool = False, continuous: bool = True, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 8192, keep_tokens: int = 8192, record_routes: bool = False):
        """keep_buffers: keep the weights' memory while asleep (False: `sleep()` frees every storage
        but the static pieces', `wake()` re-allocates them; the next weight sync fills them).
        exact: sample through `exact_row_logits`, the trainer's own computation (`_generate_exact`).
        continuous: batch per decode step (`ContinuousScheduler`: max_num_seqs rows, at most
        max_num_batched_tokens prompt tokens per prefill step, keep_tokens cached tokens of finished
        sessions); False: per call (`_generate`).
        record_routes: an MoE model's completions carry each position's experts (`routed_experts`,
        models/routing.py: routing replay)."""
        self.exact = exact
        from hybridflow.models.routing import RouteRecorder

        self.recorder = RouteRecorder(model) if record_routes else None
        self.exact_model: torch.nn.Module | None = None  # exact at gen_tp = N: the training engine's module samples
        self.exact_stats: dict = {}  # the exact sampler's last call: target passes, draft calls, draft tokens proposed and kept
        from hybridflow.parallel.tensor_parallel import gen_shard_dims

        self.model, self.tokenizer, self.device = model, tokenizer, device
        contiguous_head_input(model)
        self.tp_index, self.dp_index, self.gen_tp = tp_index, dp_index, gen_tp  # a replica's TP ranks draw the same samples
        self.params = dict(model.named_parameters())
        self.shard_dims = gen_shard_dims(model)
        self.keep_buffers = keep_buffers
        if not keep_buffers:  # freed by sleep(): private, resizable storages
            for p in self.params.values():
                own_storage(p)
        self.static: set[str] = set()  # parameters whose (static) pieces arrived: kept while asleep, never sent again
        self.borrowed: set[str] = set()  # parameters that are the trainer's own shards (colocated, gen_tp = N): never freed here
        self.awake = True
        self.policy_version: int | None = None  # stamped on every sampled token when set (a pool of its own: the worker sets it)
        self.weight_epoch = 0  # weight updates, sleeps and wakes so far: a change makes the scheduler's caches stale
        why = ("rollout.exact (one request at a time, the trainer's computation)" if exact else "continuous=False" if not continuous
               else f"gen_tp={gen_tp} (every TP rank of a replica would need the same steps)" if gen_tp > 1 else unsupported_reason(model))
        self.per_call_reason = why  # None: continuous batching
        self.call_lock = threading.RLock()  # the per-call and exact paths: one call at a time, weights written between calls
        self.scheduler = None if why else ContinuousScheduler(
            model, tokenizer, device, dp_index=dp_index, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            keep_tokens=keep_tokens, version=lambda: self.policy_version, epoch=lambda: self.weight_epoch, recorder=self.recorder)

    def pause(self) -> contextlib.AbstractContextManager:
        """No generation step runs inside this context: the scheduler waits between two steps (per
        call: the call in progress ends first, the next one waits)."""
        return self.scheduler.pause() if self.scheduler is not None else self.call_lock

    def layout(self) -> GenLayout:
        return GenLayout(self.gen_tp, consecutive=False, shard_dims=self.shard_dims, buffers=self.params, dtype=next(iter(self.params.values())).dtype)

    @torch.no_grad()
    def update_weights(self, pieces: Iterable[WeightPiece]) -> dict:
        """Write each piece into its parameter's slice (by the parameter's own layout); a piece
        that already is that slice (the colocated engine wrote in place) is not copied. Between two
        scheduler steps: the requests in flight continue on the new weights (prefilled again first)."""
        with self.pause():
            self.weight_epoch += 1
            return self._update_weights(pieces)

    def _update_weights(self, pieces: Iterable[WeightPiece]) -> dict:
        copied = aliased = 0
        for piece in pieces:
            if piece.static:
                self.static.add(piece.name)
            if piece.borrowed:
                self.borrowed.add(piece.name)
            dst = held_slice(self.params[piece.name].data, piece.box)
            if dst.data_ptr() == piece.tensor.data_ptr() and dst.shape == piece.tensor.shape and dst.stride() == piece.tensor.stride():
                aliased += 1
                continue
            dst.copy_(piece.tensor)
            copied += piece.tensor.numel() * piece.tensor.element_size()
        return {"copied_bytes": copied, "in_place_params": aliased}

    def sleep(self) -> None:
        """After generation: the weights are stale until the next sync. Unless keep_buffers, their
        storages are freed (the static ones stay: they never change and are not sent again). Requests
        still in flight fail (their weights are going), naming how many."""
        with self.pause():
            if self.scheduler is not None:
                self.scheduler.refusing = "the rollout is asleep (its weights are stale or freed): sync the weights (reshard) before generating"
                self.scheduler.fail_all(RuntimeError("the rollout was put to sleep (sleep_rollout / release_after) with this request in flight"))
            self.weight_epoch += 1
            if not self.keep_buffers:
                for name, p in self.params.items():
                    if name not in self.static and name not in self.borrowed:
                        free_storage(p)
            self.awake = False

    def wake(self) -> None:
        """Before a weight sync: re-allocate what `sleep()` freed (the sync writes every byte of it)."""
        with self.pause():
            self.weight_epoch += 1
            for name, p in self.params.items():
                if name not in self.borrowed:
                    restore_storage(p)
            self.awake = True
            if self.scheduler is not None:
                self.scheduler.refusing = None

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        if MULTI_MODAL_KEY in prompts:  # image prompts: one per-call generate with the rows' pixel inputs (models/vlm_inputs.py)
            return self._generate_images(prompts, params)
        return generate_batch(self, prompts, params, self.tokenizer.pad_token_id)

    @torch.no_grad()
    def _generate_images(self, prompts: Batch, params: SamplingParams) -> Batch:
        """A VLM's prompts (input_ids / attention_mask [b, P] left-padded, multi_modal_inputs per row) through one
        HF `generate` on the per-call path (the continuous-batching scheduler and the exact sampler take token ids
        only: refused). The result carries the M-RoPE position ids [b, 3, P+R] of prompt + response."""
        if self.scheduler is not None or self.exact:
            raise RuntimeError("image prompts run on the per-call HF generate path: set actor_rollout_ref.rollout.continuous_batching=false "
                               "and actor_rollout_ref.rollout.exact=false")
        if not self.awake:
            raise RuntimeError("the rollout is asleep (its weights are stale or freed): sync the weights (reshard) before generating")
        from hybridflow.data.vision import rows_position_ids

        ids, mask = prompts["input_ids"].to(self.device), prompts["attention_mask"].to(self.device)
        _, mm = forward_inputs(prompts.to(self.device))  # pixel_values [sum P_i, D], image_grid_thw [n, 3]
        with self.call_lock:
            completions = self._generate(ids, mask, params, self._vlm_kwargs(ids, mm))
        out = generate_batch(self, prompts, params, self.tokenizer.pad_token_id, completions=completions)
        rows = list(prompts[MULTI_MODAL_KEY])
        out["position_ids"] = rows_position_ids(self.model.config, out["input_ids"], out["attention_mask"], rows)  # [b, 3, P+R]
        out[MULTI_MODAL_KEY] = rows
        return out

    def _vlm_kwargs(self, ids: torch.Tensor, mm: dict) -> dict | None:
        """A VLM's extra `generate` kwargs for left-padded prompts ids [b, P] and their images' pixel inputs mm (rows packed in
        order: pixel_values [sum P_i, D], image_grid_thw [n, 3]; {} when none has an image); None for a text model."""
        cfg = self.model.config
        if getattr(cfg, "image_token_id", None) is None:
            return None
        out = {k: v.to(self.device) for k, v in mm.items()}
        out["mm_token_type_ids"] = (ids == cfg.image_token_id).long()  # the model computes its rope index from it
        # Never sample a vision token: a response's <|image_pad|> would be taken for an image's place in every later forward
        # (the trainer's log-prob pass leaves the same ids out of its softmax: engine/model.py).
        out["suppress_tokens"] = list(suppressed_token_ids(cfg))
        return out

    @torch.no_grad()
    def generate_requests(self, requests: Sequence[Request]) -> list[Completion]:
        """Completions in order. Continuous batching: the requests join the scheduler's running
        batch (each sampled with a generator seeded by params.seed, this replica and its position in
        the call) and this call returns when its last one finished; other calls' requests may run
        beside them. Per call: requests that share their SamplingParams run as one left-padded
        `generate` call (seeded by params.seed and this replica), the groups one after another."""
        if not self.awake:
            raise RuntimeError("the rollout is asleep (its weights are stale or freed): sync the weights (reshard) before generating")
        if self.scheduler is not None:
            if any(request_images(r) for r in requests):  # the scheduler's steps carry token ids only
                raise RuntimeError("requests with images (a multi-turn trajectory's) run on the per-call HF generate path: "
                                   "set actor_rollout_ref.rollout.continuous_batching=false")
            return self.scheduler.generate(requests)
        with self.call_lock:  # concurrent calls (a replica's concurrency group) run one after another here
            return self._generate_per_call(requests)

    def _generate_per_call(self, requests: Sequence[Request]) -> list[Completion]:
        if any(isinstance(r, Continuation) for r in requests):  # only the scheduler keeps sessions: the caller sends the whole prompt
            plain = [r for r in requests if not isinstance(r, Continuation)]
            rest = iter(self._generate_per_call(plain) if plain else [])
            return [PrefixMissing((), (), "length") if isinstance(r, Continuation) else next(rest) for r in requests]
        if self.exact:  # one request at a time, whatever its params
            if any(request_images(r) for r in requests):
                raise RuntimeError("the exact sampler scores token ids only: requests with images need actor_rollout_ref.rollout.exact=false")
            (self.exact_model or self.model).eval()
            return self._generate_exact(requests)
        pad = self.tokenizer.pad_token_id
        groups: dict[SamplingParams, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.params, []).append(i)
        out: list[Completion | None] = [None] * len(requests)
        for params, rows in groups.items():
            input_ids, attention_mask = left_padded([requests[i].prompt_ids for i in rows], pad)  # the prompts end where generation starts
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            # a VLM: the group's images in row order (ImageRequest; rows without images add none), the vision tokens suppressed
            mm = self._vlm_kwargs(input_ids, pack_multi_modal_inputs([request_images(requests[i]) for i in rows]))
            for i, c in zip(rows, self._generate(input_ids, attention_mask, params, mm)):
                out[i] = c
        return out

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams,
                  model_kwargs: dict | None = None) -> list[Completion]:
        """One HF `generate` over left-padded prompts [b, P] -> one Completion per row (model_kwargs: a VLM's pixel inputs)."""
        tok = self.tokenizer
        torch.manual_seed(params.seed * 1000 + self.dp_index)
        stop_ids = [tok.eos_token_id, *params.stop_token_ids]
        sample = params.sampling
        temperature = params.effective_temperature
        gen_cfg = _generation_config(params, tok, params.max_new_tokens, output_logits=True)
        model_kwargs = dict(model_kwargs or {})
        gen_cfg.suppress_tokens = model_kwargs.pop("suppress_tokens", None)  # a VLM's vision tokens (`_generate_images`)
        with self.recorder.capture() if self.recorder is not None else contextlib.nullcontext([]) as forwards:
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_cfg, tokenizer=tok, **model_kwargs)
        gen = out.sequences[:, input_ids.shape[1] :]  # [b, R'] with R' <= R
        routes = self._routes(forwards, attention_mask, gen.shape[1]) if self.recorder is not None else [None] * gen.shape[0]
        # [b, R', V]; the suppressed tokens -inf, as in the scores sampled from: the policy's own distribution (a VLM's, as the
        # trainer computes it), before any truncation
        logits = suppress_logits(torch.stack(out.logits, dim=1).float() / temperature, gen_cfg.suppress_tokens or ())
        untruncated = logprobs_from_logits(logits, gen).cpu()  # [b, R']
        # HF's processed scores: logits / T with the tokens top-k / top-p cut set to -inf
        scores = torch.stack(out.scores, dim=1).float() if sample else logits  # [b, R', V]
        logp = logprobs_from_logits(scores, gen).cpu() if sample else untruncated
        top = None
        if params.top_logprobs > 0:  # the k most likely under the distribution sampled from: [b, R', k]
            top_lp, top_ids = torch.log_softmax(scores, dim=-1).topk(min(params.top_logprobs, scores.shape[-1]), dim=-1)
            top = [[tuple(zip(i, v)) for i, v in zip(ri, rv)] for ri, rv in zip(top_ids.tolist(), top_lp.tolist())]
        lengths = response_lengths(gen, stop_ids, tok.pad_token_id).tolist()  # [b]
        completions = []
        for row, n in zip(gen.tolist(), lengths):
            toks = row[:n]
            # "length" only when the limit cut it: the last token is no stop id and no stop string ends it
            stopped = n < params.max_new_tokens or (n > 0 and toks[-1] in stop_ids) or (
                bool(params.stop) and tok.decode(toks).endswith(tuple(params.stop)))
            i = len(completions)
            completions.append(Completion(tuple(toks), tuple(logp[i, :n].tolist()), "stop" if stopped else "length",
                                          tuple(untruncated[i, :n].tolist()), top_logprobs=None if top is None else tuple(top[i][:n]),
                                          routed_experts=None if routes[i] is None else routes[i][: int(attention_mask[i].sum()) + n]))
        return completions

    def _routes(self, forwards: list[torch.Tensor], attention_mask: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """One `generate`'s router records -> per row [p_i + steps, L, k]: its prompt's (the prefill forward,
        [b*P, L, k], without the left padding), then each decode step's input token ([b, L, k] each: the
        token sampled the step before), then -1 for the last sampled token (never fed back)."""
        b, P = attention_mask.shape
        if len(forwards) != steps:
            raise RuntimeError(f"routing record: generate ran {len(forwards)} forwards for {steps} sampled tokens")
        pre = forwards[0].view(b, P, *forwards[0].shape[1:])  # [b, P, L, k]
        dec = torch.stack(forwards[1:], dim=1) if steps > 1 else pre[:, :0]  # [b, steps - 1, L, k]
        last = self.recorder.empty(1)
        mask = attention_mask.bool().cpu()
        return [torch.cat([pre[i][mask[i]], dec[i], last]) for i in range(b)]


    def _generate_exact(self, requests: Sequence[Request]) -> list[Completion]:
        """Speculative sampling (`rollout/exact_sampler.py`): this replica's KV-cached `generate`
        drafts, `exact_row_logits` of the trainer's module (exact_model) or of this one decides; each
        request's draws from a generator seeded by the call's seed, this replica and its position."""
        model = self.exact_model or self.model
        completions, self.exact_stats = sample_exact(
            requests, model, self._draft, self.tokenizer, self.device,
            seed_of=lambda r, i: (r.params.seed * 1000 + self.dp_index) * 100_003 + i,
            draft_seed=lambda params, rnd: (params.seed * 1000 + self.dp_index) * 7_919 + rnd)
        return completions

    def _draft(self, prompts: Sequence[Sequence[int]], params: SamplingParams, max_new_tokens: int, seed: int) -> list[Draft]:
        """The exact sampler's draft: one left-padded `generate` of `prompts` -> per row the sampled
        tokens (up to its stop) and the processed distribution each was drawn from ([n, V] fp32)."""
        pad = self.tokenizer.pad_token_id
        input_ids, attention_mask = left_padded(prompts, pad)  # [b, P]
        P = input_ids.shape[1]
        torch.manual_seed(seed)
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                  generation_config=_generation_config(params, self.tokenizer, max_new_tokens), tokenizer=self.tokenizer)
        gen = out.sequences[:, P:]  # [b, R']
        lengths = response_lengths(gen, [self.tokenizer.eos_token_id, *params.stop_token_ids], pad).tolist()
        probs = torch.softmax(torch.stack(out.scores, dim=1).float(), -1) if params.sampling else None  # [b, R', V]
        return [Draft(row[:n], None if probs is None else probs[i, :n]) for i, (row, n) in enumerate(zip(gen.tolist(), lengths))]


def contiguous_head_input(model: torch.nn.Module) -> None:
    """Give `model`'s LM head a contiguous input. HF's causal LMs cut the positions they return logits
    for out of the hidden states before the head (`hidden_states[:, -1:, :]` in generate's prefill: a
    [b, 1, H] view with the strides of [b, P, H]), and PyTorch's CPU `linear` takes a slow path for a
    strided input: SmolLM2's head ([16, 1, 576] x [576, 49152]) took 2.6 s in bf16 against 7 ms on a
    contiguous copy (68 ms against 15 ms in fp32; torch 2.13, one thread). That one call per `generate`
    made bf16 generation slower than fp32 in the trainer. The copy is b x H values."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear) and not getattr(head, "_hybridflow_contiguous_input", False):
        head.register_forward_pre_hook(lambda _module, args: (args[0].contiguous(), *args[1:]))
        head._hybridflow_contiguous_input = True


def _generation_config(params: SamplingParams, tok, max_new_tokens: int, output_logits: bool = False) -> GenerationConfig:
    """HF `generate`'s settings for `params`: its processed scores (after temperature, top-k and
    top-p: what it samples from) returned when sampling; output_logits: the raw ones too."""
    sample = params.sampling
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=params.effective_temperature if sample else None,
        top_p=params.top_p if sample else None,
        top_k=(params.top_k if params.top_k > 0 else 0) if sample else None,
        eos_token_id=[tok.eos_token_id, *params.stop_token_ids],
        pad_token_id=tok.pad_token_id,
        stop_strings=list(params.stop) or None,
        output_logits=output_logits,  # raw: the untruncated log-probs
        output_scores=sample,  # after temperature, top-k and top-p: the behaviour log-probs
        return_dict_in_generate=True,
    )


def build_hf_rollout(ctx: RolloutContext) -> HFRollout:
    """The policy's HF model, tensor-parallel over rollout.tensor_model_parallel_size ranks grouped
    as HybridFlow does for the colocated actor's training layout (`gen_coords`)."""
    from hybridflow.parallel.tensor_parallel import apply_tensor_parallel, gen_mesh, gen_ranks
    from hybridflow.models.hf import load_hf_model
    from hybridflow.models.lora import apply_lora

    gen_tp = ctx.spec.rollout.tensor_model_parallel_size
    tp_index, dp_index = gen_ranks(ctx.rank, ctx.world_size, gen_tp, ctx.train_layout)
    # With LoRA the generation model carries the same adapters, unmerged: the same names as training,
    # so the hybrid engine moves the frozen base once and the adapters at every switch.
    mcfg = ctx.spec.model
    model = apply_lora(load_hf_model(mcfg, ctx.device, dtype=ctx.spec.generation_dtype), mcfg).eval().requires_grad_(False)
    if gen_tp > 1:
        apply_tensor_parallel(model, gen_mesh(ctx.device, ctx.world_size, gen_tp, ctx.train_layout)["tp"])
    r = ctx.spec.rollout  # continuous batching's keys (vLLM's names), where the config has them
    return HFRollout(model, ctx.tokenizer, ctx.device, tp_index, dp_index, gen_tp, keep_buffers=ctx.spec.keep_generation_buffers,
                     exact=r.exact, continuous=r.continuous_batching, max_num_seqs=getattr(r, "max_num_seqs", 32),
                     max_num_batched_tokens=getattr(r, "max_num_batched_tokens", 8192), record_routes=getattr(ctx.spec, "record_routes", False))
