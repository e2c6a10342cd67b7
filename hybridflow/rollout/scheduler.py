"""Continuous batching for the HF backend: requests join the running batch at the next step and
leave it the step they finish.

One scheduler thread per replica owns the model's forward passes (nano-vllm's shape:
`engine/scheduler.py`, a waiting queue and a running batch, one forward per step):

    submit(requests) -> futures      any thread: appended to `waiting` (one call's requests together)
    step                             the thread: a prefill step while requests wait and slots are free
                                     (they join the batch), else a decode step over every running row
    finished row                     leaves the batch at once; its future is resolved there and then
    pause()                          any thread: waits for the step in progress, holds the next one
                                     (weight updates, sleep / wake: no step ever runs on mixed weights)

The running batch is a left-padded HF `DynamicCache` (keys / values [B, heads, L, head_dim]) with a
padding mask [B, L]: a prefill step feeds each admitted row the tokens its cache lacks (its prompt;
with a kept session, only the new tail) left-padded to one width, and merges those rows into the
batch (the shorter side left-padded with masked zero columns); a decode step feeds every row its
last sampled token. Positions come from the mask (a row's count of real tokens), so padding and
holes never shift a token's rotary position. A finished row is cut out of the batch and the leading
columns no row uses are trimmed.

Sampling is per row: the temperature, top-k, top-p, stop ids, stop strings, max_new_tokens and seed
of each request (a generator seeded like the exact sampler's: the request's seed, the replica and
its position in its call, so a request samples the same whatever else runs beside it, up to the
float sums a different batch makes). Each token carries the two log-probs `HFRollout._generate`
reports (the behaviour one after temperature / top-k / top-p, and the untruncated one under the
temperature alone), its top log-probs when asked, and the policy version the backend held.

Sessions (a trajectory's turns, a paused response's segments, `Request.session`): a finished
request's cache is kept (compacted to its real tokens, least recently used dropped past
`keep_tokens`) so the session's next request, if it extends it, prefills only its new tokens. A
`base.Continuation` goes further and sends only the tail: the replica holds the rest. A weight
update (or any in-place write to a parameter, seen by its version counter) makes every cache stale:
running rows are prefilled again on the new weights before their next token (their tokens so far
are kept), kept sessions keep their ids and drop their cache.

What was simplified, and why:
- no paged KV and no chunked prefill: one dense padded cache, so a long row costs every row its
  width (fine for the policy sizes this runs; transformers' own manager pages it, see
  docs/architecture.md "Rollout backends" for why it is not used);
- a prefill step does not decode the running rows (nano-vllm's order): a joining request pauses
  the others for one forward;
- greedy rows equal generating them alone only up to float sums: a batched matmul over other rows
  and a padded attention reduce in another order (fp32: ~1e-6 on log-probs);
- one process per replica (gen_tp = 1): the TP ranks of a replica would each need the same steps,
  which means broadcasting rank 0's schedule every step; with gen_tp > 1 the backend batches per
  call instead.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import inspect
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

import torch

from hybridflow.protocol import Completion, Request, SamplingParams
from hybridflow.rollout.base import Continuation, KeptCompletion, PrefixMissing

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, heads, L, head_dim]
_LIVE: "weakref.WeakSet[ContinuousScheduler]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """End every scheduler thread before the interpreter finalizes (a daemon thread that used torch's
    thread pools and is still parked then can abort the process at exit)."""
    for s in list(_LIVE):
        s.close(timeout_s=5)


def unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """Why `model` cannot run through the scheduler (None: it can): the dense padded cache needs
    full attention in every layer and a forward that takes a cache."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "the model has no HF config"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return f"layers of types {sorted(set(cfg.layer_types))} (a sliding window crops the cache the scheduler pads)"
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return "a sliding-window attention"
    if _cache_kwarg(model) is None:
        return f"{type(model).__name__}.forward takes no cache argument"
    return None


def _cache_kwarg(model: torch.nn.Module) -> Optional[str]:
    params = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


