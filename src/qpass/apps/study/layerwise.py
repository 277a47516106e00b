"""Layer-wise input mismatch for the QUADS study: asymmetric W4A16 QAT vs symmetric W4A4 QAT.

At every linear site two inputs are recorded on the same token sequences in the learner's scoring
graph and the rollout's step graph:

* ``pre``: the activation ``X`` handed to the projection before any activation quantization (what
  :func:`qpass.diagnostics.capture.capture_linear_inputs` records): ``X_roll - X_learn`` is the
  drift accumulated upstream (``eta`` in SPEC §2);
* ``eff``: the operand the GEMM actually multiplies: the learner's ``nvfp4_act_qdq`` output (or
  ``X`` without activation QDQ) and, for a rollout ``qpass::nvfp4_linear`` with quantized
  activations, ``DQ(Q_A(X))`` (+ the RAC compensation ``R_hat`` scattered to its channels, summed
  in float32) computed with the op's own reference semantics (:mod:`qpass.quant.linear`) over the
  rows of that very call (the dynamic global scale comes from the call's rows). ``X_eff,roll -
  X_eff,learn = eta + Delta X_q`` (asymmetric) or ``Q(X_roll) - Q(X_learn)`` (symmetric).

The rollout runs in two modes: **prefill** (the whole prompt + response in one step-graph call,
the brief's definition) and **decode** (the rows recorded while replaying the tokens one decode step
at a time: what the rollout computes when it samples).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from qpass.diagnostics.layerwise import SiteMismatch, layerwise_mismatch
from qpass.graph.opargs import op_args
from qpass.graph.qgraph import QGraph
from qpass.quant.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from qpass.quant.rac import rac_reference, scatter_gathered
from qpass.sampling import positions_from_mask

Acts = dict[str, tuple[torch.Tensor, torch.Tensor]]  # site -> (pre [B,T,K], eff [B,T,K])


def _ops() -> tuple[Any, Any, Any]:
    from qpass import ops  # noqa: F401 - registers qpass::nvfp4_linear
    from qpass.quant import qdq  # noqa: F401 - registers qpass::nvfp4_act_qdq

    from qpass.graph.qgraph import learner_linear_targets

    return ((torch.ops.aten.linear.default, *learner_linear_targets()), torch.ops.qpass.nvfp4_linear.default,
            torch.ops.qpass.nvfp4_act_qdq.default)


def effective_nvfp4_input(x: torch.Tensor, args: Mapping[str, Any]) -> torch.Tensor:
    """The GEMM operand of one ``qpass::nvfp4_linear`` call (reference semantics).

    Args:
        x: the op's input ``[..., K]`` (all rows of the call).
        args: the node's named arguments (:func:`qpass.graph.opargs.op_args`: ``site``, ``act``,
            ``rac_ratio``, ``rac_mode``, ``rac_selection``, ``rac_channels`` as a tensor or None).
    Returns:
        ``x`` itself for ``act='none'``; else ``DQ(Q_A(x))`` (bf16) or, with RAC,
        ``float32(DQ(Q_A(x))) + R_hat`` (dense float32); shape of ``x``.
    """
    from qpass.ops.calls import NVFP4LinearCall

    spec, rac = NVFP4LinearCall.decode(args)
    channels, site = args["rac_channels"], args["site"]
    if spec is None:
        return x
    x2 = x.reshape(-1, x.shape[-1])
    k = rac.num_channels(x2.shape[-1]) if rac is not None else 0
    if k > 0:
        res = rac_reference(x2, rac, spec, static_channels=channels, site=site, k=k)
        comp = res.comp.float() if res.gather_index is None else scatter_gathered(res.comp, res.gather_index, x2.shape[-1])
        eff = res.x_hat.float() + comp
    else:
        eff = nvfp4_dequantize(nvfp4_quantize(x2, spec=spec, name="activation", site=site), torch.bfloat16)
    return eff.reshape(x.shape)


class SiteRecorder(torch.fx.Interpreter):
    """Run a qpass graph and record ``(pre, eff)`` inputs of every linear site (first call per run).

    Values are detached clones on the graph's device: ``pre`` in the activation dtype, ``eff`` bf16
    or float32 (RAC).
    """

    def __init__(self, gm: torch.fx.GraphModule, sites: set[str] | None = None) -> None:
        super().__init__(gm)
        self.sites = sites
        self.acts: Acts = {}
        self._linear, self._nvfp4, self._act_qdq = _ops()
        self._qdq_in: dict[torch.fx.Node, torch.Tensor] = {}

    def _named(self, n: torch.fx.Node) -> dict[str, Any]:
        a = op_args(n)
        if isinstance(a["rac_channels"], torch.fx.Node):
            a["rac_channels"] = self.env[a["rac_channels"]]
        return a

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        if n.target == self._act_qdq:
            x = self.env[n.args[0]]
            out = super().run_node(n)
            self._qdq_in[n] = x  # the input may be freed before the linear runs
            return out
        sid = n.meta.get("qpass_linear_site")
        if sid is None or (n.target not in self._linear and n.target != self._nvfp4) or sid in self.acts:
            return super().run_node(n)
        if self.sites is not None and sid not in self.sites:
            return super().run_node(n)
        xn = n.args[0]
        if isinstance(xn, torch.fx.Node) and xn.target == self._act_qdq:
            pre, eff = self._qdq_in.pop(xn), self.env[xn]
        else:
            pre = self.env[xn]
            eff = effective_nvfp4_input(pre, self._named(n)) if n.target == self._nvfp4 else pre
        pre_c = pre.detach().clone()
        self.acts[sid] = (pre_c, pre_c if eff is pre else eff.detach().clone())
        return super().run_node(n)


@torch.no_grad()
def capture_scoring(learner: QGraph, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Acts:
    """``(pre, eff)`` per site of the learner's full-sequence forward, each ``[B, T, K]``."""
    rec = SiteRecorder(learner.gm)
    rec.run(input_ids, attention_mask.long(), positions_from_mask(attention_mask))
    return rec.acts


