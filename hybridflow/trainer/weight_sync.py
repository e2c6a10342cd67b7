"""Trained weights -> generation weights after every update: the flow's last stage, its metrics
(`timing_s/reshard`, `reshard/*`) and the resharding log lines.

Colocated (the 3D-HybridEngine): `reshard` asks the actor's workers to move from the training to
the generation layout. With actor_rollout_ref.hybrid_engine.resharding_overlap_with_compute it only
starts them; the trainer prepares the next batch meanwhile and `finish_overlapped` collects the
result (`reshard/overlap_ratio`: the part of the workers' time the driver spent preparing).

Cross-pool (trainer.async_rollout): `sync_rollout` has the actor's pool publish exactly the pieces
each generation rank needs and the rollout pool receive them (`hybrid_engine/cross_pool.py`).

The first sync of a run logs the plan and its timing; with trainer.check_weight_sync every sync
proves that the generation weights are exactly the trained ones (it raises otherwise).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from hybridflow import profiler
from hybridflow.service.replicas import REQUEST_TIMEOUT_KEY
from hybridflow.config.schema import TrainerConfig
from hybridflow.run_plan import ActorSpec
from hybridflow.protocol import Batch


logger = logging.getLogger("hybridflow")


class WeightSync:
    def __init__(self, spec: ActorSpec, trainer: TrainerConfig, actor: Any, plan_summary: dict | None, rollout: Any = None,
                 pools: tuple[str, str] = ("", "")):
        """spec: the policy's (hybrid engine, actor layout, rollout); trainer: nnodes, workers per node,
        check_weight_sync; actor: the trained policy's view; plan_summary: its resharding plan
        (colocated); rollout, pools: the rollout pool's view and (actor pool, rollout pool) names (cross-pool)."""
        self.spec, self.trainer, self.actor, self.plan_summary, self.rollout, self.pools = spec, trainer, actor, plan_summary, rollout, pools
        self.pending = None  # the workers' reshard in flight (overlap mode)
        self.logged = False  # the first sync logs the plan and its timing

    # ------------------------------------------------------------------ colocated
    def reshard(self, batch: Batch | None = None) -> dict[str, float]:
        """Training -> generation layout (the flow's "reshard" stage). With overlap on, only start
        it: the trainer collects it with `finish_overlapped`."""
        he = self.spec.hybrid_engine
        first = not self.logged
        if first:
            self._log_plan()
        kwargs = {"measure_baseline": first and he.measure_baseline, "check": self.trainer.check_weight_sync, "trace": profiler.active_session() is not None}
        self.pending = self.actor.submit("reshard", **kwargs)
        if he.resharding_overlap_with_compute:
            return {}
        return self.finish()

    def finish_overlapped(self, prepare_next: Callable[[], None]) -> dict[str, float]:
        """Overlap mode: run `prepare_next` on the driver while the workers reshard, then collect."""
        prep_start = time.perf_counter()
        prepare_next()
        return self.finish(prep_seconds=time.perf_counter() - prep_start)

    def _log_plan(self) -> None:
        r, t = self.spec.rollout.rollout, self.trainer
        a, n, plan = self.spec.actor, self.actor.world_size, self.plan_summary
        pp, tp = a.pipeline_model_parallel_size, a.tensor_model_parallel_size
        train = f"FSDP(dp={n})" if pp == tp == 1 else f"PP={pp} x TP={tp} x FSDP(dp={n // (pp * tp)})"
        logger.info("Starting resharding from %s to TP=%d x DP=%d...", train, r.tensor_model_parallel_size, n // r.tensor_model_parallel_size)
        logger.info("Resharding plan: %s per rank at minimum (naive: %s), %s crossing nodes (%d node(s) x %d workers)",
                    human_bytes(max(plan["min_bytes_per_rank"])), human_bytes(max(plan["naive_bytes_per_rank"])),
                    human_bytes(plan["cross_node_bytes"]), t.nnodes, t.n_gpus_per_node)
        staging = plan.get("staging") or {}
        if staging.get("note"):  # resharding_buffer_percent set: what the switch uses, or what it uses instead
            (logger.info if staging["honoured"] else logger.warning)("%s", staging["note"])

    def finish(self, prep_seconds: float | None = None) -> dict[str, float]:
        """Collect the reshard in flight: its metrics (and, the first time, its log lines)."""
        wait_start = time.perf_counter()
        per_rank = self.pending.result()
        waited = time.perf_counter() - wait_start
        self.pending = None
        seconds = max(r["seconds"] for r in per_rank)
        plan = self.plan_summary
        m = {
            "timing_s/reshard": seconds,
            "reshard/bytes_per_rank": float(max(r["bytes_received"] for r in per_rank)),
            "reshard/min_bytes_per_rank": float(max(plan["min_bytes_per_rank"])),
            "reshard/skipped_bytes_per_rank": float(max(r.get("skipped_bytes", 0) for r in per_rank)),  # frozen parameters
            "reshard/naive_bytes_per_rank": float(max(plan["naive_bytes_per_rank"])),
            "reshard/cross_node_bytes": float(plan["cross_node_bytes"]),
            "reshard/peak_extra_gb": max(r["peak_extra_bytes"] for r in per_rank) / 2**30,
            # layer granularity, optimized: layers in flight at once and their staging buffer (resharding_buffer_percent)
            "reshard/layers_in_flight": float(max(r.get("layers_in_flight", 0) for r in per_rank)),
            "reshard/staging_gb": max(r.get("staging_bytes", 0) for r in per_rank) / 2**30,
            "perf/max_memory_rss_gb": max(r["rss_bytes"] for r in per_rank) / 2**30,
        }
        delta_metrics(per_rank, m)
        if "max_diff" in per_rank[0]:
            diff = max(r["max_diff"] for r in per_rank)
            if diff != 0.0:
                raise RuntimeError(f"weight sync check failed: generation weights differ from the trained ones by {diff}")
            m["reshard/weight_max_diff"] = diff
        if prep_seconds is not None:
            # The part of the workers' resharding time the driver spent preparing the next batch.
            m["reshard/overlap_ratio"] = max(0.0, min(1.0, (seconds - waited) / seconds)) if seconds > 0 else 1.0
        session = profiler.active_session()
        if session is not None:
            for r in per_rank:
                session.events.extend(r.get("trace", []))
        if not self.logged:
            self._log_first(per_rank, m, seconds, prep_seconds is not None)
        return m

    def _log_first(self, per_rank: list[dict], m: dict[str, float], seconds: float, overlapped: bool) -> None:
        logger.debug("Layer-wise migration: %s", " -> ".join(per_rank[0]["layers"]))
        if "baseline" in per_rank[0]:
            base = max(r["baseline"]["seconds"] for r in per_rank)
            m["reshard/baseline_seconds"] = base
            logger.info("Resharding completed in %.3fs (vs %.3fs baseline), %s received per rank (naive: %s)",
                        seconds, base, human_bytes(m["reshard/bytes_per_rank"]), human_bytes(m["reshard/naive_bytes_per_rank"]))
        else:
            logger.info("Resharding completed in %.3fs, %s received per rank", seconds, human_bytes(m["reshard/bytes_per_rank"]))
        if overlapped:
            logger.info("Overlapped %d%% of resharding time with data loading", round(100 * m["reshard/overlap_ratio"]))
        self.logged = True

    # ------------------------------------------------------------------ cross-pool
    def sync_rollout(self) -> dict[str, float]:
        """Trained weights -> the rollout pool, waiting until it holds them."""
        return self.start_rollout_sync().finish()

    def start_rollout_sync(self, version: int | None = None) -> "RolloutSync":
        """Publish the trained weights and queue their receipt on the rollout pool at once."""
        return self.publish_for_rollout(version).submit()

    def publish_for_rollout(self, version: int | None = None) -> "PublishedWeights":
        """Publish the trained weights (each generation rank's pieces into the object store, so the
        next update may change the actor's): the slow half of a sync (crop, cast, checksums,
        `ray.put` per destination), which needs no lock of the caller's. `submit()` then queues
        their receipt on the rollout pool, behind the batches it is generating. version: the policy
        version these weights are (the replicas record it and stamp it on what they sample)."""
        r, check = self.spec.rollout.rollout, self.trainer.check_weight_sync
        tp, world = r.tensor_model_parallel_size, self.rollout.world_size
        percent = self.spec.hybrid_engine.resharding_buffer_percent
        if not self.logged and percent is not None:
            logger.warning("actor_rollout_ref.hybrid_engine.resharding_buffer_percent=%s is not used: trainer.async_rollout syncs the "
                           "rollout pool through the object store (each generation rank's pieces at once), not the layer-wise switch", percent)
        start = time.perf_counter()
        refs = self.actor.publish_weights(tp, world)
        trained = self.actor.weight_fingerprints(tp, world) if check else None  # now: the actor trains on before the pool receives
        return PublishedWeights(self, refs, trained, version, time.perf_counter() - start, (tp, world))

    def log_rollout_sync(self, m: dict[str, float], tp: int, world: int) -> None:
        if not self.logged:
            logger.info("Cross-pool weight sync from FSDP(dp=%d) on %s to TP=%d x DP=%d on %s: %s received per generation rank "
                        "(its generation slice) in %.3fs", self.actor.world_size, self.pools[0], tp, world // tp,
                        self.pools[1], human_bytes(m["reshard/bytes_per_rank"]), m["timing_s/sync_weights"])
            self.logged = True


def delta_metrics(per_rank: list[dict], m: dict) -> None:
    """Delta sync (hybrid_engine/delta.py, the cross-pool sync; the colocated switch's gathers):
    what changed, what moved, what was repaired, into `m` as sync/delta_* (nothing without it)."""
    if "delta_full_bytes" not in per_rank[0]:
        return
    m["sync/delta_changed_fraction"] = sum(x["delta_changed"] for x in per_rank) / max(1, sum(x["delta_elements"] for x in per_rank))
    m["sync/full_bytes_per_rank"] = float(max(x["delta_full_bytes"] for x in per_rank))
    m["sync/delta_bytes_per_rank"] = float(max(x["delta_sent_bytes"] for x in per_rank))
    m["sync/delta_repairs"] = float(sum(x["delta_repairs"] for x in per_rank))
    if m["sync/delta_repairs"]:
        logger.warning("delta weight sync: %d piece(s) failed their checksum or had no base and were sent whole (%s)",
                       m["sync/delta_repairs"], sorted({n for x in per_rank for n in x["delta_repaired"]})[:4])


class PublishedWeights:
    """Trained weights in the object store, not yet sent: `submit()` queues their receipt (cheap:
    object refs), so a caller may hold its lock for that alone."""

    def __init__(self, owner: WeightSync, refs: list, trained: dict | None, version: int | None, publish_s: float, layout: tuple[int, int]):
        self.owner, self.refs, self.trained, self.version, self.publish_s, self.layout = owner, refs, trained, version, publish_s, layout

    def submit(self) -> "RolloutSync":
        rollout, check = self.owner.rollout, self.trained is not None
        extra = {} if self.version is None else {"version": self.version}
        receive = rollout.submit("receive_weights", self.refs, check=check, **extra)
        fingerprints = rollout.submit("weight_fingerprints") if check else None  # right after the receipt, before any later batch
        return RolloutSync(self.owner, receive, fingerprints, self.trained, self.publish_s, self.layout)


class RolloutSync:
    """One cross-pool weight sync in flight: its receipt on the rollout pool (and, with
    trainer.check_weight_sync, the pool's fingerprints right after it and the trained ones)."""

    def __init__(self, owner: WeightSync, receive, fingerprints, trained: dict | None, publish_s: float, layout: tuple[int, int]):
        self.owner, self.receive, self.fingerprints, self.trained = owner, receive, fingerprints, trained
        self.publish_s, self.layout = publish_s, layout
        self.started = time.perf_counter() - publish_s

    def finish(self, timeout_s: float | None = None) -> dict[str, float]:
        """Wait for the receipt (at most timeout_s) and check it: the metrics of this sync."""
        per_rank = self.receive.result(timeout_s, "a weight sync to the rollout pool", REQUEST_TIMEOUT_KEY)
        m = {"timing_s/sync_weights": time.perf_counter() - self.started,
             "reshard/bytes_per_rank": float(max(x["bytes_received"] for x in per_rank))}
        delta_metrics(per_rank, m)
        if self.fingerprints is not None:
            held = self.fingerprints.result(timeout_s, "the rollout pool's weight fingerprints", REQUEST_TIMEOUT_KEY)
            mismatched = [k for fp in held for k, v in fp.items() if self.trained.get(k) != v]
            diff = max(x["max_diff"] for x in per_rank)
            if mismatched or diff != 0.0:
                raise RuntimeError(f"weight sync check failed: rollout weights differ from the trained ones ({mismatched[:3]}, max diff {diff})")
            m["reshard/weight_max_diff"] = 0.0
        self.owner.log_rollout_sync(m, *self.layout)
        return m


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"