@dataclasses.dataclass(eq=False)
class _Seq:
    """A request in the scheduler: its tokens so far and what each sampled token carries."""

    request: Request
    future: Future
    generator: Optional[torch.Generator]
    ids: list[int]  # the prompt, then the sampled tokens
    prompt_len: int
    kv: Optional[KV] = None  # a kept session's cache ([1, h, c, d]) to resume from, until admitted
    resolved: bool = False  # its prompt and kept cache looked up (`_resolve`)
    cached: int = 0  # tokens of `ids` in the cache (the last sampled one is fed by the next step)
    logps: list[float] = dataclasses.field(default_factory=list)
    untruncated: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    top: list[tuple] = dataclasses.field(default_factory=list)
    routes: list[tuple[int, torch.Tensor]] = dataclasses.field(default_factory=list)  # (first position, [n, L, k]) per forward (MoE record)
    submitted: float = 0.0

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def tokens(self) -> list[int]:
        return self.ids[self.prompt_len:]


@dataclasses.dataclass
class _Kept:
    """A finished session: all its ids (prompt + completion) and the cache of all but the last."""

    ids: tuple[int, ...]
    kv: Optional[KV]  # None: stale (the weights changed since) or dropped
    stamp: tuple


@dataclasses.dataclass
class SchedulerStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # tokens fed by prefill steps (prompts, tails, prefills again)
    reused_tokens: int = 0  # tokens a kept session's cache saved from prefilling
    reprefills: int = 0  # running rows prefilled again after a weight change
    prefix_missing: int = 0  # continuations whose session was not held here
    max_batch: int = 0


