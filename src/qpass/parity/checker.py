"""Learner/rollout parity checker: structural and bit-level checks on two rewritten graphs.

* **structural**: every rollout site quantized with NVFP4 weights has a learner site whose graph
  runs its linear as ``qpass.nvfp4_qdq_linear`` with the same spec and the same fused group (read off
  the learner graph's ``group_amax`` inputs, not trusted from metadata); and the site-level dataflow
  of both graphs (which linear's output reaches which linear's input; built with networkx, KV-cache
  writes followed through the mutated buffer) is the same graph, matched by site id.
* **bit-level** (``weights_bitexact``): for every weight group, the learner's QDQ and the rollout's
  stored codes / scale bytes / global-scale bits are identical (SPEC §3 rule 4, canonicalised), and
  the two ops multiply the same operand ``B_W = e2m1 * s_b`` and scale by the same ``S_dec_W`` bits
  (SPEC §3.1: the learner op's operand vs the rollout's stored bytes, ``torch.equal``). On a
  mismatch the checker names the sites and counts and, when the rollout bytes follow another
  library's arithmetic, which one (:func:`qpass.parity.identify.identify`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import networkx as nx
import torch

from qpass.formats.spec import MXFP4Spec, NVFP4Spec, nvfp4_weight_spec
from qpass.graph.opargs import op_args
from qpass.graph.qgraph import QGraph
from qpass.graph.sites import LINEAR_TARGETS
from qpass.quant.qdq import learner_dense_operand, learner_weight_operand
from qpass.quant.nvfp4 import NVFP4Tensor, nvfp4_operand, nvfp4_quantize
from qpass.parity.object import ParityDiff, compare_parity, parity_object, parity_object_from_parts
from qpass.progress import track

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StructuralReport:
    """Result of :func:`check_structural`."""

    ok: bool
    problems: list[str]
    rollout_quantized: int
    learner_qdq: int
    matched: int
    topology_ok: bool
    topology_diff: dict[str, list[str]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GroupParity:
    """Bit-level comparison of one fused weight group."""

    group: str
    sites: list[str]
    diffs: list[ParityDiff]
    dequant_equal: bool
    divergence: str | None = None
    operand_notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.dequant_equal and all(d.ok for d in self.diffs)

    def to_json(self) -> dict[str, Any]:
        return {
            "group": self.group, "ok": self.ok, "dequant_equal": self.dequant_equal, "divergence": self.divergence,
            "operand_notes": self.operand_notes,
            "sites": {d.name: {"differing_codes": d.differing_codes, "differing_scales": d.differing_scales,
                               "global_differs": d.global_differs, "first_code": d.first_code,
                               "first_scale": d.first_scale, "total_codes": d.total_codes,
                               "total_scales": d.total_scales} for d in self.diffs},
        }


@dataclasses.dataclass
class BitexactReport:
    """Result of :func:`check_weights_bitexact`."""

    ok: bool
    groups: list[GroupParity]
    skipped: list[str]

    @property
    def mismatched_groups(self) -> list[str]:
        return [g.group for g in self.groups if not g.ok]

    def failures(self) -> list[str]:
        out = []
        for g in self.groups:
            for d in g.diffs:
                if not d.ok:
                    out.append(d.summary() + (f" [looks like {g.divergence}]" if g.divergence else ""))
            if not g.dequant_equal and all(d.ok for d in g.diffs):
                out.append(f"{g.group}: the learner op's (B_W, S_dec_W) != the rollout op's"
                           + (f" ({'; '.join(g.operand_notes[:2])})" if g.operand_notes else ""))
        return out


# ---------------------------------------------------------------------------------------------- structure
def _nvfp4_weight(spec: object) -> bool:
    """An NVFP4 weight spec of either arithmetic (``te_reference`` / ``modelopt``)."""
    return isinstance(spec, NVFP4Spec) and spec.role == "weight"


def _learner_qdq_sites(learner: QGraph) -> dict[str, dict[str, Any]]:
    """site -> {spec, group_members (weight attr paths)} read off the learner graph itself (its
    weight-QDQ linears: ``qpass::nvfp4_qdq_linear`` with the ``group_amax`` that feeds each, and
    ``qpass::qdq_linear`` of specs without a global scale, a group of one)."""
    from qpass.formats.spec import spec_by_key

    amax_op = torch.ops.qpass.group_amax.default
    out: dict[str, dict[str, Any]] = {}
    for n in learner.call_nodes(torch.ops.qpass.nvfp4_qdq_linear.default):
        site = n.meta.get("qpass_linear_site")
        wa = op_args(n)
        amax = wa["amax"]
        members = [str(m.target) for m in op_args(amax)["tensors"]] if getattr(amax, "target", None) == amax_op else []
        out[site] = {"spec": nvfp4_weight_spec(wa.get("arithmetic", "te_reference")), "members": sorted(members),
                     "weight": str(wa["w"].target), "site_arg": wa["site"]}
    for n in learner.call_nodes(torch.ops.qpass.qdq_linear.default):
        wa = op_args(n)
        out[n.meta.get("qpass_linear_site")] = {"spec": spec_by_key(wa["spec"]), "members": [str(wa["w"].target)],
                                               "weight": str(wa["w"].target), "site_arg": wa["site"]}
    return out


def _linear_op_name(spec: object) -> str:
    """The learner weight-QDQ linear of ``spec`` (``nvfp4_qdq_linear``, ``qdq_linear``) for messages."""
    from qpass.tables import entry

    return entry("learner_qdq", spec).ops["linear"].split("::")[-1]


_INPUT_ARG = {torch.ops.aten.linear.default: "input"}


def site_dataflow(qg: QGraph) -> nx.DiGraph:
    """Directed graph over linear sites: edge a -> b when a's output reaches b's input.

    Paths through non-linear nodes are followed; an in-place write into a buffer (KV cache) makes
    later readers of that buffer depend on what was written.
    """
    from qpass.graph.qgraph import learner_linear_targets, quantized_linear_targets

    lin_targets = set(LINEAR_TARGETS) | set(quantized_linear_targets()) | set(learner_linear_targets())
    up: dict[torch.fx.Node, frozenset[str]] = {}
    g = nx.DiGraph()
    for n in qg.gm.graph.nodes:
        deps: set[str] = set()
        for a in n.all_input_nodes:
            deps |= up.get(a, frozenset())
        sid = n.meta.get("qpass_linear_site") if n.op == "call_function" and n.target in lin_targets else None
        if sid is not None:
            g.add_node(sid)
            x = op_args(n)[_INPUT_ARG.get(n.target, "x")]
            for a in (x.all_input_nodes if isinstance(x, torch.fx.Node) and x.meta.get("qpass_act_site") else [x]):
                for d in up.get(a, frozenset()) if isinstance(a, torch.fx.Node) else ():
                    g.add_edge(d, sid)
            up[n] = frozenset({sid})
        else:
            up[n] = frozenset(deps)
        schema = getattr(n.target, "_schema", None)
        if schema is not None and n.args and isinstance(n.args[0], torch.fx.Node) and schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
            up[n.args[0]] = frozenset(up.get(n.args[0], frozenset()) | deps)
    return g


def check_structural(learner: QGraph, rollout: QGraph) -> StructuralReport:
    """Structural parity (see module docstring)."""
    problems: list[str] = []
    lsites = _learner_qdq_sites(learner)
    matched = 0
    rq = {s: r for s, r in rollout.quant.items() if r.lowered}
    for sid, rec in rq.items():
        ls = lsites.get(sid)
        if ls is None:
            problems.append(f"{sid}: rollout uses {rec.spec.key} weights but the learner graph has no "
                            f"{_linear_op_name(rec.spec)} on this site")
            continue
        if ls["site_arg"] != sid:
            problems.append(f"{sid}: learner qdq node carries site {ls['site_arg']!r}")
        if rec.spec != ls["spec"]:
            problems.append(f"{sid}: spec learner={ls['spec'].key} rollout={rec.spec.key}")
        r_members = sorted(rollout.sites[m].weight for m in rec.members)
        if r_members != ls["members"]:
            problems.append(f"{sid}: fused group differs: learner shares amax with {ls['members']}, rollout with {r_members}")
            continue
        matched += 1
    for sid in lsites:
        if sid not in rq:
            problems.append(f"{sid}: learner fake-quantizes this weight but the rollout does not run it quantized")
    gl, gr = site_dataflow(learner), site_dataflow(rollout)
    el, er = set(gl.edges), set(gr.edges)
    topo = {"only_learner": sorted(f"{a}->{b}" for a, b in el - er)[:20],
            "only_rollout": sorted(f"{a}->{b}" for a, b in er - el)[:20]}
    topology_ok = set(gl.nodes) == set(gr.nodes) and el == er
    if not topology_ok:
        problems.append(f"site dataflow differs: {len(el - er)} edges only in learner, {len(er - el)} only in rollout")
    return StructuralReport(not problems, problems, len(rq), len(lsites), matched, topology_ok, topo)


# ---------------------------------------------------------------------------------------------- bytes
def _divergence(codes: torch.Tensor, scales: torch.Tensor, s_dec: torch.Tensor, w: torch.Tensor, amax: torch.Tensor) -> str | None:
    try:
        from qpass.parity.identify import identify
    except ImportError:  # pragma: no cover
        return None
    try:
        res = identify(codes, scales, s_dec, w, global_is="decode", amax=amax)
    except Exception as exc:  # noqa: BLE001 - identification is best effort on top of a failure
        log.debug("identify failed: %s", exc)
        return None
    return ", ".join(res.matches) if res.matches else "no known convention"


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.float().view(torch.int32)


def _dense_site_parity(sid: str, w: torch.Tensor, lspec: Any, rollout: QGraph) -> GroupParity:
    """FP8 / MXFP4 site: the learner's quantization of the master weight vs the rollout's stored
    constants (every byte / scale bit) and the two ops' float32 weight operands (``torch.equal``)."""
    from qpass.quant.fp8 import FP8Tensor
    from qpass.quant.mxfp4 import MXFP4Tensor
    from qpass.tables import entry, reference_quantize

    rec = rollout.quant[sid]
    lo = entry("rollout_lower", rec.spec)
    theirs = {k: rollout.gm.get_buffer(a) for k, a in rec.constants.items()}
    notes: list[str] = []
    if lspec != rec.spec:
        notes.append(f"{sid}: learner spec {lspec.key} != rollout spec {rec.spec.key}")
    mine = lo.constants(reference_quantize(lspec, w, site=sid))
    (ck, code), (sk, scale) = list(mine.items())[:2]
    tc, ts = theirs[ck], theirs[sk]
    shape_differs = code.shape != tc.shape or scale.shape != ts.shape
    dc = 0 if shape_differs else int((_bits(code) != _bits(tc)).sum())
    dsc = 0 if shape_differs else int((_bits(scale) != _bits(ts)).sum())
    d = ParityDiff(sid, code.numel(), scale.numel(), dc, dsc, False, shape_differs)
    if isinstance(rec.spec, MXFP4Spec):
        roll_op = MXFP4Tensor(tc, ts, torch.Size((tc.shape[0], tc.shape[1] * 2)), torch.bfloat16).dequantize(torch.float32)
    else:
        roll_op = FP8Tensor(tc, ts, tc.shape, torch.bfloat16, rec.spec).dequantize(torch.float32)
    learn_op = learner_dense_operand(w, lspec.key, sid)
    same = not shape_differs and bool(torch.equal(learn_op, roll_op))
    if not same and not shape_differs:
        notes.append(f"{sid}: {int((learn_op != roll_op).sum())} of {learn_op.numel()} float32 weight operand values "
                     "differ between the learner op and the rollout op")
    return GroupParity(sid, [sid], [d], same and lspec == rec.spec, None, notes)


