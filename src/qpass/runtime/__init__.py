"""The core runtime: the engine protocols and qpass's built-in graph engines.

* :mod:`.engine`: ``RolloutEngine`` / ``LearnerEngine`` protocols and the name-keyed factory
  (``make_rollout_engine("qpass", ...)``);
* :mod:`.graph_engine`: the built-in implementations over the pass-rewritten graphs;
* :mod:`.rollout`, :mod:`.learner`, :mod:`.sync`, :mod:`.prefill`: the torch eager pieces they use.
"""

from qpass.runtime.engine import (
    LearnerEngine,
    RolloutEngine,
    ServedSite,
    as_learner_engine,
    as_rollout_engine,
    learner_engines,
    make_learner_engine,
    make_rollout_engine,
    register_learner_engine,
    register_rollout_engine,
    rollout_engines,
)
from qpass.runtime.graph_engine import GraphLearnerEngine, GraphRolloutEngine
from qpass.runtime.learner import TorchLearner
from qpass.runtime.prefill import step_prefill_args
from qpass.runtime.rollout import RolloutBatch, TorchRollout
from qpass.runtime.sync import SyncReport, sync_weights

__all__ = [
    "GraphLearnerEngine",
    "GraphRolloutEngine",
    "LearnerEngine",
    "RolloutBatch",
    "RolloutEngine",
    "ServedSite",
    "as_learner_engine",
    "as_rollout_engine",
    "SyncReport",
    "TorchLearner",
    "TorchRollout",
    "learner_engines",
    "make_learner_engine",
    "make_rollout_engine",
    "register_learner_engine",
    "register_rollout_engine",
    "rollout_engines",
    "step_prefill_args",
    "sync_weights",
]
