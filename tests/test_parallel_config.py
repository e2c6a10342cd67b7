"""The parallel config file (ParallelConfig -> HybridFlowConfig), engine kwargs, their validation,
and what the FSDP2 sharding strategies really do (one 2-process gloo run)."""

import json
import os
import tempfile

import pytest
import torch

from hybridflow.config import ConfigError, HybridFlowConfig, load_config, validate_config
from hybridflow.config.parallel import (ParallelConfig, ParallelFSDPConfig, apply_engine_kwargs, apply_parallel_config,
                                        as_parallel_config, load_parallel_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, text, name="parallel.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return str(f)


def _fsdp_cfgs(cfg):
    return [cfg.actor_rollout_ref.actor.fsdp_config, cfg.actor_rollout_ref.ref.fsdp_config, cfg.critic.fsdp_config]


def _problems(cfg) -> str:
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    return str(e.value)


# ---------------------------------------------------------------- loading + mapping
def test_defaults_and_example_files():
    p = ParallelConfig()  # every key unset
    assert (p.model_parallel_size, p.pipeline_parallel_size, p.data_parallel_size, p.fsdp_enabled) == (None, None, None, None)
    assert p.fsdp_config == ParallelFSDPConfig(None, None, None)
    assert (p.enable_resharding_opt, p.resharding_overlap_with_compute, p.resharding_buffer_percent) == (None, None, None)
    # applying the defaults changes nothing
    base = load_config(None, ["actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16", "actor_rollout_ref.hybrid_engine.granularity=full"])
    assert apply_parallel_config(base, p) == base

    for name, (pp, tp, dp, gen_tp), mp in [("parallel_dp2_tp2.yaml", (1, 1, 2, 2), None), ("parallel_dp4_tp2.yaml", (1, 1, 4, 2), "bf16"),
                                            ("parallel_tp2xdp2.yaml", (1, 2, 2, 2), None), ("parallel_pp2xdp2.yaml", (2, 1, 2, 2), None)]:
        p = load_parallel_config(os.path.join(ROOT, "configs", name))
        assert (p.pipeline_parallel_size, p.model_parallel_size, p.data_parallel_size) == (pp, tp, dp)
        cfg = apply_parallel_config(load_config(None, [f"trainer.n_gpus_per_node={pp * tp * dp}"]), p)
        a = cfg.actor_rollout_ref.actor
        assert (a.pipeline_model_parallel_size, a.tensor_model_parallel_size) == (pp, tp)
        assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == gen_tp
        assert a.fsdp_config.mixed_precision == mp


def test_every_key_is_mapped(tmp_path):
    f = _write(tmp_path, """
model_parallel_size: 2
pipeline_parallel_size: 1
data_parallel_size: 2
generation_tensor_parallel_size: 4
fsdp_enabled: true
fsdp_config:
  mixed_precision: true
  offload_params: true
  sharding_strategy: SHARD_GRAD_OP
enable_resharding_opt: false
resharding_overlap_with_compute: true
""")
    base = load_config(None, ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"])
    cfg = apply_parallel_config(base, load_parallel_config(f))
    assert base == load_config(None, ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"])  # input not modified
    assert cfg.actor_rollout_ref.actor.tensor_model_parallel_size == 2
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 4
    for fc in _fsdp_cfgs(cfg):  # actor, ref and critic
        assert (fc.sharding_strategy, fc.mixed_precision, fc.param_offload, fc.reshard_after_forward) == (
            "SHARD_GRAD_OP", "bf16", True, False)
    he = cfg.actor_rollout_ref.hybrid_engine
    assert (he.enable_resharding_opt, he.resharding_overlap_with_compute, he.resharding_buffer_percent) == (False, True, None)

    # fsdp_enabled: false = replicated, whatever sharding_strategy says; mixed precision spellings
    for mp, want in [(False, None), ("fp16", "fp16"), ("bf16", "bf16")]:
        p = ParallelConfig(fsdp_enabled=False, fsdp_config=ParallelFSDPConfig(mixed_precision=mp))
        cfg = apply_parallel_config(HybridFlowConfig(), p)
        assert all(fc.sharding_strategy == "NO_SHARD" and fc.mixed_precision == want for fc in _fsdp_cfgs(cfg))
    with pytest.raises(ConfigError, match="mixed_precision"):
        apply_parallel_config(HybridFlowConfig(), ParallelConfig(fsdp_config=ParallelFSDPConfig(mixed_precision="fp8")))
    with pytest.raises(ConfigError, match="sharding_strategy"):
        apply_parallel_config(HybridFlowConfig(), ParallelConfig(fsdp_config=ParallelFSDPConfig(sharding_strategy="HYBRID")))


def test_a_parallel_file_sets_only_the_keys_it_contains(tmp_path):
    """A file naming only model_parallel_size leaves everything else in the run config as written
    (it used to reset a YAML's mixed_precision: bf16 to fp32)."""
    run = _write(tmp_path, """
trainer:
  n_gpus_per_node: 4
actor_rollout_ref:
  actor:
    fsdp_config:
      mixed_precision: bf16
      sharding_strategy: SHARD_GRAD_OP
  hybrid_engine:
    enable_resharding_opt: false
""", "run.yaml")
    base = load_config(run)
    cfg = apply_parallel_config(base, load_parallel_config(_write(tmp_path, "model_parallel_size: 2\n")))
    a = cfg.actor_rollout_ref.actor
    assert a.tensor_model_parallel_size == 2 and cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert (a.fsdp_config.mixed_precision, a.fsdp_config.sharding_strategy) == ("bf16", "SHARD_GRAD_OP")
    assert cfg.actor_rollout_ref.hybrid_engine.enable_resharding_opt is False
    # everything but the two TP sizes is as the YAML wrote it
    a.tensor_model_parallel_size = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size = 1
    assert cfg == base


def test_parallel_config_as_a_dict_a_path_or_a_dataclass(tmp_path):
    from hybridflow.config.parallel import as_parallel_config

    f = _write(tmp_path, "model_parallel_size: 2\nfsdp_config:\n  mixed_precision: bf16\n")
    want = ParallelConfig(model_parallel_size=2, fsdp_config=ParallelFSDPConfig(mixed_precision="bf16"))
    assert as_parallel_config(f) == as_parallel_config({"model_parallel_size": 2, "fsdp_config": {"mixed_precision": "bf16"}}) == want
    assert as_parallel_config(want) is want
    with pytest.raises(ConfigError, match=r"parallel_config: unknown config key 'model_paralel_size'; did you mean 'model_parallel_size'"):
        as_parallel_config({"model_paralel_size": 2})
    with pytest.raises(ConfigError, match="parallel_config must be a file path, a dict or a ParallelConfig"):
        as_parallel_config(2)


def test_pipeline_and_tensor_parallel_map_to_the_actor():
    cfg = apply_parallel_config(load_config(None, ["trainer.n_gpus_per_node=8"]), ParallelConfig(pipeline_parallel_size=2, model_parallel_size=2,
                                                                                                 generation_tensor_parallel_size=4))
    a = cfg.actor_rollout_ref.actor
    assert (a.pipeline_model_parallel_size, a.tensor_model_parallel_size, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size) == (2, 2, 4)
    with pytest.raises(ConfigError, match="pipeline_parallel_size must be a positive integer"):
        apply_parallel_config(HybridFlowConfig(), ParallelConfig(pipeline_parallel_size=0))


def test_data_parallel_size_must_match_world_size():
    with pytest.raises(ConfigError, match=r"1 x 1 x 4 = 4 does not match .* = 2.*trainer\.n_gpus_per_node"):
        apply_parallel_config(HybridFlowConfig(), ParallelConfig(data_parallel_size=4))  # default 1 node x 2
    with pytest.raises(ConfigError, match=r"2 x 2 x 2 = 8 does not match .* = 4.*data_parallel_size: 1"):
        apply_parallel_config(load_config(None, ["trainer.n_gpus_per_node=4"]), ParallelConfig(2, 2, 2))
    cfg = apply_parallel_config(load_config(None, ["trainer.n_gpus_per_node=4"]), ParallelConfig(data_parallel_size=4))
    assert cfg.trainer.n_gpus_per_node == 4


def test_unknown_key_suggests_closest(tmp_path):
    f = _write(tmp_path, "model_paralel_size: 2\n")
    with pytest.raises(ConfigError, match=r"parallel\.yaml.*unknown config key 'model_paralel_size'; did you mean 'model_parallel_size'"):
        load_parallel_config(f)
    f = _write(tmp_path, "fsdp_config:\n  sharding_strategie: NO_SHARD\n")
    with pytest.raises(ConfigError, match=r"did you mean 'fsdp_config\.sharding_strategy'"):
        load_parallel_config(f)


# ---------------------------------------------------------------- validation, kwargs, wiring
BUFFER_KEY = "actor_rollout_ref.hybrid_engine.resharding_buffer_percent"


def test_resharding_buffer_percent_validates_on_every_route_and_bad_values_name_the_key(tmp_path):
    """Every route that sets it -- the run config, a parallel config file or dict, the RLTrainer /
    PPOTrainer keyword -- lands in the run config and passes the validator when 0 < p <= 1 (its
    meaning, the staging budget, is tested in test_resharding_buffer.py); any other value is refused
    before any worker starts, naming the key and the range; unset (None) passes."""
    from hybridflow.trainer.ppo_trainer import PPOTrainer
    from hybridflow.trainer.rl import RLTrainer

    assert HybridFlowConfig().actor_rollout_ref.hybrid_engine.resharding_buffer_percent is None
    assert "resharding_buffer_percent" not in _problems(HybridFlowConfig())  # not set: no problem about it
    routes = {
        "run config": load_config(None, [f"{BUFFER_KEY}=0.1"]),
        "parallel file": apply_parallel_config(HybridFlowConfig(), load_parallel_config(_write(tmp_path, "resharding_buffer_percent: 0.1\n"))),
        "parallel dict": apply_parallel_config(HybridFlowConfig(), as_parallel_config({"resharding_buffer_percent": 0.5})),
        "keyword": apply_engine_kwargs(HybridFlowConfig(), resharding_buffer_percent=1),
    }
    for route, cfg in routes.items():
        assert cfg.actor_rollout_ref.hybrid_engine.resharding_buffer_percent in (0.1, 0.5, 1), route
        assert "resharding_buffer_percent" not in _problems(cfg), route  # other defaults (no model) are the problems
    bad = {
        "run config": load_config(None, [f"{BUFFER_KEY}=0"]),
        "parallel file": apply_parallel_config(HybridFlowConfig(), load_parallel_config(_write(tmp_path, "resharding_buffer_percent: 1.5\n"))),
        "parallel dict": apply_parallel_config(HybridFlowConfig(), as_parallel_config({"resharding_buffer_percent": -0.1})),
        "keyword (str)": apply_engine_kwargs(HybridFlowConfig(), resharding_buffer_percent="0.1"),
        "keyword (bool)": apply_engine_kwargs(HybridFlowConfig(), resharding_buffer_percent=True),
        "keyword (0.0)": apply_engine_kwargs(HybridFlowConfig(), resharding_buffer_percent=0.0),
    }
    for route, cfg in bad.items():
        value = cfg.actor_rollout_ref.hybrid_engine.resharding_buffer_percent
        assert f"{BUFFER_KEY} must be a fraction in (0, 1]" in _problems(cfg) and f"got {value!r}" in _problems(cfg), route
    for value, refused in ((0.1, False), (2.0, True)):
        for make in (lambda: RLTrainer(HybridFlowConfig(), resharding_buffer_percent=value),
                     lambda: RLTrainer(HybridFlowConfig(), parallel_config={"resharding_buffer_percent": value}),
                     lambda: PPOTrainer(actor_model="/nonexistent/model", resharding_buffer_percent=value)):
            with pytest.raises(ConfigError) as e:  # no model: refused for that in any case
                make()
            assert (f"{BUFFER_KEY} must be a fraction in (0, 1]" in str(e.value)) == refused, (value, str(e.value))


def test_engine_and_fsdp_enums_are_validated():
    cfg = HybridFlowConfig()
    cfg.actor_rollout_ref.hybrid_engine.granularity = "block"
    cfg.actor_rollout_ref.ref.fsdp_config.sharding_strategy = "HYBRID_SHARD"
    cfg.critic.fsdp_config.mixed_precision = "fp8"
    msg = _problems(cfg)
    assert "actor_rollout_ref.hybrid_engine.granularity must be one of ['layer', 'full'], got 'block'" in msg
    assert "actor_rollout_ref.ref.fsdp_config.sharding_strategy must be one of" in msg
    assert ("critic.fsdp_config.mixed_precision must be false (off), true or \"amp\" (the device's preferred low precision), "
            "bf16 or fp16, got 'fp8'") in msg
    assert "hybrid_engine." not in _problems(HybridFlowConfig())  # defaults are fine


# ---------------------------------------------------------------- mixed_precision: true / "amp"
def _gpu(monkeypatch, bf16: bool):
    """Pretend this process sees one CUDA GPU that does (A100) or does not (V100) compute bf16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "A100" if bf16 else "V100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


# spelling, device, GPU computes bf16 -> what the spec says it means
MIXED_PRECISION = [
    (None, "cpu", None, None), (False, "cpu", None, None), ("bf16", "cpu", None, "bf16"), ("bfloat16", "cuda", False, "bf16"),
    ("fp16", "cpu", None, "fp16"), ("float16", "cuda", True, "fp16"),
    (True, "cpu", None, "bf16"), ("amp", "cpu", None, "bf16"), ("AMP", "auto", None, "bf16"),  # auto without a GPU: the CPU
    (True, "cuda", True, "bf16"), ("amp", "cuda", False, "fp16"), ("amp", "auto", False, "fp16"), (True, "cuda:1", True, "bf16"),
]


@pytest.mark.parametrize("value, device, gpu_bf16, want", MIXED_PRECISION)
def test_mixed_precision_true_and_amp_mean_the_devices_preferred_low_precision(value, device, gpu_bf16, want, monkeypatch):
    from hybridflow.config.derive import resolve_mixed_precision

    if gpu_bf16 is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:
        _gpu(monkeypatch, gpu_bf16)
    assert resolve_mixed_precision(value, device, "k.mixed_precision") == want


def test_mixed_precision_is_refused_with_the_reason_where_it_has_no_meaning(monkeypatch, caplog):
    from hybridflow.config import derive

    with pytest.raises(ConfigError, match=r"x\.mixed_precision='amp' asks for the device's preferred low precision: .* known for cuda "
                                          r"and cpu, not 'mps'; set bf16 or fp16 \(or false\)"):
        derive.resolve_mixed_precision("amp", "mps", "x.mixed_precision")
    with pytest.raises(ConfigError, match=r"x\.mixed_precision must be false \(off\), true or \"amp\" .*got 'fp8'"):
        derive.resolve_mixed_precision("fp8", "cpu", "x.mixed_precision")
    # a CPU without bf16 units still computes bf16 (as mixed_precision: bf16 does), with a warning that it is slow there
    monkeypatch.setattr(derive, "_cpu_has_bf16_units", lambda: False)
    monkeypatch.setattr(derive, "_LOGGED", set())
    with caplog.at_level("INFO", logger="hybridflow"):
        assert derive.resolve_mixed_precision(True, "cpu") == "bf16"
    assert [r.levelname for r in caplog.records if "no bf16 units" in r.getMessage()] == ["WARNING"]


def test_mixed_precision_true_and_amp_in_the_run_config_and_the_parallel_file(tmp_path, monkeypatch, caplog):
    """The run config's YAML (true / amp / false on any fsdp_config), the parallel config file and
    dict: the same spellings, resolved for trainer.device before validation, logged once."""
    from hybridflow.config import derive
    from hybridflow.config.derive import derive_defaults

    monkeypatch.setattr(derive, "_LOGGED", set())
    run = _write(tmp_path, "trainer:\n  device: cpu\nactor_rollout_ref:\n  actor:\n    fsdp_config:\n      mixed_precision: true\n"
                           "  ref:\n    fsdp_config:\n      mixed_precision: amp\ncritic:\n  fsdp_config:\n    mixed_precision: false\n"
                           "reward_model:\n  fsdp_config:\n    mixed_precision: bfloat16\n", "run.yaml")
    cfg = load_config(run)
    assert cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision is True  # loaded as written
    with caplog.at_level("INFO", logger="hybridflow"):
        out = derive_defaults(derive_defaults(cfg))
    got = [fc.mixed_precision for fc in (*_fsdp_cfgs(out), out.reward_model.fsdp_config)]
    assert got == ["bf16", "bf16", None, "bf16"]
    assert out.actor_rollout_ref.generation_dtype() == "bfloat16"  # the rollout follows the actor's precision
    assert sum(r.getMessage().startswith("mixed_precision True on cpu: bf16") for r in caplog.records) == 1  # once, not per derivation
    assert "mixed_precision" not in _problems(cfg)  # the spellings validate as written too
    key = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
    assert [load_config(None, [f"{key}={v}"]).actor_rollout_ref.actor.fsdp_config.mixed_precision for v in ("true", "amp", "false")] == [True, "amp", False]
    with pytest.raises(ConfigError, match=key):
        load_config(None, [f"{key}=3"])

    _gpu(monkeypatch, bf16=False)  # the same file on a GPU without bf16: fp16
    on_gpu = derive_defaults(load_config(run, ["trainer.device=cuda"]))
    assert [fc.mixed_precision for fc in _fsdp_cfgs(on_gpu)] == ["fp16", "fp16", None]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    for value in ("true", "amp", "AMP"):
        f = _write(tmp_path, f"fsdp_config:\n  mixed_precision: {value}\n")
        applied = apply_parallel_config(load_config(None, ["trainer.device=cpu"]), load_parallel_config(f))
        assert [fc.mixed_precision for fc in _fsdp_cfgs(applied)] == ["bf16"] * 3, value
    applied = apply_parallel_config(load_config(None, ["trainer.device=cpu"]), as_parallel_config({"fsdp_config": {"mixed_precision": "amp"}}))
    assert [fc.mixed_precision for fc in _fsdp_cfgs(applied)] == ["bf16"] * 3
    off = apply_parallel_config(load_config(None, ["actor_rollout_ref.actor.fsdp_config.mixed_precision=bf16"]),
                                as_parallel_config({"fsdp_config": {"mixed_precision": False}}))
    assert [fc.mixed_precision for fc in _fsdp_cfgs(off)] == [None] * 3  # false keeps meaning off


def test_engine_kwargs():
    cfg = apply_engine_kwargs(HybridFlowConfig(), enable_resharding_opt=False, resharding_overlap_with_compute=True, granularity="full")
    he = cfg.actor_rollout_ref.hybrid_engine
    assert (he.enable_resharding_opt, he.resharding_overlap_with_compute, he.resharding_buffer_percent, he.granularity) == (
        False, True, None, "full")
    with pytest.raises(TypeError, match=r"resharding_bufer.*enable_resharding_opt.*granularity"):
        apply_engine_kwargs(HybridFlowConfig(), resharding_bufer=0.2)


def test_trainer_applies_before_validation(tmp_path):
    from hybridflow.cli import main
    from hybridflow.trainer.rl import RLTrainer

    with pytest.raises(ConfigError, match="granularity must be one of"):
        RLTrainer(HybridFlowConfig(), granularity="block")
    with pytest.raises(TypeError, match="valid hybrid-engine keyword arguments"):
        RLTrainer(HybridFlowConfig(), granularty="full")
    f = _write(tmp_path, "data_parallel_size: 3\n")
    with pytest.raises(ConfigError, match="1 x 1 x 3 = 3 does not match"):
        RLTrainer(HybridFlowConfig(), parallel_config=f)
    with pytest.raises(SystemExit, match="config error: .*1 x 1 x 3 = 3 does not match"):
        main(["train", "--parallel-config", f])


# ---------------------------------------------------------------- FSDP2 strategies, for real
def _strategies_worker(rank: int, world: int, init_file: str, model_dir: str, out_dir: str):
    import torch.distributed as dist

    from hybridflow.config.schema import ModelConfig
    from hybridflow.parallel.fsdp import apply_fsdp2, make_mesh, shard_numel
    from hybridflow.models.hf import load_hf_model

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = make_mesh("cpu", world)
        res = {}
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            model = apply_fsdp2(load_hf_model(ModelConfig(path=model_dir), "cpu"), mesh, sharding_strategy=strategy)
            res[strategy] = shard_numel(model)
        # NO_SHARD trains: different data per rank, gradients all-reduced -> identical weights after a step
        torch.manual_seed(rank)
        model = apply_fsdp2(load_hf_model(ModelConfig(path=model_dir), "cpu"), mesh, sharding_strategy="NO_SHARD")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = torch.cat([p.to_local().detach().flatten().clone() for p in model.parameters()])
        ids = torch.randint(4, 99, (2, 8))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        after = torch.cat([p.to_local().detach().flatten() for p in model.parameters()])
        gathered = [torch.empty_like(after) for _ in range(world)]
        dist.all_gather(gathered, after)
        res["no_shard_changed"] = bool((after - before).abs().max() > 0)
        res["no_shard_ranks_equal"] = bool(all(torch.equal(g, gathered[0]) for g in gathered))
        # bf16 mixed precision: compute in bf16, parameters stay fp32
        model = apply_fsdp2(load_hf_model(ModelConfig(path=model_dir), "cpu"), mesh, mixed_precision="bf16")
        res["bf16_logits"] = str(model(input_ids=ids).logits.dtype)
        res["bf16_param"] = str(next(model.parameters()).dtype)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def test_sharding_strategies_two_ranks(tiny_model_dir, tmp_path):
    import torch.multiprocessing as mp

    init_file = os.path.join(tempfile.mkdtemp(dir=tmp_path), "pg")
    mp.spawn(_strategies_worker, args=(2, init_file, str(tiny_model_dir), str(tmp_path)), nprocs=2, join=True)
    res = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for r in res:
        local, total = r["NO_SHARD"]
        assert local == total  # replicated: every rank holds the whole model
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            local, total = r[strategy]
            assert abs(local - total / 2) < 0.02 * total  # ~half (dim-0 chunks of ceil(n/2))
        assert r["no_shard_changed"] and r["no_shard_ranks_equal"]
        assert (r["bf16_logits"], r["bf16_param"]) == ("torch.bfloat16", "torch.float32")
    assert sum(r["FULL_SHARD"][0] for r in res) == res[0]["FULL_SHARD"][1]  # the shards add up to the model
