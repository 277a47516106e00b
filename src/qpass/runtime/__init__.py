"""Torch eager backend: learner module, rollout generator, weight sync (reference kernels)."""

from qpass.runtime.learner import TorchLearner
from qpass.runtime.rollout import RolloutBatch, TorchRollout
from qpass.runtime.sync import SyncReport, sync_weights

__all__ = ["RolloutBatch", "SyncReport", "TorchLearner", "TorchRollout", "sync_weights"]
