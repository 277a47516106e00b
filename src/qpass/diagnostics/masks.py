"""Argument checks shared by the token-level diagnostics and the RL loss.

Every tensor of per-token values is ``[B, T]`` (responses x positions) with a token mask of the
same shape that is True (or 1) exactly on the *valid* tokens: sampled response tokens that enter
the loss. Prompt tokens, padding and loss-masked tokens (e.g. tool observations) are False.
Values at invalid positions are never read arithmetically (they are selected away with
``torch.where`` before any operation that could turn garbage into NaN), so callers may leave
anything there, including NaN or 1e9.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor, shape: torch.Size | tuple[int, ...], name: str = "mask") -> torch.Tensor:
    """Validate a token mask and return it as a bool tensor.

    Args:
        mask: bool, integer or floating tensor of ``shape``; non-bool masks must hold only 0 and 1.
        shape: the expected shape (that of the value tensors it masks).
        name: argument name used in error messages.
    Returns:
        bool tensor of ``shape`` (a view/copy on the same device).
    Raises:
        TypeError: ``mask`` is not a tensor.
        ValueError: wrong shape, or a non-bool mask with a value other than 0/1.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected {tuple(shape)}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{name} must be bool or 0/1, got dtype={mask.dtype}")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be bool or 0/1; found {mask[idx].item()!r} at index {idx}")
    return mask != 0


def check_token_tensor(x: torch.Tensor, name: str, shape: torch.Size | tuple[int, ...] | None = None) -> torch.Tensor:
    """Validate a floating ``[B, T]`` per-token tensor (log-probs, ratios).

    Args:
        x: floating tensor, 2-D.
        name: argument name used in error messages.
        shape: if given, the required shape.
    Returns:
        ``x`` unchanged.
    Raises:
        TypeError: not a tensor, or not a floating dtype.
        ValueError: not 2-D, or not ``shape``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype={x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, T] (2-D), got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(shape)}")
    return x


def broadcast_advantages(adv: torch.Tensor, shape: torch.Size | tuple[int, ...], name: str = "adv") -> torch.Tensor:
    """Expand per-response advantages to per-token ``[B, T]``.

    Accepts exactly ``[B]`` (one advantage per response), ``[B, 1]`` or ``[B, T]``. Any other shape
    raises rather than broadcasting silently (a ``[B]`` tensor against ``[B, T]`` would broadcast
    along the wrong axis when ``B == T``; a ``[B, 1] x [B]`` product gives ``[B, B]``).

    Returns:
        floating tensor of ``shape`` (an expanded view for ``[B]``/``[B, 1]``).
    Raises:
        TypeError: not a floating tensor.
        ValueError: any other shape.
    """
    if not isinstance(adv, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(adv).__name__}")
    if not adv.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype={adv.dtype}")
    b, t = shape
    if tuple(adv.shape) == (b,):
        return adv.unsqueeze(-1).expand(b, t)
    if tuple(adv.shape) == (b, 1):
        return adv.expand(b, t)
    if tuple(adv.shape) == (b, t):
        return adv
    raise ValueError(f"{name} must have shape [B]={(b,)}, [B, 1]={(b, 1)} or [B, T]={(b, t)}, got {tuple(adv.shape)}")
