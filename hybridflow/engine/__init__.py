"""The training engine of a role (`TrainEngine`): its model in the training layout, forward /
backward / step, checkpoints, and the weight pieces the rollout needs."""

from hybridflow.engine.train_engine import TrainEngine

__all__ = ["TrainEngine"]
