"""The resumable prompt loader lives in `hybridflow/data/loader.py` (data sits below the trainer);
re-exported here for the trainer's modules."""

from hybridflow.data.loader import PromptLoader

__all__ = ["PromptLoader"]
