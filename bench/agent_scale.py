"""The rollout service under load: many concurrent agent sessions against the agent loops on the
driver (`managers` 0, the loop the trainer runs without rollout managers) and on 1, 2 and 4 rollout
managers (service/managers.py), all sending their requests to the same generation replicas
(real Ray actors: the HF backend on a tiny model, `--replicas` of them).

Modes, side by side in one run:
- ``function``: a black-box agent written with the `openai` client alone (bench/scale_agent.py:
  three chat turns per session) called in-process by the manager (or driver) per session;
- ``command``: the same agent as a process per session (`python bench/scale_agent.py`);
- ``tool``: the built-in tool loop (calculator tool, up to three model turns).
Columns: sessions, managers, model turns (requests answered), turns/s, p50 / p99 turn latency (a request's wait for its
completion), the driver's CPU seconds per turn (this process, all its threads: the Ray client's
included), the managers' CPU seconds per turn, errors (agents that raised or timed out).

Run:  .venv/bin/python bench/agent_scale.py [--modes function,command,tool] [--managers 0,1,2,4]
          [--sessions 1000] [--command-sessions 200] [--replicas 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS_YAML = """tools:
  - class_name: hybridflow.agent.tools.CalculatorTool
    config: {}
"""


def build(model_dir: str, replicas: int):
    """The replicas (a ReplicaSet over RolloutWorkers on the tiny model) and the rollout spec."""
    from hybridflow.config import load_config
    from hybridflow.controller.worker_group import ColocatedWorkerGroup, ResourcePool
    from hybridflow.run_plan import resolve
    from hybridflow.service.replicas import ReplicaSet
    from hybridflow.workers.rollout import RolloutWorker

    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir}", "data.max_prompt_length=256", "data.max_response_length=256",
                             "actor_rollout_ref.rollout.multi_turn.enable=true", "trainer.async_rollout=true",
                             "resource_pool.pools.actor_pool.workers_per_node=1", f"resource_pool.pools.rollout_pool.workers_per_node={replicas}",
                             "resource_pool.mapping.actor_rollout=actor_pool", "resource_pool.mapping.rollout=rollout_pool"])
    spec = resolve(cfg).rollout
    pool = ResourcePool(1, replicas, 0.25, name="bench_rollout")
    group = ColocatedWorkerGroup(pool, {"rollout": (RolloutWorker, {"spec": spec})}, name=f"bench_rollout_{os.getpid()}")
    group.role("rollout").init_model()
    return ReplicaSet(group, "rollout", 3, 600.0), group, pool


def run_row(mode: str, sessions: int, managers: int, replicas, model_dir: str, tools_yaml: str) -> dict:
    from transformers import AutoTokenizer

    from hybridflow.config.schema import AgentConfig, MultiTurnConfig
    from hybridflow.protocol import Batch, SamplingParams
    from hybridflow.service.agent_rollout import AgentRollout
    from hybridflow.service.managers import ManagerPool, ManagerSpec

    tok = AutoTokenizer.from_pretrained(model_dir)
    agent_cfg = {"function": AgentConfig(function=f"{HERE}/scale_agent.py:rollout", timeout_s=600.0),
                 "command": AgentConfig(command=f"{sys.executable} {HERE}/scale_agent.py", timeout_s=600.0),
                 "tool": AgentConfig()}[mode]
    mt = MultiTurnConfig(enable=True, max_assistant_turns=3, tool_config_path=tools_yaml if mode == "tool" else None)
    budget = 256 if mode != "tool" else 24  # agents: three 8-token turns and the messages between; the tool loop: turns of up to 24 tokens
    agent = AgentRollout(mt, budget, tok, agent_cfg, 256, "tiny")
    extra = {"agent_name": "tool_agent"} if mode == "tool" else {}
    prompts = Batch.from_dict(non_tensors={"raw_prompt": [[{"role": "user", "content": f"What is {i}*{i + 3}? Use the calculator."}]
                                                          for i in range(sessions)], "extra_info": [dict(extra) for _ in range(sessions)]})
    params = SamplingParams(max_new_tokens=budget if mode != "tool" else 8, seed=1)  # the tool loop: 8 tokens a turn, as the agents ask
    pool = None
    if managers:
        spec = ManagerSpec(mt, agent_cfg, budget, 256, model_dir, "tiny", "rollout", 600.0, SamplingParams(max_new_tokens=budget))
        pool = ManagerPool(spec, managers, replicas, 3, agent)  # started before the clock: a run starts them once
        before = sum(s["cpu_s"] for s in pool.stats())
    start, cpu = time.perf_counter(), time.process_time()
    try:
        out = agent.generate(replicas, prompts, params) if pool is None else pool.submit(prompts, params, 0).result()
        wall, driver_cpu = time.perf_counter() - start, time.process_time() - cpu
        manager_cpu = sum(s["cpu_s"] for s in pool.stats()) - before if pool is not None else 0.0
    finally:
        if pool is not None:
            pool.shutdown()
    m = out.meta["metrics"]
    turns = int(m["agent/requests"])  # requests answered (a session whose history was re-rendered differently opens a segment)
    errors = int(m.get("agent/agent_errors", 0) + m.get("agent/agent_timeouts", 0))
    return {"mode": mode, "sessions": sessions, "managers": managers, "turns": turns, "wall_s": round(wall, 2),
            "turns_per_s": round(turns / wall, 1), "p50_ms": round(1000 * m.get("agent/turn_latency_s/p50", float("nan")), 1),
            "p99_ms": round(1000 * m.get("agent/turn_latency_s/p99", float("nan")), 1),
            "driver_cpu_s_per_turn": driver_cpu / max(turns, 1), "manager_cpu_s_per_turn": manager_cpu / max(turns, 1), "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="function,command,tool")
    ap.add_argument("--managers", default="0,1,2,4")
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--command-sessions", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()

    from hybridflow.controller.worker_group import init_ray
    from hybridflow.models.tiny import make_tiny_model

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_ray(num_cpus=os.cpu_count())
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_model(os.path.join(tmp, "tiny"), hidden_size=64, intermediate_size=128))
        tools_yaml = os.path.join(tmp, "tools.yaml")
        with open(tools_yaml, "w") as f:
            f.write(TOOLS_YAML)
        replicas, group, pool = build(model_dir, args.replicas)
        try:
            run_row("tool", 8, 0, replicas, model_dir, tools_yaml)  # warm the replicas up (not a row)
            rows = []
            for mode in args.modes.split(","):
                n = args.command_sessions if mode == "command" else args.sessions
                for managers in (int(x) for x in args.managers.split(",")):
                    rows.append(run_row(mode, n, managers, replicas, model_dir, tools_yaml))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            group.shutdown()
            pool.release()
    print(f"replicas: {args.replicas} (HF backend, tiny model); cpus: {os.cpu_count()}")
    print("| mode | sessions | managers | turns | turns/s | p50 ms | p99 ms | driver CPU s / turn | managers' CPU s / turn | errors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['sessions']} | {r['managers']} | {r['turns']} | {r['turns_per_s']} | {r['p50_ms']} | {r['p99_ms']} | "
              f"{r['driver_cpu_s_per_turn']:.5f} | {r['manager_cpu_s_per_turn']:.5f} | {r['errors']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
