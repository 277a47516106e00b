"""Ops declared once: one :class:`OpSchema` per qpass rollout op generates the custom op, its fake
kernel and its ``kernels`` table key.

A schema names the op, its flat argument list (what a ``torch.export`` graph node carries: tensors,
strings, floats; the graph format stays flat so saved and exported graphs keep working), the typed
call object its kernels receive, and the weight spec type that keys the kernel table::

    NVFP4_LINEAR = OpSchema(
        "qpass::nvfp4_linear",
        (Arg("x", "Tensor"), Arg("w_codes", "Tensor"), ..., Arg("rac_channels", "Tensor?")),
        call=NVFP4LinearCall, spec_type=NVFP4Spec, out_features="w_codes")
    NVFP4_LINEAR.define()            # torch.ops.qpass.nvfp4_linear + its fake

    @register_kernel(NVFP4_LINEAR, "triton")
    def nvfp4_linear_triton(call: NVFP4LinearCall) -> torch.Tensor: ...

At the op boundary the flat arguments become one typed call (``call.from_args(**named)``: specs,
``RACConfig``, derived sizes computed once); the kernel of the backend in effect
(:mod:`qpass.kernel_select`) receives that object and nothing else. A backend without a kernel for
the op is an error (:class:`qpass.tables.KernelMissingError`), never a silent fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from qpass.kernel_select import BACKEND, effective_backend
from qpass.tables import kernel, register

_NO_DEFAULT = object()


@dataclasses.dataclass(frozen=True)
class Arg:
    """One flat argument of an op schema.

    Attributes:
        name: argument name (the graph node's keyword, ``qpass.graph.opargs.op_args`` key).
        type: torch schema type: ``Tensor``, ``Tensor?``, ``str``, ``float``, ``bool``, ``int``.
        default: default value (schema-level; omitted when there is none).
    """

    name: str
    type: str
    default: Any = _NO_DEFAULT

    def schema(self) -> str:
        if self.default is _NO_DEFAULT:
            return f"{self.type} {self.name}"
        d = self.default
        text = "None" if d is None else (f'"{d}"' if isinstance(d, str) else repr(d))
        return f"{self.type} {self.name}={text}"


@dataclasses.dataclass(frozen=True)
class OpSchema:
    """A qpass rollout op, declared once.

    Attributes:
        name: ``qpass::<op>``.
        args: the flat arguments, in schema order.
        call: the typed call class; ``call.from_args(**named_args)`` builds it (validating and
            deriving what kernels need), ``call.to_args()`` gives the flat arguments back.
        spec_type: the weight spec type: the ``kernels`` table key is ``(name, spec_type, backend)``.
        out_features: the argument whose dim 0 is the output width N (the fake kernel's shape).
        doc: one-line description (the custom op's docstring).
        before_kernel: ``fn(call, kernel, backend)`` run by the op on every non-empty call before its
            kernel (``qpass::nvfp4_linear``: the input-amax tape of :mod:`qpass.quant.observe`, and the
            refusal of a static activation scale by a kernel that has none); None: nothing.
    """

    name: str
    args: tuple[Arg, ...]
    call: type
    spec_type: type
    out_features: str
    doc: str = ""
    before_kernel: Callable[[Any, Callable[[Any], torch.Tensor], str], None] | None = None

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    def schema_str(self) -> str:
        """The torch schema string ``(Tensor x, ...) -> Tensor``."""
        return "(" + ", ".join(a.schema() for a in self.args) + ") -> Tensor"

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``{name: value}`` of positional ``args`` and ``kwargs`` (defaults filled in).

        Raises:
            TypeError: too many / unknown / missing arguments (names the op).
        """
        names = self.arg_names
        if len(args) > len(names):
            raise TypeError(f"{self.name} takes {len(names)} arguments, got {len(args)}")
        out = dict(zip(names, args))
        for k, v in (kwargs or {}).items():
            if k not in names or k in out:
                raise TypeError(f"{self.name}: unexpected or repeated argument {k!r}")
            out[k] = v
        for a in self.args:
            if a.name not in out:
                if a.default is _NO_DEFAULT:
                    raise TypeError(f"{self.name}: missing argument {a.name!r}")
                out[a.name] = a.default
        return out

    def make_call(self, *args: Any, **kwargs: Any) -> Any:
        """The typed call of flat arguments (positional in schema order, or by name)."""
        return self.call.from_args(**self.bind(args, kwargs))

    def overload(self) -> Any:
        """``torch.ops.qpass.<op>.default`` (after :meth:`define`)."""
        ns, name = self.name.split("::")
        return getattr(getattr(torch.ops, ns), name).default

    def __call__(self, call: Any) -> torch.Tensor:
        """Run the op (through the dispatcher, so the custom op is what runs) on a typed call."""
        ns, name = self.name.split("::")
        return getattr(getattr(torch.ops, ns), name)(**call.to_args())

    def kernel_for(self, call: Any) -> Callable[[Any], torch.Tensor]:
        """The kernel of the backend in effect for ``call`` (Triton needs a GPU or the interpreter),
        after :attr:`before_kernel` accepted the call.

        Raises:
            KernelMissingError: the backend has no kernel for this op / weight spec (or, through
                :attr:`before_kernel`, none for what the call asks).
        """
        backend = effective_backend(BACKEND.get(), call.x.device)
        fn = kernel(self.name, call.weight_spec, backend)
        if self.before_kernel is not None:
            self.before_kernel(call, fn, backend)
        return fn

    def define(self) -> Any:
        """Register the custom op and its fake kernel (once per process; returns the ``CustomOpDef``).

        The op's implementation builds the typed call and runs :meth:`kernel_for`; an input without
        rows (an MoE expert no token was routed to) gives an empty output without any kernel.
        """
        names = self.arg_names
        n_out = names.index(self.out_features)

        def impl(*args: Any) -> torch.Tensor:
            call = self.call.from_args(**dict(zip(names, args)))
            x = call.x
            if x.numel() == 0:
                return x.new_zeros((*x.shape[:-1], args[n_out].shape[0]))
            return self.kernel_for(call)(call)

        impl.__doc__ = self.doc
        op = torch.library.custom_op(self.name, impl, mutates_args=(), schema=self.schema_str())

        @op.register_fake
        def _fake(*args: Any) -> torch.Tensor:
            x = args[0]
            return x.new_empty((*x.shape[:-1], args[n_out].shape[0]))

        return op


def register_kernel(op: OpSchema, backend: str) -> Callable[[Callable[[Any], torch.Tensor]], Callable[[Any], torch.Tensor]]:
    """Decorator: ``fn(call) -> Tensor`` is the ``backend`` kernel of ``op`` (for weight specs of
    ``op.spec_type``; shorthand for ``tables.register("kernels", ...)`` with the schema's key)."""
    return register("kernels", op.spec_type, op=op.name, backend=backend, claim=True)