class ContinuousScheduler:
    def __init__(self, model: torch.nn.Module, tokenizer, device: str, *, dp_index: int = 0, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 8192, keep_tokens: int = 32768, version: Callable[[], Optional[int]] = lambda: None,
                 epoch: Callable[[], int] = lambda: 0, recorder=None):
        """max_num_seqs: rows in the running batch (slots); max_num_batched_tokens: tokens one prefill
        step feeds (at least one request is admitted whatever its length); keep_tokens: kept sessions'
        cached tokens in all; version(): the policy version each sampled token records (None: none);
        epoch(): the backend's weight-update count (with the parameters' version counters: a change
        makes every cache stale); recorder: a `models.routing.RouteRecorder` on the model (MoE routing replay):
        each completion carries the experts of every position a forward computed for it."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.model, self.tok, self.device, self.dp_index = model, tokenizer, device, dp_index
        self.max_num_seqs, self.max_num_batched_tokens, self.keep_tokens = max_num_seqs, max_num_batched_tokens, keep_tokens
        self.version, self.epoch = version, epoch
        self.recorder = recorder
        self.pad = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)  # fed under mask 0 only
        self.cache_kw = _cache_kwarg(model)
        self.logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.params = list(model.parameters())
        self.cond = threading.Condition()
        self.waiting: collections.deque[_Seq] = collections.deque()  # under cond
        self.pauses = 0  # under cond: holders of pause(); no step starts while > 0
        self.in_step = False  # under cond
        self.stopping = False
        self.refusing: Optional[str] = None  # set (under pause) while the backend cannot generate: why submit raises
        self.idle_exit_s = 30.0  # the thread ends after this long with nothing to do (a later submit starts another)
        self.thread: Optional[threading.Thread] = None
        # The loop thread's own (touched elsewhere only while paused):
        self.running: list[_Seq] = []  # row i of the batch
        self.admitting: list[_Seq] = []  # the prefill step's rows until they joined
        self.cache = None  # the running batch's DynamicCache (None: no batch)
        self.mask: Optional[torch.Tensor] = None  # [B, L] 1 = a real token's column
        self.kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()
        self.kept_tokens = 0
        self.stamp: tuple = self._stamp()
        self.stats = SchedulerStats()
        _LIVE.add(self)
        # (event, info) at each step's "start" and "end", in the loop thread (tests, benches): info holds the step's
        # "kind" (prefill | decode), "step" (its index), "rows" (its requests) and, at the end, "finished" (those that left)
        self.hooks: list[Callable[[str, dict], None]] = []
        self.finished: list[Request] = []

    # ------------------------------------------------------------------ any thread
    def submit(self, requests: Sequence[Request]) -> list[Future]:
        """Queue `requests` (one call: seeded by their positions in it); each future resolves to its
        Completion the step it finishes."""
        now = time.monotonic()
        seqs = []
        for position, r in enumerate(requests):
            p = r.params
            gen = None
            if p.sampling:
                gen = torch.Generator(device=self.device).manual_seed((p.seed * 1000 + self.dp_index) * 100_003 + position)
            seqs.append(_Seq(r, Future(), gen, list(r.prompt_ids), len(r.prompt_ids), submitted=now))
        with self.cond:
            if self.stopping or self.refusing:
                raise RuntimeError(self.refusing or "the continuous batching scheduler is closed")
            self.waiting.extend(seqs)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name=f"hf-scheduler-{self.dp_index}", daemon=True)
                self.thread.start()
            self.cond.notify_all()
        return [s.future for s in seqs]

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        """Submit and wait: the completions in order (each resolved as it finished)."""
        futures = self.submit(requests)
        out = []
        for f in futures:
            while True:
                try:
                    out.append(f.result(timeout=1.0))
                    break
                except TimeoutError:
                    if self.thread is None or not self.thread.is_alive():
                        raise RuntimeError("the continuous batching scheduler thread stopped with requests in flight") from None
        return out

    @contextlib.contextmanager
    def pause(self, timeout_s: float = 600.0):
        """Hold the scheduler between two steps: entered once the step in progress (if any) ended;
        no step starts until every holder left. Nested and concurrent holders are fine."""
        with self.cond:
            self.pauses += 1
            try:
                if not self.cond.wait_for(lambda: not self.in_step, timeout_s):
                    raise TimeoutError(f"the scheduler's step in progress (batch of {len(self.running)}) did not end within {timeout_s} s")
            except BaseException:
                self.pauses -= 1
                self.cond.notify_all()
                raise
        try:
            yield self
        finally:
            with self.cond:
                self.pauses -= 1
                self.cond.notify_all()

    def fail_all(self, error: BaseException) -> int:
        """Under pause(): every running and waiting request fails with `error`; caches and kept
        sessions dropped. Returns how many requests failed."""
        with self.cond:
            waiting, self.waiting = list(self.waiting), collections.deque()
        seqs = self.running + waiting
        self._drop_batch()
        self.kept.clear()
        self.kept_tokens = 0
        for s in seqs:
            if not s.future.done():
                s.future.set_exception(error)
        return len(seqs)

    def in_flight(self) -> int:
        with self.cond:
            return len(self.waiting) + len(self.running)

    def close(self, timeout_s: float = 30) -> None:
        """Stop the thread; requests still in flight fail."""
        with self.cond:
            self.stopping = True
            thread = self.thread
            self.cond.notify_all()
        if thread is not None:
            thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        while True:
            with self.cond:
                ready = self.cond.wait_for(lambda: self.stopping or (self.pauses == 0 and (self.waiting or self.running)), self.idle_exit_s)
                if self.stopping:
                    break
                if not ready:
                    if not self.waiting and not self.running:
                        self.thread = None  # idle: the next submit starts a new thread
                        return
                    continue
                self.in_step = True
            try:
                with torch.no_grad():
                    self._step()
            except BaseException as e:  # noqa: BLE001 - the step's requests fail, the scheduler serves on
                failed = self.running + self.admitting
                self.running, self.admitting = [], []
                self._drop_batch()
                for s in failed:
                    if not s.future.done():
                        s.future.set_exception(e)
            finally:
                with self.cond:
                    self.in_step = False
                    self.cond.notify_all()
        self.fail_all(RuntimeError("the continuous batching scheduler was closed with this request in flight"))

    def _stamp(self) -> tuple:
        return (self.epoch(), sum(p._version for p in self.params))

    def _step(self) -> None:
        stamp = self._stamp()
        if stamp != self.stamp:  # new weights: no cache computed before them is used after
            self._weights_changed()
            self.stamp = stamp
        with self.cond:
            admit = self._admit()
        if not admit and not self.running:
            return
        self.admitting = admit
        kind = "prefill" if admit else "decode"
        info = {"kind": kind, "rows": [s.request for s in (admit or self.running)], "step": self.stats.steps, "finished": []}
        self.finished = info["finished"]
        for hook in self.hooks:
            hook("start", info)
        if admit:
            self._prefill(admit)
        else:
            self._decode()
        self.admitting = []
        self.stats.steps += 1
        self.stats.max_batch = max(self.stats.max_batch, len(self.running))
        for hook in self.hooks:
            hook("end", info)

    def _weights_changed(self) -> None:
        """Every running row is prefilled again (its tokens so far kept) on the new weights, before
        its next token; kept sessions drop their cache (their ids stay)."""
        rows, self.running = self.running, []
        self._drop_batch()
        for s in rows:
            s.kv, s.cached = None, 0
        self.stats.reprefills += len(rows)
        with self.cond:
            self.waiting.extendleft(reversed(rows))
            for s in self.waiting:  # resolved with a kept cache, not admitted yet
                s.kv, s.cached = None, 0
        for k in self.kept.values():
            if k.kv is not None:
                self.kept_tokens -= len(k.ids) - 1
                k.kv = None

    def _admit(self) -> list[_Seq]:
        """Under cond: the waiting requests that join now (free slots, the prefill token budget)."""
        out: list[_Seq] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(out) < self.max_num_seqs:
            s = self.waiting[0]
            if not s.resolved and not self._resolve(s):
                self.waiting.popleft()
                continue
            need = len(s.ids) - s.cached
            if out and need > budget:
                break
            self.waiting.popleft()
            budget -= need
            if s.params.max_new_tokens <= len(s.tokens):  # nothing to sample (max_new_tokens 0)
                s.future.set_result(self._completion(s, "length"))
                continue
            out.append(s)
        return out

    def _resolve(self, s: _Seq) -> bool:
        """The prompt a request stands for and the cache it resumes from (a kept session's); False:
        answered already (a continuation whose session is not held here)."""
        r = s.request
        s.resolved = True
        kept = self.kept.get(r.session) if r.session is not None else None
        if isinstance(r, Continuation):
            full = None if kept is None else kept.ids
            if full is None or len(full) != r.prefix_len + len(r.prompt_ids) or full[r.prefix_len:] != r.prompt_ids:
                self.stats.prefix_missing += 1
                s.future.set_result(PrefixMissing((), (), "length"))
                return False
            s.ids, s.prompt_len = list(full), len(full)
        if kept is None:
            return True
        c = len(kept.ids) - 1
        if kept.kv is not None and kept.stamp == self.stamp and len(s.ids) > c and tuple(s.ids[:c]) == kept.ids[:c]:
            s.kv, s.cached = kept.kv, c
            self.stats.reused_tokens += c
        self._unkeep(r.session)
        return True

    def _prefill(self, rows: list[_Seq]) -> None:
        """Feed each admitted row the tokens its cache lacks; sample its next token; merge it in."""
        B = len(rows)
        Lk = max(s.cached for s in rows)
        N = max(len(s.ids) - s.cached for s in rows)
        kv: KV = []
        if Lk:
            like = next(s.kv for s in rows if s.kv is not None)
            kv = [(torch.cat([_left_pad(s.kv[i][0] if s.kv else k[:1, :, :0], Lk) for s in rows]),
                   torch.cat([_left_pad(s.kv[i][1] if s.kv else v[:1, :, :0], Lk) for s in rows])) for i, (k, v) in enumerate(like)]
        mask = torch.zeros((B, Lk + N), dtype=torch.long, device=self.device)
        input_ids = torch.full((B, N), self.pad, dtype=torch.long, device=self.device)
        for j, s in enumerate(rows):
            new = s.ids[s.cached:]
            mask[j, Lk - s.cached: Lk] = 1
            mask[j, Lk + N - len(new):] = 1
            input_ids[j, N - len(new):] = torch.tensor(new, dtype=torch.long)
            s.kv = None
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += sum(len(s.ids) - s.cached for s in rows)
        cache = self._cache_from(kv)
        starts = [s.cached for s in rows]
        with self._recording() as forwards:
            logits = self._forward(input_ids, mask, cache)
        if forwards:  # [B*N, L, k]: row j's new tokens are its last len(ids) - cached columns
            fw = forwards[0].view(B, N, *forwards[0].shape[1:])
            for j, (s, start) in enumerate(zip(rows, starts)):
                s.routes.append((start, fw[j, N - (len(s.ids) - start):]))
        for s in rows:
            s.cached = len(s.ids)
        self._merge(rows, cache, mask)
        self._sample_and_retire(logits, rows, offset=len(self.running) - B)

    def _decode(self) -> None:
        B = len(self.running)
        input_ids = torch.tensor([[s.ids[-1]] for s in self.running], dtype=torch.long, device=self.device)  # [B, 1]
        mask = torch.cat([self.mask, torch.ones((B, 1), dtype=torch.long, device=self.device)], dim=1)
        self.stats.decode_steps += 1
        with self._recording() as forwards:
            logits = self._forward(input_ids, mask, self.cache)  # the cache grows by one column in place
        for j, s in enumerate(self.running if forwards else ()):  # [B, L, k]: each row's last token
            s.routes.append((len(s.ids) - 1, forwards[0][j:j + 1]))
        self.mask = mask
        for s in self.running:
            s.cached += 1
        self._sample_and_retire(logits, list(self.running), offset=0)

    def _recording(self):
        return self.recorder.capture() if self.recorder is not None else contextlib.nullcontext([])

    def _cache_from(self, kv: KV, reuse=None):
        """A DynamicCache holding `kv` (empty: a fresh one). reuse: a cache whose layers take `kv` as
        they are (no copy), when its layers are plain dynamic ones."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        if reuse is not None and all(type(layer) is DynamicLayer for layer in reuse.layers) and len(reuse.layers) == len(kv):
            for layer, (k, v) in zip(reuse.layers, kv):
                layer.keys, layer.values = k, v
            return reuse
        cache = DynamicCache(config=self.model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        return cache

    def _forward(self, input_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """input_ids [B, N] after `cache`'s L columns, mask [B, L + N] -> the last position's logits
        [B, V] (fp32); the cache now holds L + N columns."""
        N = input_ids.shape[1]
        position_ids = torch.clamp(mask.cumsum(dim=1) - 1, min=0)[:, -N:]  # a row's real tokens before each: holes never shift it
        extra = {"logits_to_keep": 1} if self.logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **{self.cache_kw: cache}, **extra)
        return out.logits[:, -1].float()

    def _merge(self, rows: list[_Seq], cache, mask: torch.Tensor) -> None:
        """Append the prefilled rows to the running batch (the narrower side left-padded)."""
        if not self.running:
            self.running, self.cache, self.mask = list(rows), cache, mask
            return
        L = max(self.mask.shape[1], mask.shape[1])
        self.cache = self._cache_from([(torch.cat([_left_pad(a, L), _left_pad(b, L)]), torch.cat([_left_pad(av, L), _left_pad(bv, L)]))
                                       for (a, av), (b, bv) in zip(_kv(self.cache), _kv(cache))], reuse=self.cache)
        self.mask = torch.cat([_left_pad(self.mask, L, dim=1), _left_pad(mask, L, dim=1)])
        self.running = self.running + list(rows)

    def _sample_and_retire(self, logits: torch.Tensor, rows: list[_Seq], offset: int) -> None:
        """Sample rows' next tokens (row j is batch row offset + j); finished rows leave the batch
        and their futures resolve now."""
        version = self.version()
        tokens, behaviour, untruncated, top = sample_rows(logits, [s.params for s in rows], [s.generator for s in rows])
        done: list[tuple[int, str]] = []
        for j, s in enumerate(rows):
            t = tokens[j]
            s.ids.append(t)
            s.logps.append(behaviour[j])
            s.untruncated.append(untruncated[j])
            if version is not None:
                s.versions.append(version)
            if top[j] is not None:
                s.top.append(top[j])
            p = s.params
            if t == self.tok.eos_token_id or t in p.stop_token_ids or (p.stop and self.tok.decode(s.tokens).endswith(tuple(p.stop))):
                done.append((offset + j, "stop"))
            elif len(s.tokens) >= p.max_new_tokens:
                done.append((offset + j, "length"))
        if done:
            self._retire(done)

    def _retire(self, done: list[tuple[int, str]]) -> None:
        gone = {i for i, _ in done}
        for i, finish in done:
            s = self.running[i]
            if s.request.session is not None:
                self._keep(s, i)
            s.future.set_result(self._completion(s, finish))
            self.finished.append(s.request)
        keep = [i for i in range(len(self.running)) if i not in gone]
        self.running = [self.running[i] for i in keep]
        if not self.running:
            self._drop_batch()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self.mask[idx]
        first = int((mask.sum(dim=0) > 0).nonzero()[0])  # columns before it: padding for every row left
        self.mask = mask[:, first:]
        self.cache = self._cache_from([(k[idx, :, first:], v[idx, :, first:]) for k, v in _kv(self.cache)], reuse=self.cache)

    def _completion(self, s: _Seq, finish: str) -> Completion:
        cls = KeptCompletion if s.request.session is not None and s.request.session in self.kept else Completion
        routes = None
        if self.recorder is not None:  # [len(ids), L, k]: later forwards of a position (a prefill again) win; -1 = none computed here
            routes = self.recorder.empty(len(s.ids))
            for start, r in s.routes:
                routes[start:start + r.shape[0]] = r
        return cls(tuple(s.tokens), tuple(s.logps), finish, tuple(s.untruncated), tuple(s.versions) if s.versions else None,
                   tuple(s.top) if s.params.top_logprobs > 0 else None, routes)

    # ------------------------------------------------------------------ kept sessions
    def _keep(self, s: _Seq, row: int) -> None:
        """Keep row `row`'s cache (its real columns: all of s.ids but the last) for its session."""
        cols = self.mask[row].bool()
        kv = [(k[row:row + 1, :, cols].clone(), v[row:row + 1, :, cols].clone()) for k, v in _kv(self.cache)]
        assert kv[0][0].shape[2] == len(s.ids) - 1, (kv[0][0].shape, len(s.ids))
        self._unkeep(s.request.session)
        self.kept[s.request.session] = _Kept(tuple(s.ids), kv, self.stamp)
        self.kept_tokens += len(s.ids) - 1
        while self.kept_tokens > self.keep_tokens and len(self.kept) > 1:  # the least recently used first (never the one just kept)
            self._unkeep(next(iter(self.kept)))

    def _unkeep(self, session: str) -> None:
        k = self.kept.pop(session, None)
        if k is not None and k.kv is not None:
            self.kept_tokens -= len(k.ids) - 1

    def _drop_batch(self) -> None:
        self.cache, self.mask = None, None


def _kv(cache) -> KV:
    """A DynamicCache's keys and values per layer ([B, heads, L, head_dim])."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(x: torch.Tensor, width: int, dim: int = 2) -> torch.Tensor:
    """x padded with zeros at the start of `dim` to `width` (KV [b, h, L, d]: dim 2; masks: dim 1)."""
    missing = width - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def truncate_rows(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """scores [b, V] (already / T) with each row's tokens its top-k, then its top-p cut set to -inf
    (HF's order; top-p keeps the smallest set whose probability reaches top_p, the most likely
    always); top_k [b] (<= 0: off), top_p [b] (1.0: off). `exact_sampler.truncate`, row-wise."""
    V = scores.shape[-1]
    out = scores.clone()
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    sorted_scores = out.sort(dim=-1, descending=True).values
    kth = sorted_scores.gather(1, (k - 1)[:, None])  # [b, 1]
    out = out.masked_fill(out < kth, float("-inf"))
    sorted_scores, order = out.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    cut = ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]  # the mass before a token already reaches top_p
    return out.scatter(1, order, sorted_scores.masked_fill(cut, float("-inf")))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]]):
    """logits [b, V] (fp32) -> per row: the token, its behaviour log-prob (the distribution it was
    drawn from: / T, top-k, top-p), its untruncated log-prob (/ T alone), its top log-probs (or None).
    Greedy rows take the argmax (T = 1)."""
    dev = logits.device
    T = torch.tensor([p.effective_temperature for p in params], device=dev)[:, None]
    scaled = logits / T
    untruncated = torch.log_softmax(scaled, dim=-1)  # [b, V]
    cut = [p.sampling and (p.top_k > 0 or p.top_p < 1.0) for p in params]
    scores = scaled
    if any(cut):
        top_k = torch.tensor([p.top_k if c else -1 for p, c in zip(params, cut)], device=dev)
        top_p = torch.tensor([p.top_p if c else 1.0 for p, c in zip(params, cut)], device=dev)
        scores = truncate_rows(scaled, top_k, top_p)
    behaviour = torch.log_softmax(scores, dim=-1) if any(cut) else untruncated
    probs = torch.softmax(scores, dim=-1)
    greedy = logits.argmax(dim=-1).tolist()
    tokens = [int(torch.multinomial(probs[j], 1, generator=g)) if p.sampling else greedy[j] for j, (p, g) in enumerate(zip(params, generators))]
    idx = torch.tensor(tokens, device=dev)[:, None]
    lp, ulp = behaviour.gather(1, idx)[:, 0].tolist(), untruncated.gather(1, idx)[:, 0].tolist()
    top: list = [None] * len(params)
    for j, p in enumerate(params):
        if p.top_logprobs > 0:
            v, i = behaviour[j].topk(min(p.top_logprobs, behaviour.shape[-1]))
            top[j] = tuple(zip(i.tolist(), v.tolist()))
    return tokens, lp, ulp, top
