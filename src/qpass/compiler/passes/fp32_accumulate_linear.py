"""``fp32_accumulate_linear``: BF16-weight linears computed with the rollout op's arithmetic.

A *control*, not a quantization: weights and activations stay in the model dtype, but every targeted
linear multiplies float32 copies of its operands (exact for bf16/fp16 inputs), adds the bias in
float32 and rounds once to the activation dtype -- the arithmetic of the NVFP4 rollout op
(:func:`qpass.quant.linear.w4a16_linear_reference` without quantized weights). Paired with a BF16
learner it measures the engine-drift floor of the *kernels* alone (``qpass study``'s
``bf16_fp32acc`` rollout), separate from the decode-vs-prefill floor of the ``bf16`` recipe.

Before::

    y = aten.linear(x, w, b)                      # bf16 x bf16 -> bf16 (BLAS accumulation)

After (aten ops only, so the graph verifier, export and every runtime accept it)::

    xf = aten._to_copy(x, dtype=float32); wf = aten._to_copy(w, dtype=float32)
    acc = aten.matmul(xf, aten.t(wf))            # float32 product
    acc = aten.add(acc, aten._to_copy(b, dtype=float32))   # only with a bias
    y = aten._to_copy(acc, dtype=x.dtype)        # one rounding

The rewritten nodes carry ``meta["qpass_fp32_accumulate"] = site`` (and the site stamps), which the
``fp32_accumulate`` property checks.
"""

from __future__ import annotations

import torch

from qpass.compiler.properties import graph_property
from qpass.graph.qgraph import QGraph
from qpass.compiler.passes._common import aten_linear_nodes, bias_arg, copy_meta, selected
from qpass.compiler.manager import Cleanup, Pass, PassContext, PassOptions, Rewrites, register_pass

META_KEY = "qpass_fp32_accumulate"
_aten = torch.ops.aten


def fp32_accumulate_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Eager reference of the rewritten subgraph.

    Args:
        x: activations ``[..., K]`` (bf16/fp16/fp32). w: weight ``[N, K]``. bias: ``[N]`` or None.
    Returns:
        ``[..., N]`` in ``x.dtype``: ``(float32(x) @ float32(w).T + float32(bias))`` rounded once.
    """
    acc = x.float().matmul(w.float().t())
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


@graph_property("fp32_accumulate")
def _fp32_accumulate(qg: QGraph) -> list[str]:
    nodes = [n for n in qg.gm.graph.nodes if n.op == "call_function" and META_KEY in n.meta]
    if not nodes:
        return ["no fp32-accumulate linear (meta qpass_fp32_accumulate) in the graph"]
    bad = []
    for n in nodes:
        src = n.args[0] if n.args else None
        if isinstance(src, torch.fx.Node) and src.target == _aten.add.Tensor:
            src = src.args[0]
        if n.target != _aten._to_copy.default or not (isinstance(src, torch.fx.Node) and src.target == _aten.matmul.default):
            bad.append(f"{n.name} (site {n.meta[META_KEY]}): the stamped node is not the rounding of a float32 "
                       f"matmul back to the activation dtype")
    return bad


@register_pass
class FP32AccumulateLinear(Pass):
    """Rewrite targeted ``aten.linear`` nodes into a float32 product rounded once (see module docstring)."""

    name = "fp32_accumulate_linear"
    Options = PassOptions
    sides = ("rollout",)
    requires = ("sites_stamped",)
    ensures = ("fp32_accumulate",)
    mutation = "in_place"
    cleanup = Cleanup.TIDY  # the manager lints and recompiles after the rewrite

    def run(self, qg: QGraph, ctx: PassContext) -> Rewrites:
        sites, skipped = selected(qg, self.options)
        out = Rewrites(skipped=skipped)
        g = qg.gm.graph
        for s in sites:
            nodes = aten_linear_nodes(qg, s.id)
            if not nodes:
                out.skip(s.id, "no aten.linear node (lowered to a quantized op already)")
                continue
            for lin in nodes:
                x, w, b = lin.args[0], lin.args[1], bias_arg(lin)
                val = lin.meta.get("val")
                out_dtype = val.dtype if isinstance(val, torch.Tensor) else qg.gm.get_parameter(w.target).dtype
                with g.inserting_before(lin):
                    xf = g.call_function(_aten._to_copy.default, (x,), {"dtype": torch.float32})
                    wf = g.call_function(_aten._to_copy.default, (w,), {"dtype": torch.float32})
                    acc = g.call_function(_aten.matmul.default, (xf, g.call_function(_aten.t.default, (wf,))))
                    if b is not None:
                        acc = g.call_function(_aten.add.Tensor, (acc, g.call_function(
                            _aten._to_copy.default, (b,), {"dtype": torch.float32})))
                    y = g.call_function(_aten._to_copy.default, (acc,), {"dtype": out_dtype})
                copy_meta(lin, y, **{META_KEY: s.id})
                for n in (xf, wf, acc):
                    n.meta.update({k: lin.meta[k] for k in ("qpass_site", "nn_module_stack") if k in lin.meta})
                lin.replace_all_uses_with(y)
                g.erase_node(lin)
            out.rewrote(s.id)
        return out
