"""DataFlow of plain driver functions: key plumbing, metrics, timing, and editing the flow."""

import time

import pytest
import torch

from hybridflow.protocol import Batch
from hybridflow.trainer.dataflow import DataFlow, Stage


def prompts():
    return Batch.from_dict(tensors={"x": torch.tensor([1.0, 2.0, 3.0])}, non_tensors={"gt": ["2", "4", "7"]}, meta={"step": 1})


def gen(batch):
    assert batch.keys() == ["x"]  # only the declared inputs are passed
    assert batch.meta["step"] == 1  # meta travels with the selection
    out = Batch.from_dict(tensors={"y": batch["x"] * 2, "junk": torch.zeros(3)}, meta={"metrics": {"gen/len": 5.0}, "gen_done": True})
    return out


def reward(batch):
    score = torch.tensor([float(str(int(y)) == g) for y, g in zip(batch["y"].tolist(), batch["gt"])])
    return Batch.from_dict(tensors={"score": score}, meta={"metrics": {"reward/mean": score.mean().item()}})


def adv(batch):
    return Batch.from_dict(tensors={"adv": batch["score"] - batch["score"].mean()})


def stats(batch):  # returns a metrics dict
    return {"stats/n": float(len(batch)), "stats/adv_sum": batch["adv"].sum().item()}


def make_flow():
    return DataFlow([
        Stage("gen", gen, ["x"], ["y"]),
        Stage("reward", reward, ["y", "gt"], ["score"]),
        Stage("adv", adv, ["score"], ["adv"]),
        Stage("stats", stats, ["adv"]),
    ])


def test_run_copies_outputs_and_merges_metrics():
    flow = make_flow()
    assert flow.names() == ["gen", "reward", "adv", "stats"]
    batch, metrics = flow.run(prompts())
    assert batch["y"].tolist() == [2.0, 4.0, 6.0]
    assert batch["score"].tolist() == [1.0, 1.0, 0.0]
    assert torch.allclose(batch["adv"], torch.tensor([1 / 3, 1 / 3, -2 / 3]))
    assert "junk" not in batch  # undeclared outputs are not copied
    assert batch.meta == {"step": 1, "gen_done": True}  # non-metrics meta merged, metrics not
    assert metrics["gen/len"] == 5.0
    assert metrics["reward/mean"] == pytest.approx(2 / 3)
    assert metrics["stats/n"] == 3.0 and metrics["stats/adv_sum"] == pytest.approx(0.0, abs=1e-6)
    for name in flow.names():
        assert metrics[f"timing_s/{name}"] >= 0.0
    assert set(metrics) == ({"gen/len", "reward/mean", "stats/n", "stats/adv_sum"} | {f"timing_s/{n}" for n in flow.names()}
                            | {"timing_s/dataflow", "perf/pool_busy/driver"})


def test_disabled_stage_skipped():
    calls = []
    flow = make_flow().insert_after("gen", Stage("never", lambda b: calls.append(1), [], [], enabled=False))
    _, metrics = flow.run(prompts())
    assert calls == [] and "timing_s/never" not in metrics
    flow.replace("never", enabled=True)
    _, metrics = flow.run(prompts())
    assert calls == [1] and "timing_s/never" in metrics


def test_missing_input_names_stage_and_key():
    flow = make_flow().remove("gen")
    with pytest.raises(KeyError) as e:
        flow.run(prompts())
    assert "'reward'" in str(e.value) and "'y'" in str(e.value)


def test_missing_declared_output_raises():
    flow = make_flow().replace("adv", lambda b: Batch.from_dict(tensors={"other": b["score"]}))
    with pytest.raises(KeyError) as e:
        flow.run(prompts())
    assert "'adv'" in str(e.value)


