"""Reliability and observability end to end: kill -9 and resume bit for bit, a dead worker and a
stuck collective reported by rank, nan updates aborted, Prometheus scraped during a run, the
TensorBoard events, the HF export."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import ray
import torch
import torch.distributed as dist

from conftest import rl_overrides
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.controller.decorator import Dispatch, register
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import RayWorkerGroup, ResourcePool, WorkerCallError, WorkerDiedError
from hybridflow.trainer.rl import PROMPT_KEYS, NonFiniteError, RLTrainer

pytestmark = pytest.mark.usefixtures("ray_cluster")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ kill -9 and resume
DRIVER = """
import sys
from hybridflow.config import HybridFlowConfig, load_config
from hybridflow.trainer.rl import RLTrainer
trainer = RLTrainer(load_config(None, sys.argv[1:], schema=HybridFlowConfig))
try:
    trainer.fit()
finally:
    trainer.shutdown()
"""


def _driver(tmp_path, overrides: list[str]) -> list[str]:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return [sys.executable, str(script), *overrides, f"ray_init.address={ray.get_runtime_context().gcs_address}"]


def _checkpoint(step_dir) -> dict:
    """Every role's DCP checkpoint (model + optimizer state) as plain tensors, for == comparison."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for role in sorted(os.listdir(step_dir)):
        if os.path.isdir(step_dir / role):
            dcp_to_torch_save(str(step_dir / role), str(step_dir / f"{role}.pt"))
            out[role] = torch.load(step_dir / f"{role}.pt", weights_only=False)
    return out


def _assert_same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _step_metrics(run_dir) -> dict[int, dict]:
    """The last logged metrics of each step, without wall-clock measurements."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/", "reshard/"))}
    return out


KILL_INSIDE_SAVE = """
import os, signal
at, replace = os.environ["KILL_INSIDE_SAVE_OF_STEP"], os.replace

def replace_or_die(src, dst):  # the trainer's own save runs; it dies at step k's rename, every part written
    if str(src).endswith(f"global_step_{at}.tmp"):
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst)

