"""Dispatch / collect of worker calls and the colocated (fused) worker class, in-process (no Ray)."""

import pytest
import torch

from hybridflow.controller.decorator import DISPATCH_ATTR, Dispatch, collect_results, dispatch_args, mean_metrics, register
from hybridflow.controller.worker import Worker, colocated_worker_cls, registered_methods
from hybridflow.protocol import Batch


def rows(n):
    return Batch.from_dict(
        tensors={"x": torch.arange(n * 2).reshape(n, 2)},
        non_tensors={"name": [f"s{i}" for i in range(n)]},
        meta={"temperature": 0.5},
    )


# ------------------------------------------------------------------------------- dispatch_args
def test_one_to_all_and_rank_zero_broadcast():
    b = rows(5)
    for mode in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        rank_args, rank_kwargs, pad = dispatch_args(mode, 3, (b, 7), {"k": "v"})
        assert pad == 0 and len(rank_args) == len(rank_kwargs) == 3
        for a, kw in zip(rank_args, rank_kwargs):
            assert a[0] is b and a[1] == 7 and kw == {"k": "v"}


def test_dp_compute_pads_and_chunks():
    b = rows(5)
    rank_args, rank_kwargs, pad = dispatch_args(Dispatch.DP_COMPUTE, 2, (b, 3.0), {"data": b, "flag": True})
    assert pad == 1 and len(rank_args) == 2
    # padded with a copy of row 0 -> [0..4, 0], split into [0,1,2] and [3,4,0]
    assert rank_args[0][0]["x"][:, 0].tolist() == [0, 2, 4]
    assert rank_args[1][0]["x"][:, 0].tolist() == [6, 8, 0]
    assert list(rank_args[1][0]["name"]) == ["s3", "s4", "s0"]
    assert rank_args[0][1] == rank_args[1][1] == 3.0  # non-Batch args broadcast
    for r in range(2):
        assert len(rank_args[r][0]) == 3 and rank_args[r][0].meta == {"temperature": 0.5}
        assert rank_kwargs[r]["flag"] is True
        assert torch.equal(rank_kwargs[r]["data"]["x"], rank_args[r][0]["x"])


def test_dp_compute_no_pad_when_divisible():
    rank_args, _, pad = dispatch_args(Dispatch.DP_COMPUTE, 2, (rows(4),), {})
    assert pad == 0 and [a[0]["x"][:, 0].tolist() for a in rank_args] == [[0, 2], [4, 6]]


def test_dp_compute_round_trip_unpads_in_order():
    b = rows(5)
    rank_args, rank_kwargs, pad = dispatch_args(Dispatch.DP_COMPUTE, 2, (b,), {})

    def worker(rank, batch):  # a DP_COMPUTE method: one output row per input row
        out = Batch.from_dict(tensors={"y": batch["x"].sum(-1) * 10}, non_tensors={"name": batch["name"]})
        out.meta["metrics"] = {"loss": float(rank + 1), "only_rank0": 4.0} if rank == 0 else {"loss": float(rank + 1)}
        return out

    results = [worker(r, *rank_args[r], **rank_kwargs[r]) for r in range(2)]
    out = collect_results(Dispatch.DP_COMPUTE, results, pad)
    assert len(out) == 5
    assert out["y"].tolist() == [10, 50, 90, 130, 170]
    assert list(out["name"]) == ["s0", "s1", "s2", "s3", "s4"]
    assert out.meta["metrics"] == {"loss": 1.5, "only_rank0": 4.0}


def test_collect_dict_results_averaged_and_others():
    res = [{"a": 1.0, "b": 2}, {"a": 3.0}]
    assert collect_results(Dispatch.DP_COMPUTE, res, 0) == {"a": 2.0, "b": 2.0}
    assert mean_metrics(res) == {"a": 2.0, "b": 2.0}
    assert collect_results(Dispatch.ONE_TO_ALL, [1, 2, 3], 0) == [1, 2, 3]
    assert collect_results(Dispatch.RANK_ZERO, ["r0", "r1"], 0) == "r0"
    assert collect_results(Dispatch.DP_COMPUTE, [None, None], 0) == [None, None]


def test_collect_batch_without_metrics_has_none():
    out = collect_results(Dispatch.DP_COMPUTE, [rows(2), rows(2)], 0)
    assert len(out) == 4 and "metrics" not in out.meta


# ------------------------------------------------------------------------------- worker classes
class Actor:
    def __init__(self, scale=1):
        self.scale = scale

    @register(Dispatch.DP_COMPUTE)
    def compute(self, batch):
        return Batch.from_dict(tensors={"y": batch["x"] * self.scale})

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self):
        return f"actor{self.scale}"

    @register(Dispatch.RANK_ZERO)
    def save(self, path):
        return ("actor", path)

    def helper(self):  # not registered
        return 0

    @register(Dispatch.ONE_TO_ALL)
    def _private(self):  # registered but private
        return 0


class Critic:
    def __init__(self, bias=0):
        self.bias = bias

    @register(Dispatch.DP_COMPUTE)
    def compute(self, batch):
        return {"vf": float(self.bias)}

    @register()
    def init_model(self):
        return f"critic{self.bias}"


def test_registered_methods():
    assert registered_methods(Actor) == {
        "compute": Dispatch.DP_COMPUTE,
        "init_model": Dispatch.ONE_TO_ALL,
        "save": Dispatch.RANK_ZERO,
    }
    assert registered_methods(Critic) == {"compute": Dispatch.DP_COMPUTE, "init_model": Dispatch.ONE_TO_ALL}


def test_colocated_worker_cls(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    Fused = colocated_worker_cls({"actor": Actor, "critic": Critic})
    assert issubclass(Fused, Worker)
    assert registered_methods(Fused) == {
        "actor__compute": Dispatch.DP_COMPUTE,
        "actor__init_model": Dispatch.ONE_TO_ALL,
        "actor__save": Dispatch.RANK_ZERO,
        "critic__compute": Dispatch.DP_COMPUTE,
        "critic__init_model": Dispatch.ONE_TO_ALL,
    }
    assert not hasattr(Fused, "actor__helper") and not hasattr(Fused, "actor___private")
    w = Fused({"actor": {"scale": 3}, "critic": {"bias": 2}})
    assert (w.rank, w.world_size, w.local_rank) == (1, 2, 0)
    assert w.actor__init_model() == "actor3" and w.critic__init_model() == "critic2"
    assert w.actor__compute(rows(2))["y"].tolist() == [[0, 3], [6, 9]]
    assert w.critic__compute(rows(2)) == {"vf": 2.0}
    assert w.actor__save(path="/p") == ("actor", "/p")
    assert getattr(Fused.actor__save, DISPATCH_ATTR) is Dispatch.RANK_ZERO


def test_colocated_default_role_kwargs(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    w = colocated_worker_cls({"actor": Actor, "critic": Critic})({})
    assert (w.rank, w.world_size) == (0, 1)
    assert w.actor__init_model() == "actor1" and w.critic__init_model() == "critic0"
    with pytest.raises(AttributeError):
        w.actor__helper


def test_dp_compute_rejects_batches_of_different_lengths():
    a = Batch.from_dict(tensors={"x": torch.arange(5)})
    b = Batch.from_dict(tensors={"x": torch.arange(4)})
    with pytest.raises(ValueError, match="same number of rows"):
        dispatch_args(Dispatch.DP_COMPUTE, 2, (a, b), {})