def test_replace_reward_stage_used_downstream():
    def length_reward(batch):  # a user's reward: 1 if y >= 4, minus 0.1
        return Batch.from_dict(tensors={"score": (batch["y"] >= 4).float() - 0.1})

    flow = make_flow()
    original = flow["reward"]
    assert flow.replace("reward", length_reward) is flow
    assert flow.names() == ["gen", "reward", "adv", "stats"]
    st = flow["reward"]
    assert st.fn is length_reward and st.inputs == original.inputs and st.outputs == original.outputs
    batch, metrics = flow.run(prompts())
    assert torch.allclose(batch["score"], torch.tensor([-0.1, 0.9, 0.9]))
    assert torch.allclose(batch["adv"], torch.tensor([-2 / 3, 1 / 3, 1 / 3]))  # adv saw the new scores
    assert "reward/mean" not in metrics and "timing_s/reward" in metrics
    # replace can also change inputs / outputs
    flow.replace("reward", inputs=["y"])
    assert flow["reward"].inputs == ["y"] and flow["reward"].fn is length_reward


def test_insert_after_and_remove():
    seen = {}

    def clip(batch):
        seen["score"] = batch["score"].tolist()
        return Batch.from_dict(tensors={"score": batch["score"].clamp(max=0.5)})

    flow = make_flow().insert_after("reward", Stage("clip", clip, ["score"], ["score"]))
    assert flow.names() == ["gen", "reward", "clip", "adv", "stats"]
    batch, metrics = flow.run(prompts())
    assert seen["score"] == [1.0, 1.0, 0.0]
    assert batch["score"].tolist() == [0.5, 0.5, 0.0]
    assert "timing_s/clip" in metrics
    flow.remove("clip").remove("stats")
    assert flow.names() == ["gen", "reward", "adv"]
    _, metrics = flow.run(prompts())
    assert "stats/n" not in metrics


@pytest.mark.parametrize("op", [
    lambda f: f.replace("rewrd", lambda b: None),
    lambda f: f.insert_after("rewrd", Stage("s", lambda b: None)),
    lambda f: f.remove("rewrd"),
    lambda f: f["rewrd"],
])
def test_unknown_stage_lists_stages(op):
    with pytest.raises(KeyError) as e:
        op(make_flow())
    msg = str(e.value)
    assert "'rewrd'" in msg and "['gen', 'reward', 'adv', 'stats']" in msg


def test_stage_with_outputs_must_return_a_batch():
    flow = DataFlow([Stage("bad", lambda b: {"m": 1.0}, outputs=["y"])])
    with pytest.raises(TypeError, match="'bad' declares outputs"):
        flow.run(Batch.from_dict(tensors={"x": torch.arange(2)}))


# ---------------------------------------------------------------- the scheduler
def sleeper(name, seconds, calls, outputs=()):
    def fn(batch):
        calls.append(name)
        time.sleep(seconds)
        return Batch.from_dict(tensors={k: torch.zeros(len(batch) or 2) for k in outputs}) if outputs else None

    return fn


def overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


