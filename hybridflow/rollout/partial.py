"""Partial rollout (async_training.partial_rollout): requests generated in segments, so that a
weight update reaches them mid-response instead of after it.

Each segment is one call to the rollout pool for every request still running: the request's
prompt plus the tokens it has so far, at most `chunk` new tokens. A weight sync queued on the pool
between two segments therefore pauses every running request at a segment boundary; the pool loads
the new weights and the requests continue from the tokens they have (kept, each with the policy
version that sampled it), instead of restarting. Each segment's tokens record the version the
replica that sampled them held (the completion's `versions`; else the one the caller gives with
the call, `Call`), so a completion's `versions` are per token.

What a pause costs: the HF backend keeps no KV cache between calls, so every segment re-runs the
prefill of its prefix (bench/async.py measures it); a backend with a prefix cache (vLLM) reuses it.
A stop string that straddles a segment boundary is detected by the backend (it sees the prefix)
only when it ends before the segment's last token.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable, Sequence

from hybridflow.protocol import Completion, Request

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
    finish: list[str] = ["length"] * n
    running, segment = list(range(n)), 0
    call_id = uuid.uuid4().hex  # a request's segments are one session (the replica that has its prefix)
    while running:
        calls = []
        for i in running:
            r = requests[i]
            left = r.params.max_new_tokens - len(tokens[i])
            calls.append(dataclasses.replace(r, prompt_ids=r.prompt_ids + tuple(tokens[i]), session=r.session or f"{call_id}-{i}",
                                             params=r.params.with_(max_new_tokens=min(chunk, left), seed=segment_seed(r.params.seed, segment))))
        completions, version = call(calls)
        still = []
        for i, c in zip(running, completions):
            tokens[i] += c.token_ids
            logps[i] += c.log_probs
            untruncated[i] += c.untruncated
            versions[i] += list(c.versions) if c.versions is not None else [version] * len(c.token_ids)  # the replica's own record first
            top[i] += c.top_logprobs or ()
            if c.finish_reason == "stop" or len(tokens[i]) >= requests[i].params.max_new_tokens:
                finish[i] = c.finish_reason
            else:
                still.append(i)
        running, segment = still, segment + 1
    return [Completion(tuple(tokens[i]), tuple(logps[i]), finish[i], tuple(untruncated[i]), tuple(versions[i]),
                       tuple(top[i]) if requests[i].params.top_logprobs else None) for i in range(n)]
