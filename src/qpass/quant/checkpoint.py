"""``export`` table entries: checkpoint tensor names of a quantized weight, per spec type.

An entry maps the rollout constants of one site (``codes``, ``scales``, ``s_dec``, ``s_enc`` /
``data``, ``scale``) to checkpoint tensor names ``<site>.<suffix>``. NVFP4 uses the ``modelopt_fp4``
names (what SGLang/vLLM load)::

    <site>.weight               uint8 [N, K/2]          E2M1 codes, low nibble = even k
    <site>.weight_scale         float8_e4m3fn [N, K/16] block scales (linear layout)
    <site>.weight_scale_2       float32 []              S_dec (identical bits across a fused group)
    <site>.weight_global_scale  float32 []              S_enc (compressed-tensors convention)

FP8 uses ``weight`` / ``weight_scale_inv`` (DeepSeek block checkpoints), MXFP4 ``weight`` /
``weight_scale``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from qpass.formats.spec import FP8Spec, MXFP4Spec, NVFP4Spec
from qpass.tables import register


@dataclasses.dataclass(frozen=True)
class ExportFormat:
    """A checkpoint format for quantized weights.

    Attributes:
        name: format id (``modelopt_fp4`` ...).
        names: rollout constant name -> checkpoint tensor-name suffix.
    """

    name: str
    names: Mapping[str, str]

    def tensors(self, site: str, constants: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{<site>.<suffix>: tensor}`` for the constants present (contiguous)."""
        return {f"{site}.{suffix}": constants[c].contiguous() for c, suffix in self.names.items() if c in constants}


MODELOPT_FP4 = register("export", NVFP4Spec, claim=True)(ExportFormat(
    "modelopt_fp4", {"codes": "weight", "scales": "weight_scale", "s_dec": "weight_scale_2", "s_enc": "weight_global_scale"}))
register("export", FP8Spec)(ExportFormat("fp8_block", {"data": "weight", "scale": "weight_scale_inv"}))
register("export", MXFP4Spec)(ExportFormat("mxfp4", {"codes": "weight", "scales": "weight_scale"}))
