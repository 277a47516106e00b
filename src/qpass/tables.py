"""Spec tables: one spec, many lowerings (JAX-style rule tables keyed by spec *type*).

A rule is registered right next to its implementation with :func:`register`::

    @register("reference", NVFP4Spec)            # in qpass/quant/nvfp4.py
    def _nvfp4_reference(spec, x, *, amax=None, site=None, name=None): ...

    @register_kernel(NVFP4_LINEAR, "triton")      # in a backend (qpass.ops.schema.register_kernel)
    def nvfp4_linear_triton_op(call: NVFP4LinearCall) -> Tensor: ...

Tables (the API other modules use; keep it this small):

* ``reference``: ``fn(spec, x, *, amax=None, site=None, name=None) -> quantized tensor`` (the
  plain-torch quantizer; ``amax`` is the group amax for specs with ``has_global_scale``).
* ``learner_qdq``: :class:`LearnerQDQ` (the learner fake-quant op and how to call it).
* ``rollout_lower``: :class:`qpass.ops.RolloutLowering` per spec type (the op's schema, its weight
  constants; the op's typed call class turns weight/activation specs into its option arguments).
* ``kernels``: ``fn(call)`` (the op's typed call, :mod:`qpass.ops.calls`) keyed by ``(op, spec type,
  backend)`` = the op schema's key; the ``reference`` backend lives in :mod:`qpass.ops.linear`, other
  backends register when their module is imported. Op
  :data:`QUANTIZE_OP` holds a backend's quantizers (``fn(spec, x, ...)``, byte-identical to ``reference``).
* ``onnx``: the ONNX emitter per spec type (registered by ``qpass.backends.onnx``).
* ``export``: :class:`qpass.quant.checkpoint.ExportFormat` (checkpoint tensor names of a quantized
  weight's constants; NVFP4 weights are claimed, i.e. checked for completeness).

Lookups: :func:`entry` (table, spec), :func:`kernel` (op, spec, backend), :func:`reference_quantize`,
:func:`reference_qdq`. Completeness: :func:`missing_entries` (every spec a table *claims* has an
entry) and :func:`unknown_ops` (every op a table can emit is known to the graph verifier).
Validation: :func:`check_kernels` raises :class:`KernelMissingError` naming op, spec and backend.

This module imports no implementation at import time (it is imported by them); :func:`load_core`
imports the core modules that register entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from qpass.errors import QpassError
from qpass.formats.spec import ALL_SPECS, QuantSpec

TABLE_NAMES = ("reference", "learner_qdq", "rollout_lower", "kernels", "onnx", "export")

# table -> key -> entry. Key: spec type; for ``kernels``: (op, spec type, backend).
TABLES: dict[str, dict[Any, Any]] = {t: {} for t in TABLE_NAMES}

# table -> spec keys the table claims to cover (completeness is checked against these).
CLAIMS: dict[str, set[str]] = {
    "reference": {s.key for s in ALL_SPECS},
    "learner_qdq": {s.key for s in ALL_SPECS},
    "rollout_lower": {s.key for s in ALL_SPECS},
    "onnx": set(),  # claimed by qpass.backends.onnx when imported
    "export": set(),  # claimed next to the export entries
}
# backend -> {(op, spec key)} it claims to implement; ``reference`` claims every weight lowering.
KERNEL_CLAIMS: dict[str, set[tuple[str, str]]] = {"reference": set()}

QUANTIZE_OP = "quantize"  # ``kernels`` entries ``fn(spec, x, ...)``: a backend's quantizer per spec type

_CORE_MODULES = ("qpass.quant.nvfp4", "qpass.quant.mxfp4", "qpass.quant.fp8", "qpass.quant.qdq",
                 "qpass.quant.checkpoint", "qpass.ops")


class KernelMissingError(QpassError):
    """No kernel for ``(op, spec, backend)``: raised at recipe validation, never a silent fallback."""


@dataclasses.dataclass(frozen=True)
class LearnerQDQ:
    """How the learner fake-quantizes one spec (the rule ``weight_qdq`` / ``act_qdq`` look up).

    Attributes:
        ops: role -> the custom op: ``linear`` (what ``weight_qdq`` puts in place of a linear: the
            weight-QDQ linear, factored for NVFP4, SPEC §3.1), ``activation`` (what ``act_qdq``
            puts in front of one), ``weight`` (the dense ``W_hat`` QDQ, for consumers that need one).
        fn: ``fn(spec, x, amax=None, site="") -> x_hat`` (same dtype as ``x``, STE backward).
        linear_args: ``(spec, x, w, amax, bias, site) -> op arguments`` of the ``linear`` op
            (``amax`` is the group amax node for specs with a global scale, else None).
        act_args: ``(spec, x, site) -> op arguments`` of the ``activation`` op.
    """

    ops: Mapping[str, str]
    fn: Callable[..., torch.Tensor]
    linear_args: Callable[..., tuple] | None = None
    act_args: Callable[..., tuple] | None = None

    def __call__(self, spec: QuantSpec, x: torch.Tensor, amax: torch.Tensor | None = None, site: str = "") -> torch.Tensor:
        return self.fn(spec, x, amax, site)

    def overload(self, role: str) -> Any:
        """``torch.ops.qpass.<op>.default`` of ``role`` (``linear`` / ``activation`` / ``weight``)."""
        ns, name = self.ops[role].split("::")
        return getattr(getattr(torch.ops, ns), name).default


def register(table: str, spec_type: type, *, op: str | None = None, backend: str | None = None,
             claim: bool = False) -> Callable[[Any], Any]:
    """Decorator: put ``obj`` in ``TABLES[table][spec_type]`` (``kernels``: key ``(op, spec_type, backend)``).

    Args:
        table: one of :data:`TABLE_NAMES`.
        spec_type: a spec class (``NVFP4Spec``, ``MXFP4Spec``, ``FP8Spec``).
        op, backend: required for ``kernels`` only (op as ``qpass::name``).
        claim: ``kernels``: the backend claims every canonical spec of ``spec_type`` the op lowers
            (completeness is then checked); other tables: claim every canonical spec of the type.
    Raises:
        KeyError: unknown table, or ``kernels`` without op/backend.
    """
    if table not in TABLES:
        raise KeyError(f"unknown spec table {table!r}; tables: {list(TABLES)}")
    if (table == "kernels") != (op is not None and backend is not None):
        raise KeyError(f"table {table!r}: op and backend are {'required' if table == 'kernels' else 'only for kernels'}")

    def deco(obj: Any) -> Any:
        if table == "kernels":
            TABLES[table][(op, spec_type, backend)] = obj
            KERNEL_CLAIMS.setdefault(backend, set())
            if claim:  # linear ops are keyed by their weight spec; quantizers cover every spec
                KERNEL_CLAIMS[backend] |= {(op, s.key) for s in ALL_SPECS
                                           if isinstance(s, spec_type) and (op == QUANTIZE_OP or s.role == "weight")}
        else:
            TABLES[table][spec_type] = obj
            if claim:  # ``export``: weights only (activations are dynamic, never stored)
                CLAIMS[table] |= {s.key for s in ALL_SPECS if isinstance(s, spec_type) and (table != "export" or s.role == "weight")}
        return obj

    return deco


_LOADED = False


def load_core() -> None:
    """Import the core modules that register table entries (idempotent; never at import time)."""
    global _LOADED
    if _LOADED:
        return
    import importlib

    for m in _CORE_MODULES:
        importlib.import_module(m)
    _LOADED = True


def entry(table: str, spec: QuantSpec) -> Any:
    """The ``table`` rule for ``spec`` (looked up by its type).

    Raises:
        KeyError: no entry; names the table and the spec key.
    """
    load_core()
    try:
        return TABLES[table][type(spec)]
    except KeyError:
        raise KeyError(f"table {table!r} has no entry for spec {spec.key} ({type(spec).__name__})") from None


def kernel(op: str, spec: QuantSpec, backend: str) -> Callable[..., torch.Tensor]:
    """The ``backend`` kernel of ``op`` for weight spec ``spec``.

    Raises:
        KernelMissingError: names op, spec and backend and lists the backends that have it.
    """
    load_core()
    fn = TABLES["kernels"].get((op, type(spec), backend))
    if fn is None:
        raise KernelMissingError(
            f"no {backend!r} kernel for {op} with weight spec {spec.key}; backends with it: {kernel_backends(op)}"
        )
    return fn


def kernel_backends(op: str) -> list[str]:
    """Backends with a kernel for ``op`` (any spec), sorted."""
    return sorted({b for (o, _, b) in TABLES["kernels"] if o == op})


def reference_quantize(spec: QuantSpec, x: torch.Tensor, amax: torch.Tensor | None = None, site: str | None = None,
                       name: str | None = None) -> Any:
    """``reference`` quantizer of ``spec`` applied to ``x`` (``amax`` only for specs with a global scale)."""
    return entry("reference", spec)(spec, x, amax=amax, site=site, name=name)


def backend_quantize(spec: QuantSpec, x: torch.Tensor, amax: torch.Tensor | None = None, site: str | None = None,
                     name: str | None = None) -> Any:
    """``spec``'s quantizer on the kernel backend in effect (:func:`qpass.ops.use_kernels`) for ``x``'s device.

    The backend's ``kernels`` entry of op :data:`QUANTIZE_OP` for ``type(spec)`` runs where the backend
    has one and it runs on ``x.device`` (:func:`qpass.kernel_select.effective_backend`: Triton on CUDA, or
    anywhere under ``TRITON_INTERPRET=1``) and ``spec`` uses the ``te_reference`` arithmetic (the only
    one the Triton NVFP4 kernels implement); otherwise the ``reference`` entry. Those entries are
    byte-identical to ``reference`` by contract (each backend's selfcheck compares them), so callers
    get the same bits either way; the learner's weight QDQ and the GRPO weight sync use it (issue 13:
    the reference quantizer's many small launches dominated a GPU GRPO step).

    Args / returns / raises: as :func:`reference_quantize` (``amax`` is passed to the backend only for
    specs with a global scale).
    """
    from qpass.kernel_select import current_backend, effective_backend

    backend = effective_backend(current_backend(), x.device)
    if backend != "reference" and getattr(spec, "arithmetic", "te_reference") == "te_reference":
        load_core()
        fn = TABLES["kernels"].get((QUANTIZE_OP, type(spec), backend))
        if fn is not None:
            if getattr(spec, "has_global_scale", False):
                return fn(spec, x, amax, site=site, name=name)
            return fn(spec, x, site=site, name=name)
    return reference_quantize(spec, x, amax, site=site, name=name)


def reference_qdq(spec: QuantSpec | str, x: torch.Tensor, amax: torch.Tensor | None = None, site: str | None = None) -> torch.Tensor:
    """``dequantize(reference(spec)(x))`` in ``x.dtype`` (``spec`` may be a canonical key)."""
    if isinstance(spec, str):
        from qpass.formats.spec import spec_by_key

        spec = spec_by_key(spec)
    return reference_quantize(spec, x, amax, site).dequantize(x.dtype)


# ------------------------------------------------------------------------------- completeness
def missing_entries(tables: dict[str, dict[Any, Any]] | None = None) -> dict[str, list[str]]:
    """For each table, what it claims but lacks: spec keys, or ``op/spec key/backend`` for kernels.

    ``tables`` defaults to :data:`TABLES` (pass a modified copy to test the checker itself).
    """
    load_core()
    t = TABLES if tables is None else tables
    by_key = {s.key: s for s in ALL_SPECS}
    out = {name: sorted(k for k in CLAIMS.get(name, ()) if type(by_key[k]) not in t[name])
           for name in TABLE_NAMES if name != "kernels"}
    missing_k = []
    claims = {b: set(c) for b, c in KERNEL_CLAIMS.items()}
    for s in ALL_SPECS:  # the reference backend must run every op rollout_lower emits
        lo = t["rollout_lower"].get(type(s))
        if s.role == "weight" and lo is not None and hasattr(lo, "constants"):
            claims["reference"].add((lo.op, s.key))
    for backend, pairs in sorted(claims.items()):
        for op, key in sorted(pairs):
            if (op, type(by_key[key]), backend) not in t["kernels"]:
                missing_k.append(f"{op}/{key}/{backend}")
    out["kernels"] = missing_k
    return out


def emitted_ops(tables: dict[str, dict[Any, Any]] | None = None) -> set[str]:
    """Every op name a table entry can put into a graph (learner QDQ ops and rollout ops)."""
    load_core()
    t = TABLES if tables is None else tables
    ops = {op for e in t["learner_qdq"].values() for op in e.ops.values()} | {e.op for e in t["rollout_lower"].values()}
    return ops | {op for (op, _, _) in t["kernels"] if op != QUANTIZE_OP}


def unknown_ops(known: Iterable[str], tables: dict[str, dict[Any, Any]] | None = None) -> list[str]:
    """Ops some table can emit that are not in ``known`` (the verifier's op lists)."""
    return sorted(emitted_ops(tables) - set(known))


def check_kernels(ops_and_specs: Iterable[tuple[str, QuantSpec, str]], backend: str) -> None:
    """Every ``(op, weight spec, site)`` has a ``backend`` kernel.

    Raises:
        KernelMissingError: the first missing one, naming op, spec, backend and site.
    """
    for op, spec, site in ops_and_specs:
        try:
            kernel(op, spec, backend)
        except KernelMissingError as exc:
            raise KernelMissingError(f"site {site}: {exc} (choose another kernel backend or recipe)") from None
