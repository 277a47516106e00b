"""The four phases of one GRPO step, each a unit with a typed input and output record.

:meth:`qpass.apps.grpo.grpo.GRPOTrainer.step` wires them::

    SampleInput --sample--> Sampled --score--> Scored --update--> Updated      sync(step, final) --> Synced

* :func:`sample`: the rollout engine samples ``group_size`` responses per prompt in chunks of its
  static batch (chunk ``c`` of step ``s`` seeded from ``(seed, s, c)`` only); MoE routes recorded;
  with a calibration the amax each static site saw (``calib/`` keys);
* :func:`score`: rewards and group advantages (:mod:`qpass.rl.rewards`), the loss mask
  (``mask_truncated``), proximal / reference log-probs with the update's micro-batches, SPEC §4 gap
  metrics of ``(p_prox, q)``, the correction's affected fraction, the BF16 shadow's ``q_bf16``;
* :func:`update`: :func:`qpass.rl.update.ppo_update` plus the clip-branch disagreement of
  ``p_theta / q`` vs ``p_theta / q_bf16``;
* :func:`sync`: export the master weights, re-quantize them into the rollout graph (and a live
  engine), verify (fingerprints every step, full bit-exact check on schedule, served bytes for an
  external learner), re-calibrate, and measure what the sync changed (``vis/`` keys).

Each function reads the trainer (typed as :class:`StepContext`) only for its engines, config and stores (``tr.ro``, ``tr.le``,
``tr.cfg``, ``tr.quant_reuse``, ...); its record holds every value the next phase needs, and its
``row`` the metric keys it contributes, in the order the step row lists them. The domain
arithmetic lives in :mod:`qpass.rl` (loss, advantages, corrections, the PPO loop) and
:mod:`qpass.diagnostics` (mismatch metrics, visibility).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from qpass.diagnostics import clip_branch_disagreement, mismatch_metrics, update_visibility_groups
from qpass.quant.reuse import reuse_weight_quantization
from qpass.rl.experience import Experience, assemble, decode_responses, micro_batches, response_logprobs
from qpass.rl.loss import correction_affected_frac
from qpass.rl.rewards import ScoredResponses, score_responses
from qpass.rl.update import UpdateSchedule, ppo_update
from qpass.rl.seeds import derive_seed
from qpass.apps.grpo.probes import score_sampled, shadow_weights
from qpass.apps.grpo.weights import byte_visibility, snapshot_rollout_constants, verify_sync

__all__ = ["SampleInput", "Sampled", "Scored", "StepContext", "Synced", "Updated", "route_scope", "sample", "score", "score_rows",
           "served_checks", "sync", "update"]

Routes = dict[str, torch.Tensor]  # MoE layer -> expert indices [N, T, k]


class StepContext(Protocol):
    """What the phases read of :class:`qpass.apps.grpo.grpo.GRPOTrainer` (its engines, config and stores)."""

    cfg: Any  # GRPOConfig
    ro: Any  # the rollout engine that samples (RolloutEngine)
    graph_ro: Any  # the built-in engine over the rollout graph (always synced)
    le: Any  # the learner engine (trained)
    ref: Any  # reference learner engine (beta > 0) or None
    shadow: Any  # BF16 shadow rollout engine or None
    opt: Any  # MasterOptimizer
    learner_qg: Any
    rollout_qg: Any
    tokenizer: Any
    reward: Any  # SafeReward
    answer_fn: Any
    quant_reuse: Any  # ReuseStore
    snapshot: Any  # RolloutConstants before this step's sync (the sync phase moves it)
    calibration: Any
    calib_amax: dict[str, torch.Tensor]
    micro: int
    pad: int
    eos_ids: list[int]
    route_diag: bool
    aligned: bool
    external: bool

    @property
    def device(self) -> torch.device: ...

    def encode(self, problems: Sequence[Any]) -> list[list[int]]: ...

    def recalibrate(self, masters: dict[str, torch.Tensor]) -> dict[str, Any]: ...


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class SampleInput:
    """What one step samples from.

    Attributes:
        step: the step number ``s`` (>= 1; seeds chunk ``c`` with ``(cfg.seed, s, c)``).
        prompts: token ids of each problem's chat prompt (one per problem).
        metas: each problem's ``.meta`` (what the reward reads), aligned with ``prompts``.
    """

    step: int
    prompts: Sequence[list[int]]
    metas: Sequence[dict]

    @classmethod
    def of(cls, tr: StepContext, step: int, problems: Sequence[Any]) -> "SampleInput":
        """The problems' prompts encoded with the trainer's tokenizer and template (cached by id)."""
        return cls(step, tr.encode(problems), [p.meta for p in problems])


@dataclasses.dataclass(frozen=True)
class Sampled:
    """Output of :func:`sample`.

    Attributes:
        step: the step number.
        exp: the ``N = len(prompts) * group_size`` sampled rows (group-major).
        metas: N problem metadata (each problem's repeated ``group_size`` times).
        routes: MoE routes the rollout took (None unless the trainer records them).
        wall_s: seconds the sampling took (after a CUDA synchronize).
        row: ``calib/...`` (with a calibration), ``time/rollout_s``, ``rollout/...``.
    """

    step: int
    exp: Experience
    metas: list[dict]
    routes: Routes | None
    wall_s: float
    row: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Scored:
    """Output of :func:`score`.

    Attributes:
        exp: the sampled rows with the loss mask in ``response_mask`` (``mask_truncated`` applied).
        responses: rewards, float64 advantages and correctness (:class:`qpass.rl.rewards.ScoredResponses`).
        adv: float32 [N] advantages on the rollout device.
        micro: the fixed micro-batches (int64 index blocks) of the proximal pass and the update.
        lprox: float32 [N, R] proximal log-probs; entropy: float32 [N, R] of its sampling distribution.
        lref: float32 [N, R] reference log-probs (None when ``beta == 0``).
        lshadow: float32 [N, R] the BF16 shadow engine's log-probs (None without a shadow).
        routes: the sampled MoE routes (the update replays them under ``routing_replay``).
        row: ``reward/``, ``adv/``, ``resp/``, ``time/prox_s``, ``routing/``, ``entropy/``, ``gap/``,
            ``corr/`` and shadow keys.
    """

    exp: Experience
    responses: ScoredResponses
    adv: torch.Tensor
    micro: list[torch.Tensor]
    lprox: torch.Tensor
    entropy: torch.Tensor
    lref: torch.Tensor | None
    lshadow: torch.Tensor | None
    routes: Routes | None
    row: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Updated:
    """Output of :func:`update`.

    Attributes:
        forwards: ``(row indices, detached log p_theta [n, R])`` of every update forward.
        row: ``loss/``, ``opt/``, ``check/first_minibatch_*`` and ``time/update_s``.
        clip_row: ``clip/...`` (with a shadow; else empty).
    """

    forwards: list[tuple[torch.Tensor, torch.Tensor]]
    row: dict[str, Any]
    clip_row: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Synced:
    """Output of :func:`sync`.

    Attributes:
        row: ``parity/...``, ``time/sync_s`` / ``verify_s`` (and engine / recalibration keys), ``vis/...``.
        failures: parity failures found (empty: every check passed); the trainer reports them after
            the row is written.
    """

    row: dict[str, Any]
    failures: list[str]


# --------------------------------------------------------------------------- sample


def sample(tr: StepContext, inp: SampleInput) -> Sampled:
    """Sample ``cfg.group_size`` responses per prompt with the trainer's rollout engine (module docstring)."""
    g = tr.cfg.group_size
    rows = [ids for ids in inp.prompts for _ in range(g)]
    metas = [m for m in inp.metas for _ in range(g)]
    row: dict[str, Any] = {}
    if tr.calibration is not None:
        from qpass.quant.observe import observe_input_amax

        with observe_input_amax() as tape:
            exp, routes, wall = _generate(tr, rows, inp.step)
        row.update(_staleness(tr, tape))
    else:
        exp, routes, wall = _generate(tr, rows, inp.step)
    n_sampled = int(exp.sampled_mask.sum())
    row.update({"time/rollout_s": wall, "rollout/n_tokens": n_sampled,
                "rollout/tokens_per_s": n_sampled / wall if wall > 0 else float("nan"),
                "rollout/decode_graph": getattr(getattr(tr.ro, "decode", None), "status", "n/a")})
    return Sampled(inp.step, exp, metas, routes, wall, row)


def _generate(tr: StepContext, rows: list[list[int]], step: int) -> tuple[Experience, Routes | None, float]:
    from qpass.moe.routing import assemble_routes, generate_routes, record_routes

    cfg, bs = tr.cfg, tr.ro.batch_size
    chunks, routes = [], []
    t0 = time.perf_counter()
    for c, start in enumerate(range(0, len(rows), bs)):
        with (record_routes() if tr.route_diag else contextlib.nullcontext()) as tape:
            b = tr.ro.generate(rows[start:start + bs], max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                               top_p=cfg.top_p, seed=derive_seed(cfg.seed, step, c))
        chunks.append(b)
        if tape is not None:
            routes.append(generate_routes(tape.records, batch_size=int(b.input_ids.shape[0]), prompt_len=int(b.prompt_len),
                                          seq_len=int(b.input_ids.shape[1])))
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    exp = assemble(chunks, pad_token_id=tr.pad, eos_token_ids=tr.eos_ids, max_new_tokens=cfg.max_new_tokens)
    asm = assemble_routes(routes, chunks, prompt_len=exp.prompt_len, width=exp.response_width) if tr.route_diag else None
    return exp, asm, wall


def _staleness(tr: StepContext, tape: Any) -> dict[str, Any]:
    """The ``calib/`` staleness keys of one sampling (:mod:`qpass.apps.grpo.grpo` docstring)."""
    from qpass.calibration.run import staleness

    st = staleness(tape.amax, tr.calib_amax)
    return {"calib/sites": st["sites"], "calib/amax_ratio_max": st["ratio_max"], "calib/amax_ratio_median": st["ratio_median"],
            "calib/amax_ratio_min": st["ratio_min"], "calib/sites_over": st["sites_over"], "calib/worst_site": st["worst_site"]}


# --------------------------------------------------------------------------- score


def route_scope(routes: Routes | None, replay: bool, idx: torch.Tensor, *, own: bool = False) -> Any:
    """The routing context of a learner forward over rows ``idx`` (MoE): the rollout's ``routes``
    replayed (``replay``), or with ``own`` the learner's own routes recorded; a null context
    otherwise (also whenever ``routes`` is None). The tape's ``records`` then hold the learner's own choices."""
    from qpass.moe.routing import record_routes, replay_routes

    if routes is None:
        return contextlib.nullcontext(None)
    if replay:
        i = idx.cpu()
        return replay_routes({ly: r[i].reshape(-1, r.shape[-1]) for ly, r in routes.items()}, keep_own=own)
    return record_routes() if own else contextlib.nullcontext(None)


@torch.no_grad()
def score_rows(tr: StepContext, module: Any, exp: Experience, micro: list[torch.Tensor], routes: Routes | None, *,
               entropy: bool, own_routes: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs float32 [N, R] (and entropies) of every row, micro-batch by micro-batch, without gradient;
    ``own_routes`` (a list) receives each micro-batch's recording of the learner's own MoE routes."""
    lps, ents = [], []
    for idx in micro:
        with route_scope(routes, tr.cfg.routing_replay, idx, own=own_routes is not None) as tape:
            lp, ent = response_logprobs(module, exp.select(idx), temperature=tr.cfg.temperature, top_p=tr.cfg.top_p,
                                        with_entropy=entropy)
        if own_routes is not None and tape is not None:
            own_routes.append(tape.records)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


def _routing_row(routes: Routes, own: list[dict[str, list[torch.Tensor]]], exp: Experience, replay: bool) -> dict[str, Any]:
    """``routing/...``: per-layer fraction of valid positions whose top-k expert set differs between
    the rollout's recorded routes and the learner's own (proximal pass)."""
    from qpass.moe.routing import routing_mismatch

    learner = {ly: torch.cat([c for rec in own for c in rec.get(ly, [])]).cpu() for ly in routes}
    rollout = {ly: r.reshape(-1, r.shape[-1]) for ly, r in routes.items()}
    per = routing_mismatch(rollout, learner, exp.attention_mask.bool().reshape(-1).cpu())
    vals = [m["mismatch"] for m in per.values() if m["tokens"]]
    return {"routing/replay": bool(replay), "routing/layers": len(per),
            "routing/tokens": max((m["tokens"] for m in per.values()), default=0),
            "routing/mismatch_mean": sum(vals) / len(vals) if vals else float("nan"),
            "routing/mismatch_max": max(vals) if vals else float("nan"),
            "routing/mismatch_per_layer": {ly: m["mismatch"] for ly, m in sorted(per.items())}}


def _response_row(exp: Experience, texts: list[str]) -> dict[str, Any]:
    mask = exp.response_mask
    return {"resp/len_mean": float(exp.sampled_mask.sum(-1).float().mean()),
            "resp/finished_frac": float(exp.finished.float().mean()),
            "resp/empty_text_frac": sum(1 for x in texts if not x.strip()) / len(texts),
            "resp/n_loss_tokens": int(mask.sum()), "resp/n_all_masked": int((mask.sum(-1) == 0).sum())}


def score(tr: StepContext, s: Sampled) -> Scored:
    """Rewards, advantages, the loss mask and every policy's log-probs of the sampled tokens (module docstring)."""
    cfg = tr.cfg
    exp = s.exp
    texts = decode_responses(tr.tokenizer, exp)
    responses = score_responses(tr.reward, tr.answer_fn, s.metas, texts, cfg.group_size)
    adv = responses.advantages.float().to(tr.device)
    if cfg.mask_truncated:
        exp = dataclasses.replace(exp, response_mask=exp.response_mask & exp.finished.unsqueeze(-1))
    mask = exp.response_mask
    row: dict[str, Any] = {**responses.row(), **_response_row(exp, texts)}

    # proximal (and reference) log-probs, before any update, with the update's micro-batches
    t0 = time.perf_counter()
    micro = micro_batches(exp.n, tr.micro)
    own: list | None = [] if s.routes is not None else None
    with reuse_weight_quantization(tr.quant_reuse):  # same weights: each site's QDQ once for all micro-batches
        lprox, ent = score_rows(tr, tr.le, exp, micro, s.routes, entropy=True, own_routes=own)
        lref = score_rows(tr, tr.ref, exp, micro, s.routes, entropy=False)[0] if tr.ref is not None else None
    row["time/prox_s"] = time.perf_counter() - t0
    if own is not None:
        row.update(_routing_row(s.routes, own, exp, cfg.routing_replay))
    n_valid = int(mask.sum())
    row["entropy/token_mean"] = float(torch.where(mask, ent, torch.zeros_like(ent)).sum()) / n_valid if n_valid else float("nan")
    row.update(mismatch_metrics(lprox, exp.logq, mask, ess_cap=cfg.ess_cap).to_dict("gap/"))
    row["corr/affected_frac"] = correction_affected_frac(lprox, exp.logq, mask, cfg.loss.correction)
    lshadow = _shadow(tr, exp, lprox, row) if tr.shadow is not None else None
    return Scored(exp, responses, adv, micro, lprox, ent, lref, lshadow, s.routes, row)


def _shadow(tr: StepContext, exp: Experience, lprox: torch.Tensor, row: dict[str, Any]) -> torch.Tensor:
    """The BF16 shadow engine, loaded with the learner's weights, scores the sampled tokens; adds its gap keys to ``row``."""
    cfg, mask = tr.cfg, exp.response_mask
    t0 = time.perf_counter()
    with reuse_weight_quantization(tr.quant_reuse):
        tr.shadow.update_weights(shadow_weights(tr.learner_qg, tr.le.export_weights(), mode=cfg.shadow_weights))
    lshadow = score_sampled(tr.shadow, exp, tr.ro.batch_size, temperature=cfg.temperature, top_p=cfg.top_p)
    row.update(mismatch_metrics(lshadow, exp.logq, mask, ess_cap=cfg.ess_cap).to_dict("shadow_gap/"))
    row.update(mismatch_metrics(lprox, lshadow, mask, ess_cap=cfg.ess_cap).to_dict("prox_shadow_gap/"))
    row["time/shadow_s"] = time.perf_counter() - t0
    return lshadow


# --------------------------------------------------------------------------- update


def update(tr: StepContext, sc: Scored, step: int) -> Updated:
    """``cfg.ppo_epochs`` x ``cfg.minibatches`` optimizer steps (:func:`qpass.rl.update.ppo_update`), then the
    clip-branch disagreement over every update forward (with a shadow)."""
    cfg = tr.cfg
    schedule = UpdateSchedule(epochs=cfg.ppo_epochs, minibatches=cfg.minibatches, grad_clip=cfg.grad_clip,
                              shuffle_seed=derive_seed(cfg.seed, step, 3) % (2**63), temperature=cfg.temperature, top_p=cfg.top_p)
    t0 = time.perf_counter()
    out = ppo_update(tr.le, tr.opt, sc.exp, sc.adv, sc.lprox, sc.lref, sc.micro, cfg.loss, schedule,
                     route_scope=lambda idx: route_scope(sc.routes, cfg.routing_replay, idx), reuse=tr.quant_reuse)
    if tr.device.type == "cuda":
        torch.cuda.synchronize()
    row = {**out.stats, "time/update_s": time.perf_counter() - t0}
    clip = {} if sc.lshadow is None else _disagreement(out.forwards, sc, tr.cfg.loss.eps_low, tr.cfg.loss.eps_high).to_dict("clip/")
    return Updated(out.forwards, row, clip)


def _disagreement(forwards: list[tuple[torch.Tensor, torch.Tensor]], sc: Scored, eps_low: float, eps_high: float) -> Any:
    """Clip-branch disagreement of ``p_theta / q`` vs ``p_theta / q_bf16`` over every update forward.

    ``p_theta`` is the learner's log-prob of each token at each forward of the update (all epochs
    and minibatches, a token counted once per forward); ``q`` the quantized rollout's, ``q_bf16``
    the BF16 shadow engine's, on the same tokens; split by advantage sign
    (:func:`qpass.diagnostics.clip_branch_disagreement`, the loss's ``eps_low`` / ``eps_high``).
    """
    exp, mask = sc.exp, sc.exp.response_mask
    assert sc.lshadow is not None
    if forwards:
        idx = torch.cat([i for i, _ in forwards])
        lp = torch.cat([lp for _, lp in forwards]).double()
    else:  # no update ran: the ratios at p_theta = p_prox are not available; report on no tokens
        idx = torch.zeros(0, dtype=torch.long, device=mask.device)
        lp = torch.zeros(0, mask.shape[1], dtype=torch.float64, device=mask.device)
    return clip_branch_disagreement(torch.exp(lp - exp.logq[idx].double()), torch.exp(lp - sc.lshadow[idx].double()),
                                    sc.adv[idx], mask[idx], eps_low, eps_high)


# --------------------------------------------------------------------------- sync


def sync(tr: StepContext, step: int, final: bool) -> Synced:
    """Export, re-quantize into the rollout side, verify, re-calibrate, measure visibility (module docstring).

    The full bit-exact check runs for aligned recipes on the final step and every ``cfg.bitexact_every``
    steps; the weight-quantization store is cleared before it (it and the next step quantize afresh).
    """
    from qpass.parity.checker import check_weights_bitexact

    cfg = tr.cfg
    t0 = time.perf_counter()
    masters = tr.le.export_weights()
    if tr.external:
        mirror(tr, masters)
    with reuse_weight_quantization(tr.quant_reuse):  # the sync's quantization, reused by the verification
        rep = tr.graph_ro.update_weights(masters)
        row: dict[str, Any] = {"parity/sync_copied": rep.copied, "parity/sync_requantized": rep.requantized,
                               "time/sync_s": time.perf_counter() - t0}
        engine_failure = _sync_engine(tr, masters, row) if tr.ro is not tr.graph_ro else None
        t0 = time.perf_counter()
        ver = verify_sync(tr.learner_qg, tr.rollout_qg, rep.fingerprints)
    tr.quant_reuse.clear()
    row.update(ver.to_dict("parity/"))
    failures: list[str] = [] if ver.ok else [f"sync fingerprints: {ver.mismatches[:3]}"]
    if engine_failure:
        failures.append(engine_failure)
    if tr.aligned and (final or (cfg.bitexact_every and step % cfg.bitexact_every == 0)):
        br = check_weights_bitexact(tr.learner_qg, tr.rollout_qg)
        row.update({"parity/bitexact_ok": br.ok, "parity/bitexact_groups": len(br.groups),
                    "parity/bitexact_failures": br.failures()[:5]})
        if not br.ok:
            failures.append(f"bit-exact: {br.failures()[:3]}")
    if tr.external:
        sv = served_checks(tr, masters)
        row.update(sv)
        if not sv["parity/served_ok"]:
            failures.append(f"served bytes vs exported weights: {sv['parity/served_mismatches'][:3]}")
        if not sv.get("parity/learner_bytes_ok", True):
            failures.append(f"served bytes vs learner fake-quant bytes: {sv['parity/learner_bytes_mismatches'][:3]}")
    row["time/verify_s"] = time.perf_counter() - t0
    if cfg.recalibrate:
        row.update(tr.recalibrate(masters))
    del masters
    row.update(_visibility(tr, diag=bool(cfg.diag_every and (final or step % cfg.diag_every == 0))))
    return Synced(row, failures)


def _visibility(tr: StepContext, *, diag: bool) -> dict[str, Any]:
    """``vis/...``: what the sync changed in the rollout's constants (decoded values on diagnostic steps);
    the trainer's snapshot moves to the new constants."""
    t0 = time.perf_counter()
    snap = snapshot_rollout_constants(tr.rollout_qg)
    row: dict[str, Any] = {f"vis/{k}": v for k, v in byte_visibility(tr.snapshot, snap).items()}
    if diag and snap.nvfp4:
        row["vis/value_frac"] = update_visibility_groups(tr.snapshot.nvfp4_tensors(), snap.nvfp4_tensors()).total.value_frac
    tr.snapshot = snap
    row["time/visibility_s"] = time.perf_counter() - t0
    return row


def mirror(tr: StepContext, weights: dict[str, torch.Tensor]) -> None:
    """Copy an external learner's exported weights into the learner graph (``GRPOTrainer(learner_engine=...)``).

    Raises:
        QpassError: ``weights`` lacks a learner-graph weight (the first three named).
    """
    from qpass.errors import QpassError
    from qpass.graph.capture import site_of

    params = dict(tr.learner_qg.gm.named_parameters(remove_duplicate=False))
    missing = sorted(site_of(a) for a in params if site_of(a) not in weights)
    if missing:
        raise QpassError(f"learner engine {tr.le.name}: export_weights() lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    with torch.no_grad():
        for a, p in params.items():
            p.copy_(weights[site_of(a)].to(device=p.device, dtype=p.dtype))


def served_checks(tr: StepContext, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Bit-level parity through the engine protocols: served bytes vs qpass's quantizer of the
    exported weights, and vs the external learner's own fake-quant bytes (``parity/served_*``,
    ``parity/learner_bytes_*``)."""
    from qpass.parity.served import check_learner_bytes, check_served_weights

    served = tr.ro.served_weights()
    chk = check_served_weights(weights, served)
    row: dict[str, Any] = {"parity/served_ok": chk.ok, "parity/served_checked": chk.checked,
                           "parity/served_mismatches": list(chk.mismatches[:5])}
    sites = getattr(tr.le, "fake_quant_sites", None)
    if sites is not None and tr.aligned:
        lb = check_learner_bytes(sites(), served)
        row.update({"parity/learner_bytes_ok": lb.ok, "parity/learner_bytes_checked": lb.checked,
                    "parity/learner_bytes_mismatches": list(lb.mismatches[:5])})
    return row


def _sync_engine(tr: StepContext, masters: dict[str, torch.Tensor], row: dict[str, Any]) -> str | None:
    """Update the live rollout engine from ``masters`` and compare the bytes it serves with qpass's
    quantizer of them (:func:`qpass.parity.served.check_served_weights`). Returns a failure or None."""
    from qpass.parity.served import check_served_weights

    t0 = time.perf_counter()
    tr.ro.update_weights(masters)
    row["time/engine_sync_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    chk = check_served_weights(masters, tr.ro.served_weights())
    row.update({"parity/engine": tr.ro.name, "parity/engine_bitexact_ok": chk.ok, "parity/engine_sites": chk.checked,
                "parity/engine_mismatches": list(chk.mismatches[:5]), "time/engine_verify_s": time.perf_counter() - t0})
    return None if chk.ok else f"{tr.ro.name} engine serves other bytes than qpass's quantizer: {chk.mismatches[:3]}"