def test_stages_on_disjoint_pools_overlap_same_pool_serialises():
    calls = []
    x = Batch.from_dict(tensors={"x": torch.zeros(2)})
    flow = DataFlow([
        Stage("old_log_prob", sleeper("old_log_prob", 0.3, calls, ["old"]), ["x"], ["old"], pool="actor"),
        Stage("values", sleeper("values", 0.3, calls, ["values"]), ["x"], ["values"], pool="critic"),
        Stage("ref", sleeper("ref", 0.3, calls, ["ref"]), ["x"], ["ref"], pool="actor"),
        Stage("adv", sleeper("adv", 0.05, calls, ["adv"]), ["old", "values", "ref"], ["adv"]),  # driver
        Stage("update_critic", sleeper("update_critic", 0.3, calls), ["adv", "values"], [], pool="critic"),
        Stage("update_actor", sleeper("update_actor", 0.3, calls), ["adv", "old"], [], pool="actor"),
        Stage("reshard", sleeper("reshard", 0.05, calls), [], [], pool="actor"),  # no data edge: pool order
    ])
    start = time.perf_counter()
    batch, metrics = flow.run(x)
    wall = time.perf_counter() - start
    t = {r.name: r for r in flow.timeline}
    # Concurrency is shown by the order of recorded times (B starts before A ends), never by a
    # wall-clock total, which a loaded machine stretches.
    assert {r.pool for r in flow.timeline} == {"actor", "critic", "driver"}
    assert overlaps(t["values"], t["old_log_prob"])
    assert overlaps(t["update_critic"], t["update_actor"])
    # the actor pool runs one stage at a time, in declaration order
    actor = sorted((r for r in flow.timeline if r.pool == "actor"), key=lambda r: r.start)
    assert [r.name for r in actor] == ["old_log_prob", "ref", "update_actor", "reshard"]
    assert all(a.end <= b.start for a, b in zip(actor, actor[1:]))
    assert t["adv"].start >= max(t["old_log_prob"].end, t["values"].end, t["ref"].end)
    assert metrics["perf/pool_busy/actor"] > 0 and metrics["perf/pool_busy/critic"] > 0
    # the flow's own timing spans every stage and lies within the caller's measurement
    span = max(r.end for r in flow.timeline) - min(r.start for r in flow.timeline)
    assert span <= metrics["timing_s/dataflow"] <= wall


def test_driver_stage_runs_while_worker_stage_in_flight():
    calls = []
    flow = DataFlow([
        Stage("gen", sleeper("gen", 0.1, calls, ["resp"]), ["x"], ["resp"], pool="actor"),
        Stage("reward", sleeper("reward", 0.3, calls, ["score"]), ["resp"], ["score"]),
        Stage("old_log_prob", sleeper("old_log_prob", 0.3, calls, ["old"]), ["resp"], ["old"], pool="actor"),
    ])
    flow.run(Batch.from_dict(tensors={"x": torch.zeros(2)}))
    t = {r.name: r for r in flow.timeline}
    assert overlaps(t["reward"], t["old_log_prob"])


def test_missing_producer_and_cycle_fail_before_the_first_stage_runs():
    calls = []
    flow = DataFlow([
        Stage("gen", sleeper("gen", 0, calls, ["y"]), ["x"], ["y"]),
        Stage("adv", sleeper("adv", 0, calls, ["adv"]), ["y", "values"], ["adv"]),
    ])
    with pytest.raises(KeyError) as e:
        flow.check(["x"])
    assert "'adv'" in str(e.value) and "'values'" in str(e.value)
    with pytest.raises(KeyError):
        flow.run(Batch.from_dict(tensors={"x": torch.zeros(2)}))
    assert calls == []

    cyclic = DataFlow([
        Stage("a", sleeper("a", 0, calls, ["p"]), ["q"], ["p"]),
        Stage("b", sleeper("b", 0, calls, ["q"]), ["p"], ["q"]),
    ])
    with pytest.raises(ValueError, match="cycle: .*a.*b|cycle: .*b.*a"):
        cyclic.run(Batch.from_dict(tensors={"x": torch.zeros(2)}))
    assert calls == []


def test_stages_added_out_of_order_wait_for_their_producer():
    seen = []
    flow = DataFlow()
    flow.add_stage("adv", lambda b: (seen.append("adv"), Batch.from_dict(tensors={"adv": b["score"] * 2}))[1], ["score"], ["adv"])
    flow.add_stage("reward", lambda b: (seen.append("reward"), Batch.from_dict(tensors={"score": b["x"] + 1}))[1], ["x"], ["score"])
    out = flow.run(Batch.from_dict(tensors={"x": torch.tensor([1.0, 2.0])}))
    assert seen == ["reward", "adv"] and out["adv"].tolist() == [4.0, 6.0]


