"""Per-module fallback when ``torch.export`` cannot capture part of a model.

If an export fails inside a submodule (data-dependent control flow in a MoE router, an op export
does not support, ...), the capture retries with that submodule made **opaque**: its forward runs
eagerly inside one ``qpass_opaque::run`` custom-op node whose inputs are the module's input tensor
and its parameters (so cloned learner/rollout graphs carry their own copies, the optimizer updates
them, and weight sync copies them). The linear layers inside an opaque module are not quantization
sites; they are reported with the export error as the reason, never silently skipped.

Supported opaque modules are residual-stream blocks: ``forward(hidden_states)`` returning a tensor
(or a tuple whose first element is a tensor) of the input's shape — checked eagerly before use.
Backward recomputes the module under autograd (parameters and input get gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import torch

from qpass.errors import CaptureError

log = logging.getLogger(__name__)

_MODULES: dict[str, tuple[torch.nn.Module, list[str]]] = {}


@dataclasses.dataclass(frozen=True)
class OpaqueModule:
    """A module captured as one opaque node, and why."""

    name: str
    reason: str


def _call(key: str, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    module, names = _MODULES[key]
    out = torch.func.functional_call(module, dict(zip(names, params)), (x,), strict=False)
    out = out[0] if isinstance(out, tuple) else out
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        raise CaptureError(f"opaque module {key.split(':', 1)[1]} must map hidden_states to the same shape; "
                           f"got {getattr(out, 'shape', type(out))} for input {tuple(x.shape)}")
    return out


@torch.library.custom_op("qpass_opaque::run", mutates_args=())
def opaque_run(x: torch.Tensor, params: list[torch.Tensor], key: str) -> torch.Tensor:
    """Run the registered module ``key`` eagerly on ``x`` with the given parameter tensors."""
    return _call(key, x, params).clone()


@opaque_run.register_fake
def _opaque_fake(x: torch.Tensor, params: list[torch.Tensor], key: str) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001
    x, params, key = inputs
    ctx.key = key
    ctx.save_for_backward(x, *params)


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001
    x, *params = ctx.saved_tensors
    with torch.enable_grad():
        xr = x.detach().requires_grad_(x.requires_grad)
        pr = [p.detach().requires_grad_(True) for p in params]
        out = _call(ctx.key, xr, pr)
        wrt = ([xr] if xr.requires_grad else []) + pr
        grads = torch.autograd.grad(out, wrt, grad, allow_unused=True)
    gx = grads[0] if xr.requires_grad else None
    gp = list(grads[1:] if xr.requires_grad else grads)
    return gx, gp, None


opaque_run.register_autograd(_backward, setup_context=_setup)


def find_culprit(exc: BaseException, model: torch.nn.Module, prefix: str = "") -> str | None:
    """Innermost submodule of ``model`` whose ``forward`` frame is on the exception's traceback."""
    names = {id(m): n for n, m in model.named_modules()}
    culprit = None
    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            obj = tb.tb_frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module) and id(obj) in names and names[id(obj)]:
                culprit = names[id(obj)]
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return prefix + culprit if culprit else None


@contextlib.contextmanager
def opaque_modules(model: torch.nn.Module, names: list[str]) -> Iterator[None]:
    """Within the block, the named submodules of ``model`` forward through ``qpass_opaque::run``."""
    saved: list[tuple[torch.nn.Module, Any]] = []
    try:
        for name in names:
            mod = model.get_submodule(name)
            pnames = [n for n, _ in mod.named_parameters()]
            key = f"{id(model)}:{name}"
            _MODULES[key] = (mod, pnames)

            def fwd(hidden_states: torch.Tensor, *args: Any, _mod: torch.nn.Module = mod, _key: str = key, **kwargs: Any) -> torch.Tensor:
                if args or kwargs:
                    raise CaptureError(f"opaque module {_key.split(':', 1)[1]} was called with extra arguments; only forward(hidden_states) is supported")
                return torch.ops.qpass_opaque.run(hidden_states, [p for _, p in _mod.named_parameters()], _key)

            saved.append((mod, mod.__dict__.get("forward")))
            mod.forward = fwd
        yield
    finally:
        for mod, old in saved:
            if old is None:
                del mod.forward
            else:
                mod.forward = old
