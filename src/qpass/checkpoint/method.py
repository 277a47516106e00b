"""The engine-neutral halves of the vLLM and SGLang linear methods (pure python, no engine import).

Both plugins subclass their engine's ``LinearMethodBase`` with the same fields and the same
``create_weights`` steps; the engine-specific parameter classes are passed in:

* :class:`LinearMethodFields` — the method's ``quant_config``, ``prefix``, ``act`` and ``rac``;
* :func:`register_linear_params` — the parameters of :mod:`qpass.checkpoint.params` as the
  engine's parameter classes, each loader wrapped by :func:`qpass.checkpoint.validate.checked_loader`;
* :func:`set_layer_sizes` — the size attributes the engines' linear layers read afterwards;
* :func:`row_parallel_rac_error` — the refusal of RAC on a row-parallel (K-split) layer;
* :func:`engine_importable` / :func:`register_plugin` — the plugins' availability probe and their
  never-raising entry-point registration.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from qpass.checkpoint.params import ParamSpec, make_tensor
from qpass.checkpoint.qconfig import METHOD_NAME
from qpass.checkpoint.validate import checked_loader


class LinearMethodFields:
    """Mixin (first base, before the engine's ``LinearMethodBase``): the fields of a qpass linear method.

    Attributes:
        quant_config: the engine's ``QpassNvfp4Config`` (its ``options`` a
            :class:`qpass.checkpoint.qconfig.QpassQuantOptions`).
        prefix: the layer's checkpoint site (``model.layers.0.self_attn.qkv_proj``).
        act: the activation mode (``options.act``).
        rac: the site's ``RACConfig`` or None (always None where ``uses_rac`` is False:
            activation-only methods).
    """

    uses_rac: ClassVar[bool] = True

    def __init__(self, quant_config: Any, prefix: str = "") -> None:
        self.quant_config = quant_config
        self.prefix = prefix
        self.act = quant_config.options.act
        self.rac = quant_config.options.rac_for(prefix, quant_config.packed_modules_mapping) if self.uses_rac else None


def register_linear_params(layer: torch.nn.Module, specs: Iterable[ParamSpec], param_classes: Mapping[str, type],
                           weight_loader: Any, *, scalar_to_array: bool = False) -> None:
    """Register each :class:`ParamSpec` on ``layer`` as ``param_classes[spec.kind]``.

    Each parameter starts as :func:`qpass.checkpoint.params.make_tensor` (scales: the NaN "never
    loaded" sentinel); its loader is ``weight_loader`` wrapped by ``checked_loader`` (dtype / shape
    refused naming the layer, every (parameter, shard) loaded recorded). ``ModelWeightParameter``
    kinds get their ``input_dim``/``output_dim``; with ``scalar_to_array`` (SGLang) a spec's
    ``scalar_to_array`` flag becomes the parameter's ``needs_scalar_to_array``.

    Raises:
        KeyError: a spec kind missing from ``param_classes``.
    """
    for p in specs:
        kw: dict[str, Any] = {"data": make_tensor(p), "weight_loader": checked_loader(layer, p.name, weight_loader)}
        if p.kind == "ModelWeightParameter":
            kw.update(input_dim=p.input_dim, output_dim=p.output_dim)
        param = param_classes[p.kind](**kw)
        if scalar_to_array and p.scalar_to_array:
            param.needs_scalar_to_array = True
        layer.register_parameter(p.name, param)


def set_layer_sizes(layer: torch.nn.Module, params_dtype: torch.dtype, input_size_per_partition: int,
                    output_partition_sizes: list[int]) -> None:
    """The size attributes the engines' linear layers read after ``create_weights``."""
    layer.params_dtype = params_dtype
    layer.input_size_per_partition = input_size_per_partition
    layer.output_size_per_partition = sum(output_partition_sizes)


def row_parallel_rac_error(prefix: str, input_size: int, input_size_per_partition: int,
                           error: type[Exception]) -> Exception:
    """The ``error`` to raise for residual compensation on a row-parallel layer (K split across TP
    ranks): RAC's channel ranking needs the whole K. The message names the layer and both sizes."""
    return error(
        f"{METHOD_NAME}: layer {prefix} is row-parallel (K split {input_size} -> {input_size_per_partition}) "
        "and has residual compensation, whose channel ranking needs the whole K; use TP=1 for it or drop RAC there"
    )


def engine_importable(module: str) -> bool:
    """True if ``module`` (an engine's quantization base module) imports here; any failure = False."""
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return False
    return True


def register_plugin(engine: str, available: Callable[[], bool], install: Callable[[], None], log: logging.Logger) -> bool:
    """Run an engine plugin's entry point: ``install()`` if ``available()`` (idempotent, never raises).

    Returns:
        True if installed; False if the engine is not installed or ``install`` raised (logged as a
        warning naming ``engine``: a plugin must never take the engine down at import).
    """
    if not available():
        return False
    try:
        install()
        return True
    except Exception as e:  # noqa: BLE001 - a plugin must never take the engine down at import
        log.warning("qpass: registering the %s %s quantization method failed: %r", METHOD_NAME, engine, e)
        return False


__all__ = ["LinearMethodFields", "engine_importable", "register_linear_params", "register_plugin", "row_parallel_rac_error",
           "set_layer_sizes"]