def test_sync_stage_is_a_barrier():
    calls = []
    flow = DataFlow([
        Stage("slow", sleeper("slow", 0.2, calls, ["a"]), ["x"], ["a"], pool="p1"),
        Stage("barrier", sleeper("barrier", 0.0, calls, ["b"]), ["x"], ["b"], sync=True),
        Stage("after", sleeper("after", 0.0, calls, ["c"]), ["x"], ["c"], pool="p2"),
    ])
    flow.run(Batch.from_dict(tensors={"x": torch.zeros(2)}))
    t = {r.name: r for r in flow.timeline}
    assert t["barrier"].start >= t["slow"].end and t["after"].start >= t["barrier"].end


def test_add_stage_batch_size_and_grad_accum_steps():
    class Update:  # an object with an update method: records chunk sizes and optimizer steps
        def __init__(self):
            self.calls = []

        def update(self, batch, optimizer_step=True, loss_scale=1.0):
            self.calls.append((len(batch), optimizer_step, loss_scale))
            return Batch.from_dict(tensors={"loss": batch["x"] * 0 + float(len(self.calls))}, meta={"metrics": {"update/n": float(len(batch))}})

    upd = Update()
    flow = DataFlow(config=None)
    flow.add_stage("double", lambda b: Batch.from_dict(tensors={"y": b["x"] * 2}), ["x"], ["y"], batch_size=4)
    flow.add_stage("update", upd, ["y", "x"], ["loss"], batch_size=2, grad_accum_steps=2)
    results = flow.run(Batch.from_dict(tensors={"x": torch.arange(10.0)}))
    assert results["y"].tolist() == [2.0 * i for i in range(10)]
    # 5 chunks of 2 rows in groups of 2 (the last alone): one optimizer step per group, each
    # chunk's loss scaled by 1 / (chunks in its group)
    assert upd.calls == [(2, False, 0.5), (2, True, 0.5), (2, False, 0.5), (2, True, 0.5), (2, True, 1.0)]
    assert results["loss"].tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert results["update/n"] == 2.0 and "timing_s/update" in results.metrics
    batch, metrics = results  # the list form's unpacking works on the same result
    assert batch is results and metrics is results.metrics
    with pytest.raises(ValueError, match="already exists"):
        flow.add_stage("update", upd, ["y"], ["loss"])
    with pytest.raises(TypeError, match="module must be"):
        flow.add_stage("bad", 3, ["y"], [])


def test_overwriting_stage_waits_for_earlier_readers():
    # "late" reads x but also waits on a slow stage; "overwrite" writes x and must not run first
    seen = {}

    def late(b):
        seen["x"] = b["x"].tolist()
        return Batch.from_dict(tensors={"y": b["x"]})

    flow = DataFlow([
        Stage("slow", sleeper("slow", 0.2, [], ["s"]), ["x"], ["s"], pool="p1"),
        Stage("late", late, ["x", "s"], ["y"]),
        Stage("overwrite", lambda b: Batch.from_dict(tensors={"x": b["x"] + 100}), ["x"], ["x"], pool="p2"),
    ])
    out = flow.run(Batch.from_dict(tensors={"x": torch.tensor([1.0, 2.0])}))
    assert seen["x"] == [1.0, 2.0] and out["x"].tolist() == [101.0, 102.0]


def test_a_failing_stage_raises_without_waiting_for_other_pools():
    def boom(b):
        raise RuntimeError("reward function broke")

    import threading

    done = threading.Event()

    def long(b):
        time.sleep(3.0)
        done.set()
        return Batch.from_dict(tensors={"a": torch.zeros(len(b))})

    flow = DataFlow([
        Stage("long", long, ["x"], ["a"], pool="critic"),
        Stage("reward", boom, ["x"], ["b"]),
    ])
    with pytest.raises(RuntimeError, match="reward function broke"):
        flow.run(Batch.from_dict(tensors={"x": torch.zeros(2)}))
    assert not done.is_set()  # raised while the other pool's stage was still running
