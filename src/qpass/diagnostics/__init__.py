"""Mismatch diagnostics (SPEC §4): log-prob mismatch metrics, clip-branch disagreement, update
visibility, layer-wise activation mismatch and the per-channel activation residual map."""

from qpass.diagnostics.layerwise import ChannelResidualMap, SiteMismatch, layerwise_mismatch, residual_channel_map
from qpass.diagnostics.metrics import (
    CLIPPED_HIGH,
    CLIPPED_LOW,
    UNCLIPPED,
    BranchDisagreement,
    MismatchMetrics,
    MismatchReduction,
    clip_branch_disagreement,
    mismatch_metrics,
    normalized_ess,
    ppo_clip_branch,
)
from qpass.diagnostics.visibility import GroupVisibility, UpdateVisibility, update_visibility, update_visibility_groups

__all__ = [
    "CLIPPED_HIGH",
    "CLIPPED_LOW",
    "UNCLIPPED",
    "BranchDisagreement",
    "ChannelResidualMap",
    "GroupVisibility",
    "MismatchMetrics",
    "MismatchReduction",
    "SiteMismatch",
    "UpdateVisibility",
    "clip_branch_disagreement",
    "layerwise_mismatch",
    "mismatch_metrics",
    "normalized_ess",
    "ppo_clip_branch",
    "residual_channel_map",
    "update_visibility",
    "update_visibility_groups",
]
