"""Partial rollout (async_training.partial_rollout): requests generated in segments, so that a
weight update reaches them mid-response instead of after it.

Each segment is one call to the rollout pool for every request still running: the request's
prompt plus the tokens it has so far, at most `chunk` new tokens. A weight sync queued on the pool
between two segments therefore pauses every running request at a segment boundary; the pool loads
the new weights and the requests continue from the tokens they have (kept, each with the policy
version that sampled it), instead of restarting. Each segment's tokens record the version the
replica that sampled them held (the completion's `versions`; else the one the caller gives with
the call, `Call`), so a completion's `versions` are per token.

What a pause costs: a request's segments are one session (`Request.session`), routed to the
replica that served the session before. The HF backend with continuous batching keeps a finished
session's tokens and KV cache there and says so (its completion is a `base.KeptCompletion`); the
next segment is then a `base.Continuation` carrying only the last segment's tokens (a check of
the tail), not the whole prefix: O(R) ids sent per response instead of O(R^2 / chunk), and no
prefill of the prefix unless the weights changed in between (then the replica prefills it again from
the ids it holds, on the new weights). Where the session is not held (another replica after a
restart, evicted, a backend without sessions: vLLM reuses its own prefix cache instead) the reply
is a `base.PrefixMissing` and that request is sent again with its whole prefix, in the same segment.
A stop string that straddles a segment boundary is detected by the backend (it sees the prefix)
only when it ends before the segment's last token.
"""

from __future__ import annotations

import uuid
from typing import Callable, Sequence

from hybridflow.models.routing import merge_routes
from hybridflow.protocol import Completion, Request
from hybridflow.rollout.base import Continuation, KeptCompletion, PrefixMissing

# requests -> (their completions, the policy version the pool sampled them with)
Call = Callable[[list[Request]], tuple[list[Completion], int]]


def segment_seed(seed: int, segment: int) -> int:
    """The sampling seed of a request's `segment`-th segment: the request's own for the first (so a
    request that never pauses samples what it would in one call), a different one for each later."""
    return seed if segment == 0 else (seed * 1_000_003 + segment) % 2**31


def generate_in_segments(requests: Sequence[Request], call: Call, chunk: int) -> list[Completion]:
    """Every request to its end (a stop, or its max_new_tokens) in segments of <= chunk tokens;
    completions in order, with per-token `versions`."""
    n = len(requests)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    untruncated: list[list[float]] = [[] for _ in range(n)]
    versions: list[list[int]] = [[] for _ in range(n)]
    top: list[list] = [[] for _ in range(n)]  # with params.top_logprobs
    routes: list = [None] * n  # MoE routing replay: each position's experts over the segments (models/routing.py)
    finish: list[str] = ["length"] * n
    running, segment = list(range(n)), 0
    call_id = uuid.uuid4().hex  # a request's segments are one session (the replica that has its prefix)
    last: list[tuple[int, ...]] = [() for _ in range(n)]  # the tokens of a request's last segment, when its replica keeps the session
    while running:
        whole, calls = [], []
        for i in running:
            r = requests[i]
            left = r.params.max_new_tokens - len(tokens[i])
            full = Request(r.prompt_ids + tuple(tokens[i]), r.params.with_(max_new_tokens=min(chunk, left), seed=segment_seed(r.params.seed, segment)),
                           r.session or f"{call_id}-{i}")
            whole.append(full)
            calls.append(Continuation(last[i], full.params, full.session, prefix_len=len(full.prompt_ids) - len(last[i])) if last[i] else full)
        completions, version = call(calls)
        missing = [k for k, c in enumerate(completions) if isinstance(c, PrefixMissing)]
        if missing:  # the replica does not hold those sessions: their whole prefix, in this segment still
            again, again_version = call([whole[k] for k in missing])
            completions, versions_of = list(completions), [version] * len(completions)
            for k, c in zip(missing, again):
                completions[k], versions_of[k] = c, again_version
        else:
            versions_of = [version] * len(completions)
        still = []
        for i, c, version in zip(running, completions, versions_of):
            last[i] = c.token_ids if isinstance(c, KeptCompletion) else ()
            tokens[i] += c.token_ids
            logps[i] += c.log_probs
            untruncated[i] += c.untruncated
            versions[i] += list(c.versions) if c.versions is not None else [version] * len(c.token_ids)  # the replica's own record first
            top[i] += c.top_logprobs or ()
            routes[i] = merge_routes(routes[i], c.routed_experts)  # a segment covers the prompt and every token so far
            if c.finish_reason == "stop" or len(tokens[i]) >= requests[i].params.max_new_tokens:
                finish[i] = c.finish_reason
            else:
                still.append(i)
        running, segment = still, segment + 1
    return [Completion(tuple(tokens[i]), tuple(logps[i]), finish[i], tuple(untruncated[i]), tuple(versions[i]),
                       tuple(top[i]) if requests[i].params.top_logprobs else None, routes[i]) for i in range(n)]
