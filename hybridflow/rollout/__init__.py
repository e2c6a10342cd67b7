"""Rollout backends behind one interface (`base.RolloutBackend`): HF generate and vLLM."""

from hybridflow.rollout.base import RolloutBackend, SamplingParams

__all__ = ["RolloutBackend", "SamplingParams"]
