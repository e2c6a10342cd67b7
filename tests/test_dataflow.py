"""DataFlow of plain driver functions: key plumbing, metrics, timing, and editing the flow."""

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


def stats(batch):  # whole batch (inputs=[]), returns a metrics dict
    return {"stats/n": float(len(batch)), "stats/adv_sum": batch["adv"].sum().item()}


def make_flow():
    return DataFlow([
        Stage("gen", gen, ["x"], ["y"]),
        Stage("reward", reward, ["y", "gt"], ["score"]),
        Stage("adv", adv, ["score"], ["adv"]),
        Stage("stats", stats),
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
    assert set(metrics) == {"gen/len", "reward/mean", "stats/n", "stats/adv_sum"} | {f"timing_s/{n}" for n in flow.names()}


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
