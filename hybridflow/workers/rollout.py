"""Generation on a worker: the part every rollout-holding worker shares, and the generation-only
rollout worker of async rollout (its own pool, weights received from the actor's pool).

`RolloutMixin` gives a worker the generation layout (gen_tp x gen_dp over its group) and the
`generate_sequences` entry point over a `RolloutBackend`; the actor worker (colocated rollout,
fed by the hybrid engine) and `RolloutWorker` (a pool of its own) both use it.

Continuous batching (the HF backend's scheduler) lets a request join a replica's running batch
while another call is generating, so `generate_requests` is meant to run concurrently with
itself: it is tagged with the concurrency group REQUEST_GROUP (`controller.decorator.concurrent`),
sized by `CONCURRENCY_GROUPS`; the worker group starts the actor with those groups and the method
in its group (`controller/worker_group.py`); every other method keeps Ray's one call at a time. A weight
receipt stages its pieces first and writes them between two generation steps (`_between_calls`:
the backend's `pause()`; a backend without one generates one call at a time under this worker's
lock, which the write takes too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import torch
from transformers import AutoTokenizer

from hybridflow.controller.decorator import Dispatch, concurrent, register
from hybridflow.controller.worker import Worker
from hybridflow.parallel.process_group import pick_device
from hybridflow.hybrid_engine.cross_pool import PoolReceiver, generation_fingerprints, max_piece_diff, whole_pieces
from hybridflow.protocol import Batch, SamplingParams
from hybridflow.run_plan import RolloutSpec
from hybridflow.rollout.base import RolloutBackend, RolloutContext, make_rollout

REQUEST_GROUP = "requests"


class RolloutMixin:
    rollout: RolloutBackend
    rank: int
    world_size: int
    CONCURRENCY_GROUPS = {REQUEST_GROUP: 64}  # generate_requests calls in flight on one replica at once
    report_clocks = False  # a pool of its own: each call reports its replica's busy and wall time
    _last_call_end: float | None = None
    policy_version: int | None = None  # a pool of its own: the policy version of the weights held (the last sync's)

    def _with_clocks(self, out: Batch, start: float) -> Batch:
        """out, with this replica's seconds generating (busy_s) and since its previous call ended
        (span_s) in its metrics: the driver's generation idle fraction (`async_rollout.ReplicaClocks`)."""
        if self.report_clocks:
            end = time.monotonic()
            since = start if self._last_call_end is None else self._last_call_end
            self._last_call_end = end
            d = self.rollout.dp_index
            out.meta["metrics"] = {**out.meta.get("metrics", {}), f"rollout/replica{d}/busy_s": end - start, f"rollout/replica{d}/span_s": end - since}
        return out

    def _between_calls(self) -> contextlib.AbstractContextManager:
        """Held around a weight write: the backend's pause (between two generation steps), or, for a
        backend without one, this worker's lock that its generation calls hold too (one at a time)."""
        return self.rollout.pause() if hasattr(self.rollout, "pause") else self._serial()

    def _serial(self) -> threading.RLock:
        return self.__dict__.setdefault("_serial_lock", threading.RLock())

    def _one_at_a_time(self) -> contextlib.AbstractContextManager:
        """Around a generation or a sleep: nothing for a backend with pause() (it orders its own
        steps); this worker's lock for one without (vLLM's engine takes one call at a time), since
        generate_requests calls run in their own concurrency group beside the other methods."""
        return contextlib.nullcontext() if hasattr(self.rollout, "pause") else self._serial()

    def dispatch_layout(self, layout: str | None) -> tuple[int, int, bool]:
        """Generation splits prompts over gen_dp replicas; the gen_tp ranks of one replica share them."""
        if layout == "rollout":
            r = self.rollout
            return r.dp_index, self.world_size // r.gen_tp, r.tp_index == 0
        return super().dispatch_layout(layout)

    @register(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_sequences(self, prompts: Batch, params: SamplingParams, release_after: bool = False) -> Batch:
        """prompts: input_ids/attention_mask [b, P] left-padded. Returns responses, masks and
        rollout log-probs (`rollout.base.rollout_batch`). release_after frees the generation
        memory once done (the next weight sync re-acquires it)."""
        start = time.monotonic()
        with self._one_at_a_time():
            out = self.rollout.generate(prompts, params)
        if self.policy_version is not None:  # read here, on the replica: the version these tokens were sampled with
            out["rollout_policy_version"] = torch.full(out["responses"].shape, self.policy_version, dtype=torch.long)  # [b, R]
        if release_after:  # generation -> training: frees buffers, moves nothing
            with self._one_at_a_time():
                self.rollout.sleep()
        return self._with_clocks(out, start)

    @concurrent(REQUEST_GROUP)
    @register(Dispatch.DP_COMPUTE, layout="rollout")
    def generate_requests(self, data: Batch) -> Batch:
        """Request-level generation (the agent loop's entry point): data holds one `Request` per
        row in its "request" column; returns the `Completion`s in a "completion" column. Tokens
        carry the policy version that sampled them: the backend's own stamp per token (a weight
        update may land between two steps of a request), else the version held now."""
        start = time.monotonic()
        with self._one_at_a_time():
            completions = self.rollout.generate_requests(list(data["request"]))
        if self.policy_version is not None:  # the caller checks its staleness bound
            completions = [c if c.versions is not None else dataclasses.replace(c, versions=(self.policy_version,) * len(c.token_ids))
                           for c in completions]
        return self._with_clocks(Batch.from_dict(non_tensors={"completion": completions}), start)

    @register(Dispatch.ONE_TO_ALL)
    def sleep_rollout(self) -> None:
        """Free the generation memory after the step's last request (the next weight sync re-acquires it)."""
        with self._one_at_a_time():
            self.rollout.sleep()


def hf_param_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """The policy's parameter names and shapes, from its HF config on the meta device (no weights
    read): what the trained weights' pieces are named and cut by."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_cfg.path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


class RolloutWorker(RolloutMixin, Worker):
    """A generation-only pool (trainer.async_rollout): a rollout backend (hf, or vllm with one
    process per replica) whose weight source is a `PoolReceiver`; the actor's pool publishes its
    shards after every update."""

    report_clocks = True

    def __init__(self, spec: RolloutSpec):
        """spec: the rollout's (`run_plan.resolve(cfg).rollout`)."""
        super().__init__()
        self.spec = spec
        self.device = pick_device(spec.process.device)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        if self.spec.rollout.tensor_model_parallel_size > 1:  # a replica of gen_tp processes shares its layers over a group;
            self.init_process_group(self.device, self.spec.process.collective_timeout_s)  # one of one process needs none (replaceable)
        mcfg = self.spec.model
        self.tokenizer = AutoTokenizer.from_pretrained(mcfg.tokenizer_source())
        name = self.spec.name
        self.rollout = make_rollout(name, RolloutContext(self.spec, self.tokenizer, self.device, self.rank, self.world_size))
        lay = self.rollout.layout()
        # The receiver needs every parameter's shape: the backend's own storages (hf), or, for a
        # backend that owns and repacks its weights (vllm), the HF model's, built on the meta device.
        shapes = {n: tuple(p.shape) for n, p in lay.buffers.items()} if lay.buffers is not None else hf_param_shapes(mcfg)
        shard_dims = {n: lay.shard_dims.get(n) for n in shapes}  # gen_tp = 1 here for vllm: every piece whole
        self.receiver = PoolReceiver(shapes, shard_dims, lay.gen_tp, self.rank, self.world_size)
        self.policy_version = 0  # the model as loaded: no update yet
        if hasattr(self.rollout, "policy_version"):  # a backend that stamps each token as it samples it (continuous batching)
            self.rollout.policy_version = 0

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self, refs_by_src: list[list], check: bool = False, version: int | None = None) -> dict:
        """Push this rank's pieces of the trained weights (object refs from `publish_weights`) into
        the backend; check: every piece now sits in the backend's parameters (by their own layout);
        version: the policy version they are (the update that made them; None: one more than held)."""
        self.receiver.stage(refs_by_src)  # fetched while the backend generates on
        buffers = self.rollout.layout().buffers
        with self._between_calls():  # between two generation steps: the weights and the version tokens record change together
            # a backend with its own storages takes each piece into its slice; one that repacks (vllm), each parameter whole
            self.rollout.update_weights(self.receiver.pieces() if buffers is not None else whole_pieces(self.receiver.pieces()))
            self.policy_version = self.policy_version + 1 if version is None else int(version)
            if hasattr(self.rollout, "policy_version"):
                self.rollout.policy_version = self.policy_version
        out = dict(self.receiver.last_stats)
        if check and buffers is not None:  # a backend that repacks its weights (vllm) is checked by rollout/logprob_diff_max
            out["max_diff"] = max_piece_diff(buffers, self.receiver.last_pieces)
        elif check:
            out["max_diff"] = 0.0
        return out

    @register(Dispatch.ONE_TO_ALL)
    def weight_fingerprints(self) -> dict[str, str]:
        buffers = self.rollout.layout().buffers
        return {} if buffers is None else generation_fingerprints(buffers)

    @register(Dispatch.RANK_ZERO)
    def weight_version(self) -> int:
        """The policy version of the weights held (the one every generated token records)."""
        return self.policy_version
