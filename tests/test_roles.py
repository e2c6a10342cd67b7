"""The policy worker's parts: typed (ModelPart sets, what the trainer passes) or the role string."""

from __future__ import annotations

import pytest

from hybridflow.config import HybridFlowConfig
from hybridflow.config.schema import TrainerConfig
from hybridflow.config.pools import ModelPart
from hybridflow.run_plan import resolve
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker

A, R, F = ModelPart.ACTOR, ModelPart.ROLLOUT, ModelPart.REF
SPEC = resolve(HybridFlowConfig(trainer=TrainerConfig(n_gpus_per_node=1))).actor  # one rank: this process


@pytest.mark.parametrize("parts, text", [({A, R, F}, "actor_rollout_ref"), ({A, R}, "actor_rollout"), ({A, F}, "actor_ref"), ({A}, "actor"), ({F}, "ref")])
def test_typed_parts_and_role_strings_agree(parts, text):
    typed, named = ActorRolloutRefWorker(SPEC, frozenset(parts)), ActorRolloutRefWorker(SPEC, text)
    for w in (typed, named):
        assert (w.has_actor, w.has_rollout, w.has_ref) == (A in parts, R in parts, F in parts) and w.role == text


def test_a_worker_holds_the_actor_or_the_reference_alone():
    with pytest.raises(ValueError, match="holds the actor"):
        ActorRolloutRefWorker(SPEC, frozenset({R, F}))
    with pytest.raises(ValueError):
        ActorRolloutRefWorker(SPEC, "critic")
