"""Recorded order of an overlapped weight sync (resharding_overlap_with_compute), for the e2e tests.

`record_overlap(monkeypatch)` wraps the driver's `WeightSync.reshard` / `finish_overlapped` and
notes, per step, on the wall clock the workers' trace spans use (time.time): when the reshard had
been submitted (when `reshard` returned: no later than the submit), when the next batch's
preparation started and ended, when the result was collected, and that step's trace spans (every
rank's "gather"/"copy" events, under `profiler.trace_resharding`). `assert_overlapped(records)`
then checks the claim itself, not the trainer's clamped `reshard/overlap_ratio`: for every step
that prepared a next batch, the reshard was submitted before the preparation ended and the
workers' resharding interval intersects the preparation interval.

`loader_seconds`: the preparation takes at least that long (a slow data loader). The tiny test
prompts are prepared in ~0.5 ms, less than Ray takes to start the workers' reshard (~2 ms, measured):
without it the preparation ends before the workers begin, whatever the trainer does."""

from __future__ import annotations

import time


def record_overlap(monkeypatch, loader_seconds: float = 0.0) -> list[dict]:
    from hybridflow import profiler
    from hybridflow.trainer.weight_sync import WeightSync

    records: list[dict] = []
    reshard, finish_overlapped = WeightSync.reshard, WeightSync.finish_overlapped

    def _reshard(self, *args, **kwargs):
        out = reshard(self, *args, **kwargs)
        records.append({"submitted": time.time()})
        return out

    def _finish_overlapped(self, prepare_next):
        rec = records[-1]
        session = profiler.active_session()
        seen = len(session.events) if session else 0

        def prepare():
            rec["prep_start"] = time.time()
            prepare_next()
            time.sleep(loader_seconds)
            rec["prep_end"] = time.time()

        out = finish_overlapped(self, prepare)
        rec["collected"] = time.time()
        rec["spans"] = list(session.events[seen:]) if session else []
        return out

    monkeypatch.setattr(WeightSync, "reshard", _reshard)
    monkeypatch.setattr(WeightSync, "finish_overlapped", _finish_overlapped)
    return records


def assert_overlapped(records: list[dict], steps: int) -> None:
    """Steps 1..steps-1 prepare the next batch while the workers reshard (the last has none)."""
    assert len(records) == steps and all("collected" in r for r in records), records  # overlap mode every step
    for k, r in enumerate(records[:-1], 1):
        spans = r["spans"]
        assert spans, f"step {k}: no worker trace spans"
        work_start = min(e["ts"] for e in spans) / 1e6
        work_end = max(e["ts"] + e["dur"] for e in spans) / 1e6
        where = (f"step {k}: submitted {r['submitted']:.4f}, prep {r['prep_start']:.4f}..{r['prep_end']:.4f}, "
                 f"workers {work_start:.4f}..{work_end:.4f}, collected {r['collected']:.4f}")
        assert r["submitted"] < r["prep_end"], where
        assert work_start < r["prep_end"] and r["prep_start"] < work_end, where  # the intervals intersect
        assert r["prep_end"] <= r["collected"] and work_end <= r["collected"], where
