"""What a rollout engine reports it serves: the quantized bytes of one site, read back from the engine."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ServedSite:
    """The quantized bytes a rollout engine serves for one linear site (read back from the engine).

    Attributes:
        site: module path, e.g. ``model.layers.0.self_attn.q_proj``.
        format: ``nvfp4`` | ``mxfp4`` | ``fp8`` | ``unquantized`` (an activation-only site, e.g.
            W16A4: the weight is served in the model dtype, only its input is quantized).
        codes: the weight codes as served: NVFP4/MXFP4 packed E2M1 uint8 ``[N, K/2]``; FP8
            ``float8_e4m3fn`` ``[N, K]``; ``unquantized``: the weight itself ``[N, K]`` in the served dtype.
        scales: block scales: NVFP4 ``float8_e4m3fn`` ``[N, K/16]``; MXFP4 E8M0 uint8 ``[N, K/32]``;
            FP8 float32 (shape by granularity); ``unquantized``: empty uint8 ``[N, 0]``.
        global_scale: NVFP4 float32 scalar ``S_dec`` (decode global scale); ``None`` otherwise.
        group: the fused group sharing one global scale (q/k/v, gate/up); the site itself if none.
    """

    site: str
    format: str
    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None = None
    group: str = ""
