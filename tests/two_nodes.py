"""Driver for tests/test_e2e_two_nodes.py: a Ray cluster of two nodes on this one machine
(`ray.cluster_utils.Cluster`: a head and a second raylet on loopback, each with its own custom
resource label), one RL run on it, printed as one JSON line. Run as a subprocess (the test's own
process holds the session's single-node cluster).

    python tests/two_nodes.py LAYOUT OUT_DIR MODEL_DIR TASK_DIR REWARD [--kill-at STEP]

LAYOUT split: PPO; the actor pool (2 ranks) on node a; critic and reference (one colocated worker)
and the async rollout (its own worker) on node b. spread: GRPO; the actor pool of 2 nodes x 1 rank, one on each.
--kill-at k: once step k is done, node b is removed (its raylet and worker processes killed).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import rl_overrides  # noqa: E402

LAYOUTS = {
    "split": ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "critic.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=true",
              "trainer.async_rollout=true",
              "resource_pool.pools.a_pool.workers_per_node=2", "resource_pool.pools.a_pool.resources.node_a=1",
              "resource_pool.pools.b_pool.workers_per_node=1", "resource_pool.pools.b_pool.resources.node_b=1",
              "resource_pool.mapping.actor_rollout=a_pool", "resource_pool.mapping.critic=b_pool",
              "resource_pool.pools.c_pool.workers_per_node=1", "resource_pool.pools.c_pool.resources.node_b=1",
              "resource_pool.mapping.ref=b_pool", "resource_pool.mapping.rollout=c_pool"],
    "spread": ["resource_pool.pools.a_pool.nnodes=2", "resource_pool.pools.a_pool.workers_per_node=1",
               "resource_pool.pools.a_pool.resources.trainer=1", "resource_pool.mapping.actor_rollout=a_pool"],
}


def main(argv: list[str]) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from hybridflow.config import HybridFlowConfig, load_config
    from hybridflow.trainer.rl import RLTrainer

    layout, out, model, task, reward = argv[:5]
    kill_at = int(argv[argv.index("--kill-at") + 1]) if "--kill-at" in argv else None
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 4, "trainer": 1}, "include_dashboard": False})
    node_b = cluster.add_node(num_cpus=2, resources={"node_b": 4, "trainer": 1})
    cluster.wait_for_nodes()
    cfg = load_config(None, rl_overrides(model, task, out, f"custom_reward_function.path={reward}", "trainer.total_training_steps=4",
                                         "trainer.save_freq=2", f"ray_init.address={cluster.address}", *LAYOUTS[layout]), schema=HybridFlowConfig)
    trainer = RLTrainer(cfg)
    result: dict = {"error": None, "kill_to_error_s": None}
    killed: list[float] = []

    def killer() -> None:
        while trainer.global_step < kill_at:
            time.sleep(0.05)
        pool = trainer.reward_fn.pool  # started by the first step's scoring (reward_model.num_workers: one per CPU up to 4)
        result["reward_worker_nodes"] = _actor_nodes(pool.actors) if pool is not None else []
        killed.append(time.time())
        cluster.remove_node(node_b, allow_graceful=False)

    try:
        trainer.init_workers()
        result["worker_nodes"] = {name: _actor_nodes(group.workers) for name, group in trainer.groups.items()}
        if kill_at is not None:
            threading.Thread(target=killer, daemon=True).start()
        fit = trainer.fit()
        result["history"] = [h for h in fit["history"] if h["step"] > 0]
        if not cfg.trainer.async_rollout:  # the colocated switch: its plan, and each rank's measured bytes of one more switch
            result["plan"] = trainer.actor.reshard_plan()
            result["received_per_rank"] = [r["bytes_received"] for r in trainer.actor.reshard()]
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        if killed:
            result["kill_to_error_s"] = time.time() - killed[0]
    finally:
        trainer.shutdown()
        ray.shutdown()  # the driver leaves before the nodes go
        cluster.shutdown()
    print("RESULT " + json.dumps(result, default=str), flush=True)


def _actor_nodes(actors) -> list[str]:
    """The Ray node each actor runs on (by its resource labels)."""
    import ray

    by_id = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    out = []
    for w in actors:
        node_id = ray.get(w.__ray_call__.remote(lambda self: __import__("ray").get_runtime_context().get_node_id()))
        out.append("a" if "node_a" in by_id[node_id] else "b")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
