"""The exact rollout mode's sampler (actor_rollout_ref.rollout.exact): speculative sampling with the
KV-cached, batched `generate` as the draft and the trainer's own computation as the target.

The mode's promise: every token is drawn from the distribution the trainer computes for it
(`models/exact.py` `exact_row_logits`, the row alone with shape [1, p + R]), and the log-probs the
rollout reports are the trainer's, bit for bit. Running that pass once per sampled token (the first
design) costs R full forwards per sequence: 5-7x fewer tokens/s than `generate`.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) keeps the promise at about the cost
of `generate` plus one target pass per sequence:

1. draft: `generate` samples the rest of each response, x_t ~ q_t (q_t: its processed scores'
   softmax: temperature, top-k, top-p, with its own KV-cached kernels);
2. verify: one `exact_row_logits` pass over prompt + the tokens so far + the draft (padded to R)
   gives the target p_t at every position at once; by causality row t depends only on the tokens
   before t, so it is the row the trainer's pass over the finished response computes there;
3. accept x_t with probability min(1, p_t(x_t) / q_t(x_t)), in order; at the first rejection draw
   the token from norm(max(p_t - q_t, 0)) instead and draft again from there; when every draft
   token is kept and the response goes on, draw the next one from the verify pass's next row.

Each kept or redrawn token is distributed exactly as p_t: P(y) = q(y) min(1, p(y)/q(y)) +
(1 - sum_x min(p(x), q(x))) (p(y) - min(p(y), q(y))) / (1 - sum_x min(p(x), q(x))) = p(y).
The draft and the target run the same weights with other kernels, so q is p up to rounding (~1e-7
fp32, ~1e-3 bf16): a rejection is rare and a sequence usually needs one verify pass, not R. Greedy
decoding keeps a draft token while it is the target's argmax and takes the argmax where it is not.

The log-probs reported come from the last verify pass of each sequence: its rows before the end
read only kept tokens, so they equal the trainer's pass bit for bit (behaviour log-probs under
top-k / top-p: the truncated distribution the token was drawn from, as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hybridflow.algorithms import logprobs_from_logits
from hybridflow.models.exact import exact_row_logits
from hybridflow.protocol import Completion, Request, SamplingParams


@dataclass
class Draft:
    """One row's draft: the tokens `generate` sampled and, when sampling, the distribution each was
    drawn from (probs [n, V], fp32; None for greedy decoding)."""

    tokens: list[int]
    probs: torch.Tensor | None


# draft(prompts, params, max_new_tokens, seed) -> one Draft per prompt (prompt: the request's prompt + the tokens kept so far)
DraftFn = Callable[[Sequence[Sequence[int]], SamplingParams, int, int], list[Draft]]


def truncate(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] with the tokens top-k and top-p cut set to -inf (HF's order: top-k, then top-p;
    top-p keeps the smallest set whose probability reaches top_p, the most likely always)."""
    out = logits.clone()
    if params.top_k > 0 and params.top_k < out.shape[-1]:
        out[out < out.topk(params.top_k).values[-1]] = float("-inf")
    if params.top_p < 1.0:
        sorted_logits, order = out.sort(descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        cut = cum - torch.softmax(sorted_logits, -1) >= params.top_p  # the mass before a token already reaches top_p
        out[order[cut]] = float("-inf")
    return out


def accept(p: torch.Tensor, q: torch.Tensor, token: int, gen: torch.Generator) -> tuple[int, bool]:
    """One speculative-sampling step: p, q [V] probabilities (target, draft), `token` drawn from q.
    Returns (the token kept, whether it is the draft's): the draft's with probability
    min(1, p/q), else one drawn from norm(max(p - q, 0)); either way distributed as p."""
    u = torch.rand((), generator=gen, dtype=torch.float64)
    if u * float(q[token]) < float(p[token]):  # u < p/q without dividing (q[token] > 0: it was drawn)
        return token, True
    residual = (p.double() - q.double()).clamp(min=0)  # [V]; not all zero: p(token) < q(token) leaves mass elsewhere
    return int(torch.multinomial(residual if float(residual.sum()) > 0 else p.double(), 1, generator=gen)), False


@dataclass
class _Row:
    request: Request
    gen: torch.Generator
    response: torch.Tensor  # [R] the tokens so far, pad after them
    n: int = 0
    finish: str = "length"
    done: bool = False
    behaviour: list[float] = field(default_factory=list)
    untruncated: list[float] = field(default_factory=list)
    last_pass: int = -1  # which of the call's target passes was this row's last


def sample_exact(requests: Sequence[Request], target: torch.nn.Module, draft: DraftFn, tokenizer, device: str, seed_of: Callable[[Request, int], int],
                 draft_seed: Callable[[SamplingParams, int], int]) -> tuple[list[Completion], dict]:
    """Completions of `requests` (in order) sampled from `target`'s `exact_row_logits`, drafted by
    `draft`. seed_of(request, position): the seed of the request's own generator (acceptance and
    resampling draws); draft_seed(params, round): the draft call's. Also returns counts (target
    passes, draft calls, draft tokens proposed and kept) and each request's last target pass (its
    index among the call's target passes, in order: the mismatch doctor reads that pass's probes)."""
    pad = tokenizer.pad_token_id
    rows = [_Row(r, torch.Generator(device=device).manual_seed(seed_of(r, i)),
                 torch.full((r.params.max_new_tokens,), pad, dtype=torch.long, device=device)) for i, r in enumerate(requests)]
    stats = {"target_passes": 0, "draft_calls": 0, "draft_tokens": 0, "kept_tokens": 0}
    rnd = 0
    while True:
        active = [row for row in rows if not row.done]
        if not active:
            break
        groups: dict[tuple[SamplingParams, int], list[_Row]] = {}
        for row in active:  # one draft call per (params, tokens left): generate's batch shares both
            groups.setdefault((row.request.params, row.request.params.max_new_tokens - row.n), []).append(row)
        for (params, left), group in groups.items():
            prompts = [list(row.request.prompt_ids) + row.response[: row.n].tolist() for row in group]
            drafts = draft(prompts, params, left, draft_seed(params, rnd))
            stats["draft_calls"] += 1
            for row, d in zip(group, drafts):
                proposed, kept = _verify(row, d, target, tokenizer)
                row.last_pass = stats["target_passes"]
                stats["target_passes"] += 1
                stats["draft_tokens"] += proposed
                stats["kept_tokens"] += kept
        rnd += 1
    stats["last_pass"] = [row.last_pass for row in rows]
    completions = []
    for row in rows:
        params, n = row.request.params, row.n
        truncated = params.sampling and (params.top_p < 1.0 or params.top_k > 0)
        completions.append(Completion(tuple(row.response[:n].tolist()), tuple(row.behaviour) if truncated else tuple(row.untruncated),
                                      row.finish, tuple(row.untruncated)))
    return completions, stats


def _verify(row: _Row, d: Draft, target: torch.nn.Module, tokenizer) -> tuple[int, int]:
    """One target pass over the row's tokens so far + its draft; keeps draft tokens while they are
    accepted, then one redrawn (or, all kept, one drawn from the next row). Returns (draft tokens
    proposed, kept)."""
    params = row.request.params
    R, T, start = params.max_new_tokens, params.effective_temperature, row.n
    stop_ids = {tokenizer.eos_token_id, *params.stop_token_ids}
    tokens = d.tokens[: R - start]
    seq = row.response.clone()
    seq[start : start + len(tokens)] = torch.tensor(tokens, dtype=torch.long, device=seq.device)
    prompt = torch.tensor(row.request.prompt_ids, device=seq.device)
    logits = exact_row_logits(target, prompt, seq, T)  # [1, R, V], already / T; row t reads seq[:t] only
    kept = 0
    while row.n < R:
        t = row.n
        scores = truncate(logits[0, t], params) if params.sampling else logits[0, t]  # [V]
        drafted = t - start < len(tokens)
        if not params.sampling:  # greedy: the target's argmax, whatever the draft says
            token = int(scores.argmax())
            ok = drafted and token == tokens[t - start]
        elif drafted:
            token, ok = accept(torch.softmax(scores, -1), d.probs[t - start], tokens[t - start], row.gen)
        else:  # every draft token kept: the next token straight from the target's row
            token, ok = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=row.gen)), False
        kept += int(ok)
        row.behaviour.append(float(torch.log_softmax(scores, -1)[token]))
        row.response[t] = token
        row.n += 1
        if token in stop_ids or (params.stop and tokenizer.decode(row.response[: row.n].tolist()).endswith(tuple(params.stop))):
            row.finish, row.done = "stop", True
            break
        if not ok:  # the rows after t read a token that is not the kept one: draft again from here
            break
    row.done = row.done or row.n >= R
    # rows < n read only kept tokens (row n - 1 predicts the last; it does not read it): the trainer's numbers
    row.untruncated = logprobs_from_logits(logits, row.response[None])[0, : row.n].tolist()
    return len(tokens), kept