@torch.no_grad()
def capture_prefill(rollout: QGraph, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Acts:
    """``(pre, eff)`` per site of one step-graph call over the whole sequence (prefill mode).

    Args:
        rollout: step graph with static batch ``B`` and cache ``L >= T``.
        input_ids, attention_mask: int64 ``[B, T]`` (the sampled batch: prompts then responses).
    Raises:
        ValueError: batch differs from the graph's static batch or ``T > L``.
    """
    b, t = input_ids.shape
    bs, ml = int(rollout.captured.batch_size), int(rollout.captured.max_len)
    if b != bs or t > ml:
        raise ValueError(f"prefill capture needs batch {bs} and T <= {ml}, got [{b}, {t}]")
    from qpass.runtime.prefill import step_prefill_args

    rec = SiteRecorder(rollout.gm)
    rec.run(*step_prefill_args(input_ids, attention_mask, batch_size=bs, max_len=ml))
    return rec.acts


class DecodeRecorder:
    """A ``step_fn`` for :meth:`TorchRollout.replay` that records ``(pre, eff)`` of every call.

    After the replay, :meth:`assemble` concatenates the calls along the sequence axis: the prefill
    rows ``[B, P, K]`` then one ``[B, 1, K]`` per decode call -> ``[B, P + R - 1, K]``, aligned
    with the learner's positions ``0 .. P + R - 2`` (the last response token is never fed).
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.calls: list[Acts] = []

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        rec = SiteRecorder(self.gm)
        out = rec.run(*args)
        self.calls.append(rec.acts)
        return out  # Interpreter.run applies the graph's pytree output processing itself

    def assemble(self) -> Acts:
        if not self.calls:
            raise ValueError("DecodeRecorder.assemble: no call was recorded")
        return {s: (torch.cat([c[s][0] for c in self.calls], 1), torch.cat([c[s][1] for c in self.calls], 1))
                for s in self.calls[0]}


def scored_positions_mask(attention_mask: torch.Tensor, response_mask: torch.Tensor, prompt_len: int,
                          n_real: int) -> torch.Tensor:
    """bool ``[B, P + R - 1]``: positions whose logits score a valid response token of a real row.

    Position ``t`` (``P - 1 <= t < P + R - 1``) produces the distribution of response token
    ``t - P + 1``; it counts iff that token is valid. ``attention_mask`` is only used for its shape.
    """
    b, total = attention_mask.shape
    r = total - prompt_len
    m = torch.zeros(b, total - 1, dtype=torch.bool)
    m[:, prompt_len - 1:] = response_mask.cpu()[:, :r].bool()
    m[n_real:] = False
    return m


def _sliced(acts: Acts, width: int, which: int) -> dict[str, torch.Tensor]:
    return {s: v[which][:, :width] for s, v in acts.items()}


def compare(learner: Acts, rollout: Acts, mask: torch.Tensor) -> dict[str, dict[str, SiteMismatch]]:
    """Per site, ``{"pre": SiteMismatch, "eff": SiteMismatch}`` on the rows of ``mask`` [B, T'].

    Both captures are cut to ``T' = mask.shape[1]`` positions first.
    """
    width = mask.shape[1]
    out: dict[str, dict[str, SiteMismatch]] = {}
    for which, key in ((0, "pre"), (1, "eff")):
        mm = layerwise_mismatch(_sliced(learner, width, which), _sliced(rollout, width, which), mask, strict=True)
        for site, v in mm.items():
            out.setdefault(site, {})[key] = v
    return out


def summarize(per_site: dict[str, dict[str, SiteMismatch]]) -> dict[str, dict[str, float]]:
    """Mean / median / max over sites of the relative mismatch, for ``pre`` and ``eff``."""
    out = {}
    for key in ("pre", "eff"):
        rel = torch.tensor([v[key].rel for v in per_site.values()], dtype=torch.float64)
        out[key] = {"mean_rel": float(rel.mean()), "median_rel": float(rel.median()), "max_rel": float(rel.max()),
                    "sites": int(rel.numel())}
    return out


def per_site_table(per_site: dict[str, dict[str, SiteMismatch]]) -> dict[str, dict[str, float]]:
    """JSON form: ``{site: {"pre_rel", "pre_fro", "eff_rel", "eff_fro", "tokens"}}``."""
    return {s: {"pre_rel": v["pre"].rel, "pre_fro": v["pre"].fro, "eff_rel": v["eff"].rel, "eff_fro": v["eff"].fro,
                "tokens": v["pre"].n_tokens} for s, v in per_site.items()}