os.replace = replace_or_die
""" + DRIVER


@pytest.mark.parametrize("name, extra, kill_inside_save", [
    # killed inside step 4's save (the trainer's own save code runs; it dies at the rename, every part
    # written to global_step_4.tmp): the latest checkpoint is still step 2, and the run resumes from it.
    # The exact rollout mode: the mismatch is 0.0 before the kill and after the resume (slime's failure)
    ("grpo_overlap_tp2_adaptive_kl_exact", ["actor_rollout_ref.hybrid_engine.resharding_overlap_with_compute=true",
                                            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "algorithm.use_kl_in_reward=true",
                                            "algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.rollout.exact=true"], True),
    # killed right after step 2's checkpoint. PPO with a critic, actor and critic training LoRA adapters (their
    # checkpoints: adapters, the critic's value head, and their optimizer state only), the actor with a KL loss
    # against the adapter-free reference
    ("ppo_critic_lora", ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.model.lora_rank=4",
                         "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.actor.use_kl_loss=true", "critic.model.lora_rank=4"], False),
], ids=["grpo_overlap_tp2_adaptive_kl_exact_killed_inside_a_save", "ppo_critic_lora"])
def test_sigkill_mid_run_then_resume_equals_the_uninterrupted_run(name, extra, kill_inside_save, tiny_model_dir, task_dir, varied_reward,
                                                                  tmp_path):
    """A driver killed with SIGKILL (after a checkpoint, or inside one's save), restarted with the
    same command, ends with the same weights and optimizer state (bit for bit) and logs the same
    metrics as a run never interrupted."""
    def command(run_dir, script=DRIVER):
        (tmp_path / "kill_driver.py").write_text(script)
        cmd = _driver(tmp_path, rl_overrides(tiny_model_dir, task_dir, run_dir, f"custom_reward_function.path={varied_reward}",
                                             "trainer.total_training_steps=6", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=2", *extra))
        return cmd if script is DRIVER else [cmd[0], str(tmp_path / "kill_driver.py"), *cmd[2:]]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The uninterrupted run goes on beside the killed one (independent drivers and Ray clusters; the
    # comparison is bit for bit, which contention cannot change): the test's wall time is one run shorter.
    uninterrupted = subprocess.Popen(command(straight), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    latest = killed / "latest_checkpointed_iteration.txt"
    if kill_inside_save:
        proc = subprocess.run(command(killed, KILL_INSIDE_SAVE), timeout=300, capture_output=True, env={**os.environ, "KILL_INSIDE_SAVE_OF_STEP": "4"})
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        assert (killed / "global_step_4.tmp" / "trainer_state.pt").exists() and not (killed / "global_step_4").exists()
        assert latest.read_text() == "2"  # the half-written save is not the latest
    else:
        proc = subprocess.Popen(command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 240
        while not (latest.exists() and latest.read_text() == "2") and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert int(latest.read_text()) < 6, "the driver finished before it was killed"
    subprocess.run(command(killed), check=True, timeout=300, capture_output=True)  # the same command resumes
    _, err = uninterrupted.communicate(timeout=300)
    assert uninterrupted.returncode == 0, err[-3000:]

    assert sorted(d.name for d in killed.iterdir() if d.name.startswith("global_step_")) == ["global_step_4", "global_step_6"]
    _assert_same(_checkpoint(straight / "global_step_6"), _checkpoint(killed / "global_step_6"), name)
    a, b = _step_metrics(straight), _step_metrics(killed)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert a[step] == b[step], (name, step)
        # the train-rollout mismatch is among them: a resume changes nothing the rollout samples
        assert {"rollout/logprob_diff_max", "rollout/logprob_diff_p99", "rollout/logprob_diff_alarm"} <= a[step].keys()
    if "exact" in name:
        assert [b[s]["rollout/logprob_diff_max"] for s in sorted(b)] == [0.0] * 6


def test_kill_9_of_hybridflow_train_with_default_settings_and_the_same_command_resumes(tiny_model_dir, task_dir, tmp_path):
    """README's promise with no checkpoint key given: `hybridflow train configs/grpo_tiny.yaml` writes a
    checkpoint every trainer.save_freq (default 20) steps and at the last; after `kill -9` the same command
    continues from the last checkpoint. (The overrides only shorten the run: 22 steps, no validation.)"""
    runs = tmp_path / "runs"  # what `hybridflow make-model runs/tiny_model` and `make-data runs/data` write
    runs.mkdir()
    (runs / "tiny_model").symlink_to(tiny_model_dir)
    (runs / "data").symlink_to(task_dir)
    exe = os.path.join(os.path.dirname(sys.executable), "hybridflow")
    command = [exe, "train", os.path.join(ROOT, "configs", "grpo_tiny.yaml"), "trainer.total_training_steps=22", "trainer.test_freq=-1",
               "trainer.val_before_train=false", "trainer.progress_bar=false"]  # its own Ray, as typed (the config's paths are relative)
    ckpt = tmp_path / "checkpoints" / "grpo_tiny"  # the config's trainer.default_local_dir, relative to where the command runs
    latest = ckpt / "latest_checkpointed_iteration.txt"
    with open(tmp_path / "killed.log", "w") as log:  # a session of its own: the Ray helpers a SIGKILL orphans are removed with it
        proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.time() + 240
        while not latest.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert latest.read_text() == "20", "no default checkpoint at step 20, or the run ended before it was killed"
    rerun = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)  # the same command
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from {ckpt / 'global_step_20'} at step 20" in rerun.stderr, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout.splitlines()[-1])["steps"] == 22
    assert latest.read_text() == "22" and (ckpt / "global_step_22").is_dir()  # the last step is always saved
    steps = [json.loads(line)["step"] for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [21, 22] and steps.count(1) == 1  # the same command went on from step 21; it did not start over


# ------------------------------------------------------------------ faults
class FaultyWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def init_model(self, timeout_s: float) -> None:
        self.init_process_group("cpu", timeout_s)

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def rank_1_hangs(self) -> int:
        if self.rank == 1:  # stuck outside any collective
            time.sleep(120)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def lonely_all_reduce(self) -> int:
        if self.rank == 0:  # rank 1 never joins: a stuck collective
            dist.all_reduce(torch.ones(1))
        return self.rank


@contextlib.contextmanager
def _faulty_group(name, collective_timeout_s, straggler_timeout_s=None):
    """A started 2-rank group of FaultyWorker on its own pool, released afterwards."""
    pool = ResourcePool(1, 2, 0.5, name=f"faults_{name}")
    wg = RayWorkerGroup(pool, FaultyWorker, name=f"faulty_{name}_{os.getpid()}", straggler_timeout_s=straggler_timeout_s)
    try:
        wg.init_model(collective_timeout_s)
        yield wg
    finally:
        wg.shutdown()
        pool.release()


def test_a_worker_killed_mid_call_is_reported_by_rank_within_60s():
    with _faulty_group("death", 60.0) as wg:
        pids = wg.pids()
        pending = wg.submit("nap", 120)
        time.sleep(1)
        os.kill(pids[1], signal.SIGKILL)
        start = time.time()
        with pytest.raises(WorkerDiedError, match=r"the worker worker rank 1 \(pool 'faults_death'\) died|rank 1 .* died") as e:
            pending.result()
        assert time.time() - start < 60
        assert "nap" in str(e.value) and "resume" in str(e.value)


def test_an_actor_worker_killed_mid_training_stops_the_run_naming_it(tiny_model_dir, task_dir, varied_reward, tmp_path):
    import threading

    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path / "run", f"custom_reward_function.path={varied_reward}",
                                         "trainer.total_training_steps=1000"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    errors: list[BaseException] = []

    def fit():
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    try:
        trainer.init_workers()
        pids = trainer.wg.pids()
        thread = threading.Thread(target=fit)
        thread.start()
        deadline = time.time() + 300
        while trainer.global_step < 2:
            assert thread.is_alive() and time.time() < deadline, f"the run stopped or stalled before step 2: {errors}"
            time.sleep(0.01)
        os.kill(pids[1], signal.SIGKILL)
        start = time.time()
        thread.join(60)
        assert not thread.is_alive() and time.time() - start < 60
        assert isinstance(errors[0], WorkerDiedError), errors
        assert "the actor worker rank 1 (pool 'global_pool')" in str(errors[0]) and "resume" in str(errors[0])
    finally:
        trainer.shutdown()


def test_a_stuck_collective_times_out_with_the_rank():
    with _faulty_group("stuck", 3.0) as wg:  # trainer.collective_timeout_s
        start = time.time()
        with pytest.raises(WorkerCallError, match=r"rank 0 .* during lonely_all_reduce raised"):
            wg.lonely_all_reduce()
        assert time.time() - start < 60


def test_a_rank_hung_outside_collectives_is_reported():
    with _faulty_group("hung", 60.0, straggler_timeout_s=2.0) as wg:
        start = time.time()
        with pytest.raises(WorkerCallError, match=r"rank\(s\) \[1\] \(pool 'faults_hung'\) did not finish rank_1_hangs within 2.0 s"):
            wg.rank_1_hangs()
        assert time.time() - start < 30


def test_nan_losses_skip_updates_then_abort(tiny_model_dir, task_dir, tmp_path):
    reward = tmp_path / "nan_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return float('nan')\n")
    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, tmp_path / "run", f"custom_reward_function.path={reward}",
                                         "trainer.max_nonfinite_steps=2", "trainer.total_training_steps=5"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    try:
        with pytest.raises(NonFiniteError, match=r"2 consecutive steps \(up to step 2\) had a nan/inf loss"):
            trainer.fit()
        assert trainer.global_step == 2
        # both skipped updates left the weights exactly as loaded (no step on a nan gradient)
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        trainer.actor.save_hf_model(str(tmp_path / "after"))
        after = load_file(str(tmp_path / "after" / "model.safetensors"))
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
        assert after.keys() <= initial.keys() and len(after) > 0
        assert all(torch.equal(after[k], initial[k]) for k in after)
    finally:
        trainer.shutdown()


# ------------------------------------------------------------------ observability and export
def test_prometheus_during_a_run_tensorboard_and_hf_export(tiny_model_dir, task_dir, varied_reward, tmp_path):
    import socket
    import threading

    from prometheus_client.parser import text_string_to_metric_families
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    cfg = load_config(None, rl_overrides(tiny_model_dir, task_dir, run, f"custom_reward_function.path={varied_reward}",
                                         "trainer.total_training_steps=4", "trainer.test_freq=2",
                                         "trainer.save_freq=4", "trainer.save_hf_model=true", "trainer.logger=[jsonl,tensorboard]",
                                         f"trainer.prometheus.port={port}",
                                         "actor_rollout_ref.hybrid_engine.resharding_overlap_with_compute=true"), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    scraped: dict[str, float] = {}
    try:
        result = {}
        thread = threading.Thread(target=lambda: result.update(trainer.fit()))
        thread.start()
        while thread.is_alive():  # scrape while the run goes on
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                scraped.update({s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples})
            except OSError:
                pass  # not serving yet (or already closed)
            time.sleep(0.05)
        thread.join()
        assert result["steps"] == 4
        batch = trainer.collate([trainer.val_ds[i] for i in range(16)])
        rollout = trainer.rollout.generate_sequences(batch.select(PROMPT_KEYS), trainer._sampling(greedy=True))
    finally:
        trainer.shutdown()

    assert scraped.get("hybridflow_step", 0) >= 1
    dashboard = json.loads(open(os.path.join(ROOT, "monitoring", "grafana_dashboard.json")).read())
    names = [t["expr"] for p in dashboard["panels"] for t in p["targets"] if not t["expr"].startswith("{")]
    assert names and set(names) <= set(scraped), set(names) - set(scraped)  # every panel plots a metric the run exports
    assert any(k.startswith("hybridflow_val_core_") for k in scraped)

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("critic/score/mean")] == [1, 2, 3, 4]

    # `hybridflow export` and `hybridflow plot` as a user types them
    import subprocess
    import sys

    cli = [sys.executable, "-m", "hybridflow.cli"]
    proc = subprocess.run(cli + ["export", str(run / "global_step_4"), str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = proc.stdout.strip().splitlines()[-1]
    assert exported == str(tmp_path / "hf") or os.path.samefile(exported, tmp_path / "hf")
    assert os.path.isfile(os.path.join(exported, "model.safetensors"))
    proc = subprocess.run(cli + ["plot", str(run / "metrics.jsonl"), "-o", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    at_end = AutoModelForCausalLM.from_pretrained(run / "hf_model")  # trainer.save_hf_model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), at_end.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), base.state_dict().values()))
    R = rollout["responses"].shape[1]
    with torch.no_grad():
        greedy = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], do_sample=False, max_new_tokens=R,
                                min_new_tokens=R, pad_token_id=0, eos_token_id=None)
    mask = rollout["response_mask"].bool()
    assert torch.equal(greedy[:, -R:][mask], rollout["responses"][mask])  # the same greedy tokens as the trained rollout
    assert math.isfinite(scraped["hybridflow_timing_s_reshard"])


def test_resume_modes_disable_and_resume_path(tiny_model_dir, task_dir, varied_reward, tmp_path):
    """trainer.resume_mode: `disable` starts from step 1 although checkpoints exist; `resume_path`
    continues from the given global_step_<k>, not from the latest."""
    base = [f"custom_reward_function.path={varied_reward}", "trainer.save_freq=1"]

    def run(out, *extra):
        trainer = RLTrainer(load_config(None, rl_overrides(tiny_model_dir, task_dir, out, *base, *extra), schema=HybridFlowConfig))
        try:
            return [h["step"] for h in trainer.fit()["history"] if h["step"] > 0]
        finally:
            trainer.shutdown()

    first = tmp_path / "first"
    assert run(first, "trainer.total_training_steps=2") == [1, 2]
    assert (first / "global_step_1").is_dir() and (first / "global_step_2").is_dir()
    assert run(first, "trainer.total_training_steps=3", "trainer.resume_mode=disable") == [1, 2, 3]
    other = tmp_path / "other"
    assert run(other, "trainer.total_training_steps=3", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={first / 'global_step_1'}") == [2, 3]


def test_async_resume_regenerates_the_batch_in_flight_at_the_checkpoint(tiny_model_dir, task_dir, varied_reward, tmp_path):
    """Async rollout one batch ahead: when step 2's checkpoint is written, step 3's batch is already
    generated (with step 1's weights). Resumed from that checkpoint, the run regenerates it from the
    loader position stored before it, with the restored weights (regenerated, not persisted): it
    trains the same prompts at steps 3 and 4 as the uninterrupted run (none lost, none twice),
    step 3's batch at staleness 0 (sampled by the restored policy) and step 4's within the bound."""
    out = tmp_path / "run"
    base = rl_overrides(tiny_model_dir, task_dir, out, f"custom_reward_function.path={varied_reward}", "trainer.total_training_steps=4",
                        "trainer.save_freq=2", "trainer.async_rollout=true", "async_training.max_staleness=1",
                        "resource_pool.pools.actor_pool.workers_per_node=1", "resource_pool.pools.rollout_pool.workers_per_node=1",
                        "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool")

    def run(*extra) -> dict[int, tuple]:
        trainer = RLTrainer(load_config(None, [*base, *extra], schema=HybridFlowConfig))
        trained = {}
        try:
            trainer.init_workers()
            take = trainer.async_gen.take

            def taking(step):
                batch, metrics = take(step)
                trained[step] = (batch["prompts"].tolist(), metrics["rollout/staleness_max"])
                return batch, metrics

            trainer.async_gen.take = taking
            trainer.fit()
        finally:
            trainer.shutdown()
        return trained

    straight = run()
    resumed = run("trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'global_step_2'}")
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    assert [resumed[s][0] for s in (3, 4)] == [straight[s][0] for s in (3, 4)]  # the same prompts: none lost, none twice
    assert straight[3][1] == 1.0 and resumed[3][1] == 0.0 and resumed[4][1] <= 1.0
