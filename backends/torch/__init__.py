"""Torch eager backend: learner module, rollout generator, weight sync (reference kernels)."""

from .learner import TorchLearner
from .rollout import RolloutBatch, TorchRollout
from .sync import SyncReport, sync_weights

__all__ = ["RolloutBatch", "SyncReport", "TorchLearner", "TorchRollout", "sync_weights"]