def _hex(t: torch.Tensor) -> str:
    return f"0x{int(t.float().reshape(()).view(torch.int32)) & 0xFFFFFFFF:08X}"


@torch.no_grad()
def check_weights_bitexact(learner: QGraph, rollout: QGraph, *, identify_divergence: bool = True) -> BitexactReport:
    """Bit-level parity of every quantized weight between learner and rollout (see module docstring):
    NVFP4 per fused group, FP8 / MXFP4 per site (bytes, scale bits and the float32 weight operands)."""
    lparams = dict(learner.gm.named_parameters(remove_duplicate=False))
    groups: dict[str, list[str]] = {}
    for sid, rec in rollout.quant.items():
        if rec.lowered:
            groups.setdefault(rec.group if _nvfp4_weight(rec.spec) else sid, []).append(sid)
    out, skipped = [], []
    for gid, sids in track(groups.items(), "bit-level weight parity", unit="group"):
        if any(s not in learner.quant or not learner.quant[s].weight_fake_quant for s in sids):
            skipped.append(gid)
            continue
        if not _nvfp4_weight(rollout.quant[sids[0]].spec):  # FP8 / MXFP4: one site, no global scale
            out.append(_dense_site_parity(sids[0], lparams[learner.quant[sids[0]].weight].detach(),
                                          learner.quant[sids[0]].spec, rollout))
            continue
        ws = [lparams[learner.quant[s].weight].detach() for s in sids]
        lmembers = learner.quant[sids[0]].members
        if sorted(lmembers) != sorted(sids):
            ws_all = [lparams[learner.sites[m].weight].detach() for m in lmembers]
        else:
            ws_all = ws
        amax = torch.ops.qpass.group_amax(ws_all)  # the op the learner graph runs
        diffs, deq_ok, div, operand_notes = [], True, None, []
        for sid, w in zip(sids, ws):
            c = rollout.quant[sid].constants
            codes, scales, s_dec = (rollout.gm.get_buffer(c[k]) for k in ("codes", "scales", "s_dec"))
            lspec = learner.quant[sid].spec  # the learner's arithmetic (structural parity checks it equals the rollout's)
            mine = parity_object(nvfp4_quantize(w, amax, spec=lspec, site=sid), sid)
            theirs = parity_object_from_parts(codes, scales, s_dec, sid)
            d = compare_parity(mine, theirs, sid)
            diffs.append(d)
            # what each side multiplies (SPEC §3.1): the learner op's operand B_W and epilogue scale
            # S_dec_W, and the rollout op's B_W of its stored bytes and its S_dec bits
            b_learn, s_learn = learner_weight_operand(w, amax, sid, lspec.arithmetic)
            b_roll = nvfp4_operand(NVFP4Tensor.from_parts(codes, scales, s_dec))
            same_b = bool(torch.equal(b_learn.float(), b_roll))
            same_s = bool(torch.equal(s_learn.reshape(()).view(torch.int32), s_dec.float().reshape(()).view(torch.int32)))
            if not same_b:
                operand_notes.append(f"{sid}: {int((b_learn.float() != b_roll).sum())} of {b_learn.numel()} operand values "
                                     "B = e2m1 * s_b differ between the learner op and the rollout op")
            if not same_s:
                operand_notes.append(f"{sid}: the learner op scales by S_dec bits {_hex(s_learn)}, the rollout op by "
                                     f"{_hex(s_dec)}")
            deq_ok &= same_b and same_s
            if (not d.ok) and identify_divergence and div is None:
                div = _divergence(codes, scales, s_dec, w, amax)
        out.append(GroupParity(gid, sids, diffs, deq_ok, div, operand_notes))
    return BitexactReport(all(g.ok for g in out) and bool(out), out, skipped)
