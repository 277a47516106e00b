"""The GRPO loop over a learner graph and a (quantized) rollout graph (SPEC §5, issue 5).

Three policies, kept distinct (SPEC §5):

* **behaviour** ``q``: the rollout graph that sampled; ``log q`` is recorded at sampling time
  (the rollout engine, :class:`qpass.runtime.RolloutEngine`), never recomputed;
* **proximal** ``p_prox``: the learner at the rollout snapshot: every sampled row is scored by the
  learner *before* any optimizer step of this step, without gradient;
* **current** ``p_theta``: the learner during the update, with gradient.

One :meth:`GRPOTrainer.step` wires four phases (:mod:`qpass.apps.grpo.phases`: ``sample`` -> ``score``
-> ``update`` -> ``sync``, each with a typed input and output record, each runnable alone); the
domain arithmetic lives in :mod:`qpass.rl` (``rewards``, ``loss``, ``update``, ``seeds``):

1. draw ``prompts_per_step`` training problems, sample ``group_size`` responses each with the
   rollout graph in chunks of its static batch size (chunk ``c`` of step ``s`` uses a seed derived
   from ``(seed, s, c)`` only, so every recipe sees the same prompts and seeds);
2. rewards through the plug-in reward wrapped by :func:`qpass.rl.task.safe_reward` (exceptions,
   non-numbers and NaN/inf become 0 and are counted); group advantages
   (:func:`qpass.rl.loss.group_advantages`: an all-equal group gets exactly 0);
3. ``p_prox`` (and ``p_ref`` when ``beta > 0``: the learner's initial weights) with the same
   micro-batches the first epoch of the update uses, so on the first minibatch ``r = p_theta /
   p_prox`` is exactly 1 (logged as ``check/first_minibatch_ratio_exact``);
4. ``ppo_epochs`` x ``minibatches`` optimizer steps of :func:`qpass.rl.loss.grpo_loss` with gradient
   accumulation over micro-batches (the loss's outer denominator is the minibatch's valid-token
   count, or its number of non-empty responses under ``seq_mean``); micro-batch *compositions* are
   fixed for the whole step (only their order is shuffled in later epochs), so no score ever
   changes because of batch composition; AdamW on FP32 master weights
   (:class:`qpass.apps.grpo.weights.MasterOptimizer`) with gradient-norm clipping. A micro-batch whose
   advantages are all 0 (and ``beta == 0``) contributes exactly 0 loss and gradient and is skipped;
5. the rollout engine's ``update_weights`` re-quantizes from the learner's exported master weights, then
   :func:`qpass.apps.grpo.weights.verify_sync` checks it (every step) and
   :func:`qpass.parity.checker.check_weights_bitexact` every ``bitexact_every`` steps and on the
   last step, for recipes whose learner fake-quantizes weights;
6. diagnostics (one JSONL row per step, appended and flushed before the next step starts).

Row keys (``null`` = no data, e.g. no valid token):

* ``gap/...``: SPEC §4 metrics of ``(p_prox, q)`` over loss tokens
  (:meth:`qpass.diagnostics.MismatchMetrics.to_dict`): ``gap/token/g_abs`` is ``G_abs`` (token
  mean), ``gap/resp/g_abs`` the response mean, ``gap/max_abs``, ``gap/{token,resp}/{k1,k3,ess_raw,
  ess_trunc}`` (truncation at ``ess_cap``), non-finite counts;
* ``shadow_gap/...``: the same metrics of ``(q_bf16, q)``: the quantized rollout against a BF16
  rollout engine (the trainer's ``shadow``, loaded with the learner's master weights by default,
  see :mod:`qpass.apps.grpo.probes`) scoring the same sampled tokens through its own decode path:
  what the rollout quantization does to the behaviour policy (exactly 0 for the ``bf16`` recipe);
  ``prox_shadow_gap/...``: ``(p_prox, q_bf16)``, the learner against the BF16 rollout (engine drift
  plus, for QAT learners, the weight quantization the learner models);
* ``clip/...``: :func:`qpass.diagnostics.clip_branch_disagreement` of ``p_theta/q`` versus
  ``p_theta/q_bf16`` over every forward of the update (``p_theta`` moves across minibatches and
  epochs), split by advantage sign: how often quantizing the rollout flips the clip branch a
  coupled PPO would take;
* ``loss/...``, ``opt/...``: aggregated loss statistics (incl. ``loss/n_dropped``: tokens with a
  non-finite log-ratio dropped under the loss's policy; ``loss/ratio_min``/``max`` of the loss's
  ratio; ``loss/clip_{pos,neg}_frac``: clipped fraction of ``A > 0`` / ``A < 0`` tokens over all
  update forwards, ``loss/coupled_clip_{pos,neg}_frac`` the same for ``p_theta / q``), gradient
  norm, parameter elements changed;
* ``vis/...``: update visibility (canonical codes / scale bytes / global scales that the sync
  changed; ``vis/value_frac``: decoded values, on diagnostic steps);
* ``parity/...``: sync counts, three-way fingerprint check, full bit-exact check when it ran;
* ``layerwise/...`` (diagnostic steps): mean/max relative input mismatch over linear sites;
* ``eval/...`` (eval steps): held-out exact-answer accuracy and its binomial standard error;
* ``calib/...`` (with a calibration, ``qpass grpo --calibration CAL``): how stale the calibrated
  activation scales are — per site the amax the rollout graph's input saw while sampling this step
  (:mod:`qpass.quant.observe`) over the calibrated group amax in effect
  (:func:`qpass.calibration.run.staleness`): ``calib/amax_ratio_{max,median,min}``, ``calib/sites``,
  ``calib/sites_over`` (ratio > 1: a static scale saturates there), ``calib/worst_site``; with
  ``recalibrate`` also ``calib/recalibrated``, ``calib/amax_change_max`` (max |new/old - 1| of the
  static sites' amax) and ``calib/rac_channels_changed`` (fraction of static RAC channel slots that
  changed) of the re-calibration after this step's weight sync, ``time/recalibrate_s``;
* ``reward/...``, ``adv/...``, ``resp/...``, ``entropy/token_mean`` (of the proximal policy's
  sampling distribution at loss tokens), ``rollout/tokens_per_s``, ``time/...``;
* cost, for accuracy-against-cost comparisons (wall seconds of this process; on a GPU shared by
  several runs they include the waiting for it): ``time/rollout_s`` (sampling), ``time/learner_s``
  (proximal pass + update), running totals ``time/{rollout,learner,step}_s_cum`` and
  ``rollout/n_tokens_cum`` over the whole run (continued across resumes);
* ``routing/...`` (MoE models): ``mismatch_mean`` / ``mismatch_max`` over layers of the fraction of
  valid positions whose top-k expert set differs between the rollout's recorded routes and the
  learner's own at ``p_prox`` (``mismatch_per_layer``), ``replay`` (whether the learner replayed
  the rollout's routes: ``GRPOConfig.routing_replay``). Under replay a layer's "own" routes are
  the router's choice given the replayed routes of the layers before it (the first MoE layer's
  are the same either way).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch

from qpass.graph.qgraph import QGraph
from qpass.progress import phase
from qpass.prompts import encode_chat
from qpass.quant.reuse import ReuseStore
from qpass.rl.loss import Correction, LossConfig
from qpass.rl.seeds import derive_seed
from qpass.apps.grpo import phases
from qpass.apps.grpo.jsonl import append_jsonl
from qpass.apps.grpo.phases import Sampled
from qpass.apps.grpo.probes import evaluate, layerwise_probe, layerwise_summary, prompt_batch
from qpass.rl.task import DEFAULT_TEMPLATE, ArithmeticTask, RewardFn, SafeReward, exact_answer_reward, format_prompt, safe_reward
from qpass.apps.grpo.weights import MasterOptimizer, has_learner_qdq, nvfp4_groups, snapshot_rollout_constants

log = logging.getLogger(__name__)

__all__ = ["GRPOConfig", "GRPOResult", "GRPOTrainer"]


class GRPOConfig(pydantic.BaseModel):
    """Options of :class:`GRPOTrainer` (pydantic, frozen; unknown keys and bad values are errors
    naming the field; ``qpass grpo`` reads its defaults here).

    Attributes:
        steps: total GRPO steps of the run (>= 1); :meth:`GRPOTrainer.run` continues a resumed run
            up to this step.
        prompts_per_step, group_size: prompts per step and responses per prompt (``G >= 1``; G=1
            makes every advantage 0).
        max_new_tokens: response budget ``R`` (prompt + R must fit the rollout's KV cache).
        temperature, top_p: the sampling distribution (learner scores under the same one).
        lr, weight_decay, adam_betas, adam_eps: AdamW on the master weights.
        grad_clip: max global gradient L2 norm (None: no clipping).
        master_dtype: ``"fp32"`` (FP32 masters, BF16 written back) or ``"param"`` (step the graph
            parameters in their own dtype).
        ppo_epochs, minibatches: passes over the step's data and optimizer steps per pass; with
            ``ppo_epochs * minibatches > 1`` the learner moves between updates of one step, so the
            PPO ratio leaves 1 and clipping can act.
        micro_batch_size: rows per learner forward (None: the rollout graph's batch size).
        loss: :class:`qpass.rl.loss.LossConfig` (ratio decoupled/coupled, correction
            none/is/tis/mis, eps_low/high, beta, token_mean/seq_mean, non-finite policy).
        mask_truncated: drop responses without EOS from the loss (their reward still counts in
            the group baseline).
        seed: seeds problem order and sampling.
        bitexact_every: full bit-exact parity check every N steps and on the last step (0: only on the
            last step).
        on_parity_failure: ``"raise"`` (:class:`qpass.errors.ParityError` after the row is
            written) or ``"warn"``.
        shadow: score every sampled batch with a BF16 rollout engine (the trainer's ``shadow``
            argument) for the shadow gap and clip-branch disagreement.
        shadow_weights: what the shadow engine is loaded with before each step: ``"master"`` (the
            learner's master weights, i.e. a plain BF16 rollout of the policy being trained) or
            ``"learner"`` (the weights the learner forward computes with: ``DQ(Q(W))`` at weight-QDQ
            sites).
        diag_every: layer-wise probe and decoded-value visibility every N steps and on the last
            step; 0 = never.
        eval_every: held-out evaluation every N steps, before step 1 and on the last step; 0 = never.
        eval_prompts: held-out problems per evaluation (<= the task's eval split). The default 400
            bounds the binomial standard error ``sqrt(p (1 - p) / n)`` by 2.5 pp (at p = 0.5).
        eval_max_new_tokens: response budget for evaluation (None: ``max_new_tokens``).
        eval_temperature: 0 = greedy.
        ess_cap: truncation cap of ``ess_trunc``.
        initial_check: structural + bit-exact parity of the freshly built graphs before step 1.
        max_time_s: stop before a step that would end past this many seconds since :meth:`run`
            started (estimated from the previous step); None = no limit.
        cuda_graphs: the built-in rollout engine's decode step under CUDA graphs: ``"auto"`` (on a
            CUDA device, falling back to eager with the reason logged if capture fails), ``"on"``
            (capture failure is an error), ``"off"``. Ignored on CPU. An MoE model's rollout stays
            eager (its routes are recorded in Python every step); ``"on"`` is then an error.
        routing_replay: (MoE) the learner replays the rollout's recorded expert routes in every
            forward (proximal, reference and update passes; "R3"). Either way an MoE run logs the
            per-step routing mismatch between the rollout's routes and the learner's own
            (``routing/...``). Needs an MoE model and the built-in rollout engine.
        recalibrate: after every weight sync, re-calibrate the rollout graph's static constants
            (``act_amax`` of static activation scales, static RAC channels) from the new master
            weights on the calibration's own tokens (:func:`qpass.calibration.run.recalibrate`);
            needs the trainer's ``calibration`` and ``calibration_model``.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    steps: int = pydantic.Field(20, ge=1)
    prompts_per_step: int = pydantic.Field(8, ge=1)
    group_size: int = pydantic.Field(4, ge=1)
    max_new_tokens: int = pydantic.Field(48, ge=1)
    temperature: float = pydantic.Field(1.0, gt=0, allow_inf_nan=False)
    top_p: float = pydantic.Field(1.0, gt=0, le=1)
    lr: float = pydantic.Field(1e-5, gt=0, allow_inf_nan=False)
    weight_decay: float = pydantic.Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float | None = pydantic.Field(1.0, gt=0)
    master_dtype: Literal["fp32", "param"] = "fp32"
    ppo_epochs: int = pydantic.Field(1, ge=1)
    minibatches: int = pydantic.Field(1, ge=1)
    micro_batch_size: int | None = pydantic.Field(None, ge=1)
    loss: LossConfig = pydantic.Field(default_factory=LossConfig)
    mask_truncated: bool = False
    seed: int = 0
    bitexact_every: int = pydantic.Field(10, ge=0)
    on_parity_failure: Literal["raise", "warn"] = "raise"
    shadow: bool = True
    shadow_weights: Literal["master", "learner"] = "master"
    diag_every: int = pydantic.Field(5, ge=0)
    eval_every: int = pydantic.Field(5, ge=0)
    eval_prompts: int = pydantic.Field(400, ge=0)
    eval_max_new_tokens: int | None = pydantic.Field(None, ge=1)
    eval_temperature: float = pydantic.Field(0.0, ge=0)
    ess_cap: float = pydantic.Field(2.0, gt=0)
    initial_check: bool = True
    max_time_s: float | None = pydantic.Field(None, gt=0)
    cuda_graphs: Literal["auto", "on", "off"] = "auto"
    recalibrate: bool = False
    routing_replay: bool = False

    @pydantic.field_validator("loss", mode="before")
    @classmethod
    def _loss_type(cls, v: Any) -> Any:
        if not isinstance(v, LossConfig):
            raise TypeError(f"GRPOConfig.loss must be a LossConfig, got {type(v).__name__}")
        return v

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the loss config and its correction nested)."""
        d = self.model_dump(exclude={"loss"})
        d["loss"] = dataclasses.asdict(self.loss)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GRPOConfig":
        """Inverse of :meth:`to_dict` (e.g. a checkpoint's config). Raises: ValidationError, TypeError."""
        d = dict(d)
        loss = dict(d.pop("loss", {}))
        corr = Correction(**loss.pop("correction", {}))
        if "adam_betas" in d:
            d["adam_betas"] = tuple(d["adam_betas"])
        return cls(loss=LossConfig(correction=corr, **loss), **d)


@dataclasses.dataclass
class GRPOResult:
    """What :meth:`GRPOTrainer.run` returns.

    Attributes:
        rows: one metric row per completed step (as written to the JSONL file).
        initial: checks before step 1 (structural / bit-exact parity, eval, layer-wise probe).
        final: checks after the last completed step that its row does not already hold.
        stop_reason: ``"completed"`` (step ``cfg.steps`` done), ``"segment"`` (the ``steps`` asked
            of this call are done, the run goes on after a resume) or ``"time budget"``.
        wall_s: seconds inside :meth:`GRPOTrainer.run`.
    """

    rows: list[dict[str, Any]]
    initial: dict[str, Any]
    final: dict[str, Any]
    stop_reason: str
    wall_s: float


#: kept for callers of the old name; :func:`qpass.rl.seeds.derive_seed`
_seed = derive_seed


def _num(x: Any) -> float:
    return float(x) if x is not None else float("nan")


def _cost(row: dict[str, Any], prev: dict[str, Any]) -> dict[str, Any]:
    """The learner's seconds of this step and running totals over the run (``prev``: the last row, {} at the start)."""
    learner_s = row["time/prox_s"] + row["time/update_s"]
    return {"time/learner_s": learner_s,
            "time/rollout_s_cum": float(prev.get("time/rollout_s_cum") or 0.0) + row["time/rollout_s"],
            "time/learner_s_cum": float(prev.get("time/learner_s_cum") or 0.0) + learner_s,
            "rollout/n_tokens_cum": int(prev.get("rollout/n_tokens_cum") or 0) + row["rollout/n_tokens"]}


def _check_routing(cfg: GRPOConfig, moe: bool, rollout_engine: Any) -> None:
    """Refuse routing settings the models or engines cannot honour (ValueError)."""
    if cfg.routing_replay and not moe:
        raise ValueError("GRPOConfig.routing_replay needs an MoE model (the rollout graph has no qpass::moe_route node)")
    if moe and rollout_engine is not None and cfg.routing_replay:
        raise ValueError(f"routing replay needs the rollout's routes; the {getattr(rollout_engine, 'name', '?')} engine "
                         "does not record them (use the built-in rollout engine)")
    if moe and cfg.cuda_graphs == "on":
        raise ValueError("an MoE rollout records its expert routes in Python at every decode step; "
                         "cuda_graphs='on' would replay without them (use 'auto' or 'off')")


def _make_optimizer(cfg: GRPOConfig, le: Any) -> MasterOptimizer:
    """AdamW on master weights: the engine's ``make_optimizer`` (a sharded learner) or one over its trainable parameters."""
    opt_kw = dict(lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                  master_dtype=torch.float32 if cfg.master_dtype == "fp32" else None)
    make_opt = getattr(le, "make_optimizer", None)
    if make_opt is not None:
        return make_opt(MasterOptimizer, **opt_kw)
    return MasterOptimizer([p for p in le.parameters() if p.requires_grad], **opt_kw)


def _reference(learner: QGraph) -> Any:
    """The reference policy (``beta > 0``): a frozen clone of the learner at its initial weights."""
    from qpass.runtime.engine import make_learner_engine

    ref_qg = learner.clone("learner")
    for p in ref_qg.gm.parameters():
        p.requires_grad_(False)
    return make_learner_engine("qpass", qg=ref_qg)


class GRPOTrainer:
    """GRPO over a learner graph and a rollout graph (see module docstring).

    Args:
        learner: learner :class:`QGraph` (kind ``scoring``), e.g. from ``Pipeline.build``; its
            parameters are trained in place.
        rollout: rollout :class:`QGraph` (kind ``step``).
        tokenizer: chat tokenizer (``pad_token_id``, ``eos_token_id``, ``apply_chat_template``).
        task: :class:`qpass.rl.task.ArithmeticTask` (or any object with ``train_batches(n, seed=)``
            yielding problems with ``.meta`` and ``eval`` list, formatted by ``format_prompt``).
        cfg: :class:`GRPOConfig`.
        reward_fn: plug-in :class:`qpass.rl.task.RewardFn` (default exact answer); wrapped with
            :func:`qpass.rl.task.safe_reward` unless it already is a :class:`SafeReward`.
        shadow: the BF16 shadow rollout engine (a :class:`qpass.runtime.RolloutEngine`, e.g. the
            built-in engine of the ``bf16`` recipe's rollout graph; a step graph is wrapped with
            :func:`qpass.runtime.as_rollout_engine`); required when ``cfg.shadow``. It must not be
            the trainer's own rollout engine object.
        metrics_path, layerwise_path, eval_path: JSONL files to append to (None: not written).
        rollout_engine: a live :class:`qpass.runtime.RolloutEngine` (e.g. vLLM, ``--rollout-engine
            vllm``) that samples instead of the rollout graph; every sync updates it from the
            learner's master weights and reads its served bytes back for the bit-level check
            (``parity/engine_bitexact_ok``). The rollout graph is still synced (its diagnostics).
        template: user-message template of the task prompts.
        answer_fn: correctness of a response (``>= 1.0``: correct) for ``reward/correct_frac`` and
            the held-out eval accuracy (default :data:`qpass.rl.task.exact_answer_reward`, the last
            integer; ``qpass grpo --reward first`` passes ``first_answer_reward``).
        recipe_name: label for progress output.
        learner_engine: a :class:`qpass.runtime.engine.LearnerEngine` that computes ``p`` and is
            trained instead of the built-in engine over ``learner`` (e.g. ``make_learner_engine(
            "megatron", ...)``); ``learner`` then mirrors its weights: after every export the
            exported weights are copied into it, so the graph-side checks and diagnostics
            (fingerprints, bit-exact check, BF16 shadow, layer-wise probe) read the weights that
            were trained. Every step also runs :func:`qpass.parity.served.check_served_weights`
            on the exported weights and, when the engine has ``fake_quant_sites()``, compares the
            NVFP4 bytes its own forward uses with the served ones
            (:func:`qpass.parity.served.check_learner_bytes`). The optimizer comes from the
            engine's ``make_optimizer(MasterOptimizer, ...)`` when it has one (a sharded learner
            steps on every rank). ``loss.beta > 0`` is refused (no reference policy for it).
        calibration: the :class:`qpass.calibration.record.Calibration` the rollout was built with
            (None: none); turns on the ``calib/`` staleness keys.
        calibration_model: an unquantized HF model (a private copy: its weights are overwritten
            with the masters) that ``cfg.recalibrate`` runs the calibration tokens through.
    Attributes:
        last_sampled: the last step's :class:`qpass.apps.grpo.phases.Sampled` (its rows and MoE
            routes; None before the first step).
        quant_reuse: the :class:`qpass.quant.reuse.ReuseStore` the step's weight quantizations share
            (cleared after every step; replace it by ``ReuseStore(enabled=False)`` to compute every
            quantization, e.g. for an A/B measurement: the results are the same bits).
    Raises:
        ValueError: bad graph kinds, no tokenizer ids, ``cfg.shadow`` without ``shadow``,
            ``minibatches`` larger than the number of micro-batches, eval problems missing, or
            ``cfg.recalibrate`` without ``calibration`` and ``calibration_model``.
    """

    def __init__(
        self,
        learner: QGraph,
        rollout: QGraph,
        tokenizer: Any,
        task: ArithmeticTask,
        cfg: GRPOConfig,
        *,
        reward_fn: RewardFn | None = None,
        shadow: Any = None,
        metrics_path: str | Path | None = None,
        layerwise_path: str | Path | None = None,
        eval_path: str | Path | None = None,
        template: str = DEFAULT_TEMPLATE,
        recipe_name: str = "",
        learner_engine: Any = None,
        rollout_engine: Any = None,
        answer_fn: RewardFn | None = None,
        calibration: Any = None,
        calibration_model: torch.nn.Module | None = None,
    ) -> None:
        from qpass.moe.routing import has_routing
        from qpass.runtime.engine import as_rollout_engine, make_learner_engine, make_rollout_engine

        if cfg.recalibrate and (calibration is None or calibration_model is None):
            raise ValueError("GRPOConfig.recalibrate needs the calibration the rollout was built with and a calibration "
                             "model (qpass grpo --recalibrate needs --calibration CAL)")
        self.calibration, self.calibration_model = calibration, calibration_model
        self.calib_amax: dict[str, torch.Tensor] = {}
        self._recalibrated_since_load = False
        self.cfg = cfg
        self.learner_qg, self.rollout_qg = learner, rollout
        self.tokenizer = tokenizer
        self.task = task
        self.template = template
        self.recipe_name = recipe_name
        pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
        if pad is None or eos is None:
            raise ValueError("the tokenizer needs pad_token_id and eos_token_id")
        self.eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        self.external = learner_engine is not None
        if self.external and cfg.loss.beta > 0:
            raise ValueError("GRPOConfig.loss.beta > 0 needs a reference policy, which an external learner engine "
                             f"({getattr(learner_engine, 'name', '?')}) does not provide here")
        self.le = learner_engine if self.external else make_learner_engine("qpass", qg=learner)
        self.moe = has_routing(rollout.gm)
        _check_routing(cfg, self.moe, rollout_engine)
        self.graph_ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=int(pad), eos_token_id=self.eos_ids,
                                           cuda_graphs="off" if self.moe else cfg.cuda_graphs)
        self.ro = rollout_engine if rollout_engine is not None else self.graph_ro
        self.route_diag = self.moe and self.ro is self.graph_ro  # routes recorded and compared every step
        self.last_sampled: Sampled | None = None  # the last step's sampling (its MoE routes, diagnostics)
        self.pad = int(pad)
        self.micro = cfg.micro_batch_size or self.ro.batch_size
        n_rows = cfg.prompts_per_step * cfg.group_size
        n_micro = math.ceil(n_rows / self.micro)
        if cfg.minibatches > n_micro:
            raise ValueError(f"GRPOConfig.minibatches={cfg.minibatches} exceeds the {n_micro} micro-batches of "
                             f"{n_rows} rows (micro_batch_size={self.micro})")
        self.reward = reward_fn if isinstance(reward_fn, SafeReward) else safe_reward(reward_fn or exact_answer_reward)
        self.answer_fn = answer_fn or exact_answer_reward
        self.opt = _make_optimizer(cfg, self.le)
        self.ref = _reference(learner) if cfg.loss.beta > 0 else None
        self.shadow = None
        if cfg.shadow:
            if shadow is None:
                raise ValueError("GRPOConfig.shadow=True needs a shadow rollout engine (e.g. the bf16 recipe's rollout)")
            if isinstance(shadow, QGraph) and shadow is rollout:
                raise ValueError("the shadow must be its own engine, not the trainer's rollout graph")
            self.shadow = as_rollout_engine(shadow, pad_token_id=int(pad), eos_token_id=self.eos_ids)
        self.aligned = has_learner_qdq(learner) and bool(nvfp4_groups(rollout))
        # weight-quantization results reused within one step (qpass.quant.reuse; keyed on tensor versions);
        # ReuseStore(enabled=False) computes every quantization (A/B measurement, equality tests)
        self.quant_reuse = ReuseStore()
        self.snapshot = snapshot_rollout_constants(rollout)
        self.paths = {k: Path(v) if v is not None else None
                      for k, v in (("metrics", metrics_path), ("layerwise", layerwise_path), ("eval", eval_path))}
        self.batches = task.train_batches(cfg.prompts_per_step, seed=derive_seed(cfg.seed, 1) % (2**31))
        self._prompt_cache: dict[str, list[int]] = {}
        self.step_idx = 0
        self._final_done = False
        self.history: dict[str, list[dict[str, Any]]] = {"metrics": [], "eval": [], "layerwise": []}
        self.initial: dict[str, Any] | None = None
        self._eval_set: tuple[list[dict], list[list[int]]] | None = None
        if cfg.eval_every and cfg.eval_prompts:
            probs = list(task.eval[: cfg.eval_prompts])
            if not probs:
                raise ValueError("GRPOConfig.eval_every > 0 but the task has no eval problems (n_eval=0)")
            self._eval_set = ([p.meta for p in probs], self.encode(probs))
        probe_src = list(task.eval[: self.ro.batch_size]) or list(task.train[: self.ro.batch_size])
        self._probe = prompt_batch(self.encode(probe_src), self.ro.batch_size, pad_token_id=self.pad, device=self.ro.device)
        if calibration is not None:
            from qpass.calibration.run import graph_constants

            self.calib_amax = {s: calibration.group_amax(s) for s in calibration.amax if s in rollout.sites}
            self.calib_amax.update(graph_constants(rollout)[0])  # what the static sites quantize with

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.ro.device

    def encode(self, problems: Sequence[Any]) -> list[list[int]]:
        out = []
        for p in problems:
            ids = self._prompt_cache.get(p.id)
            if ids is None:
                ids = encode_chat(self.tokenizer, [format_prompt(p, self.template)])[0]
                self._prompt_cache[p.id] = ids
            out.append(ids)
        return out

    def _write(self, key: str, row: dict[str, Any]) -> None:
        self.history[key].append(row)
        path = self.paths[key]
        if path is not None:
            append_jsonl(path, row)

    # ------------------------------------------------------------------ checks
    def initial_checks(self) -> dict[str, Any]:
        """Parity of the freshly built graphs, baseline eval and layer-wise probe (step 0): one phase, a unit per part."""
        parts = [name for name, on in (("parity", self.cfg.initial_check and self.aligned),
                                       ("served bytes", self.cfg.initial_check and self.external),
                                       ("eval", self._eval_set is not None), ("layer-wise probe", bool(self.cfg.diag_every))) if on]
        label = f"grpo {self.recipe_name}".strip()
        with phase(f"{label}: step 0 ({', '.join(parts) or 'nothing to check'})", total=len(parts), unit="part") as ph:
            return self._initial_checks(ph)

    def _initial_checks(self, ph: Any) -> dict[str, Any]:
        from qpass.parity.checker import check_structural, check_weights_bitexact

        out: dict[str, Any] = {"step": 0}
        if self.cfg.initial_check and self.aligned:
            t0 = time.perf_counter()
            st = check_structural(self.learner_qg, self.rollout_qg)
            br = check_weights_bitexact(self.learner_qg, self.rollout_qg)
            out.update({"parity/structural_ok": st.ok, "parity/structural_problems": st.problems[:5],
                        "parity/bitexact_ok": br.ok, "parity/bitexact_groups": len(br.groups),
                        "parity/bitexact_failures": br.failures()[:5], "time/initial_check_s": time.perf_counter() - t0})
            if not (st.ok and br.ok):
                self._parity_failure(f"initial parity failed: {st.problems[:3]} {br.failures()[:3]}")
            ph.advance(note="parity")
        if self.cfg.initial_check and self.external:
            served = phases.served_checks(self, self.le.export_weights())
            out.update(served)
            if not (served["parity/served_ok"] and served.get("parity/learner_bytes_ok", True)):
                self._parity_failure(f"initial served-bytes check failed: {served['parity/served_mismatches'][:3]} "
                                     f"{served.get('parity/learner_bytes_mismatches', [])[:3]}")
            ph.advance(note="served bytes")
        if self._eval_set is not None:
            out.update(self._eval(0))
            ph.advance(note=f"eval accuracy {out.get('eval/accuracy', float('nan')):.3f}")
        if self.cfg.diag_every:
            out.update(self._layerwise(0))
            ph.advance(note="layer-wise probe")
        return out

    def final_checks(self) -> dict[str, Any]:
        """The last-step checks (bit-exact parity, eval, layer-wise probe) for a run that stopped early."""
        from qpass.parity.checker import check_weights_bitexact

        out: dict[str, Any] = {"step": self.step_idx}
        if self.aligned:
            br = check_weights_bitexact(self.learner_qg, self.rollout_qg)
            out.update({"parity/bitexact_ok": br.ok, "parity/bitexact_groups": len(br.groups),
                        "parity/bitexact_failures": br.failures()[:5]})
        if self._eval_set is not None:
            out.update(self._eval(self.step_idx))
        if self.cfg.diag_every:
            out.update(self._layerwise(self.step_idx))
        self._final_done = True
        if self.aligned and not out["parity/bitexact_ok"]:
            self._parity_failure(f"final bit-exact check failed: {out['parity/bitexact_failures'][:3]}")
        return out

    def _parity_failure(self, msg: str) -> None:
        from qpass.errors import ParityError

        if self.cfg.on_parity_failure == "raise":
            raise ParityError(f"[{self.recipe_name or 'grpo'}] {msg}")
        log.warning("[%s] %s", self.recipe_name or "grpo", msg)

    def _eval(self, step: int) -> dict[str, Any]:
        assert self._eval_set is not None
        cfg = self.cfg
        t0 = time.perf_counter()
        metas, prompts = self._eval_set
        res = evaluate(self.ro, self.tokenizer, metas, prompts, max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
                       temperature=cfg.eval_temperature, seed=derive_seed(cfg.seed, 7, step), answer_fn=self.answer_fn)
        row = {f"eval/{k}": v for k, v in res.items()}
        row["time/eval_s"] = time.perf_counter() - t0
        self._write("eval", {"step": step, **row})
        return row

    def _layerwise(self, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        per_site = layerwise_probe(self.learner_qg, self.rollout_qg, *self._probe)
        summ = layerwise_summary(per_site)
        self._write("layerwise", {"step": step, "summary": summ,
                                  "sites": {s: {"rel": m.rel, "fro": m.fro, "max_abs": m.max_abs} for s, m in per_site.items()}})
        row = {f"layerwise/{k}": v for k, v in summ.items()}
        row["time/layerwise_s"] = time.perf_counter() - t0
        return row

    # ------------------------------------------------------------------ step
    def step(self, *, final: bool = False) -> dict[str, Any]:
        """One GRPO step (see module docstring); returns the metric row (also appended to JSONL).

        Args:
            final: this is the run's last step (forces the bit-exact check, eval and diagnostics).
        Raises:
            ParityError: a parity check failed and ``cfg.on_parity_failure == "raise"``.

        Weight quantization is reused within the step (:mod:`qpass.quant.reuse`, the trainer's
        store): the proximal pass quantizes each learner weight once for all its micro-batches and
        the first minibatch of the update reuses it; every optimizer step bumps the parameters'
        versions, so later minibatches quantize the new weights; the verification reuses the
        sync's quantization of the same master weights (its learner-side fingerprint still uses
        the learner's own group membership and amax: a different amax is another key and is
        quantized afresh). The full bit-exact check and the next step start from an empty store.
        """
        try:
            return self._step(final)
        finally:
            self.quant_reuse.clear()  # nothing carried into the next step (or past an exception)

    def _step(self, final: bool) -> dict[str, Any]:
        """Sample, score, update, sync (:mod:`qpass.apps.grpo.phases`), then the periodic diagnostics and the row."""
        cfg = self.cfg
        t_step = time.perf_counter()
        s = self.step_idx + 1
        row: dict[str, Any] = {"step": s}
        sampled = phases.sample(self, phases.SampleInput.of(self, s, next(self.batches)))
        self.last_sampled = sampled
        row.update(sampled.row)
        scored = phases.score(self, sampled)
        row.update(scored.row)
        updated = phases.update(self, scored, s)
        row.update(updated.row)
        prev = self.history["metrics"][-1] if self.history["metrics"] else {}
        row.update(_cost(row, prev))
        row.update(updated.clip_row)
        synced = phases.sync(self, s, final)
        row.update(synced.row)
        if cfg.diag_every and (final or s % cfg.diag_every == 0):
            row.update(self._layerwise(s))
        if self._eval_set is not None and (final or s % cfg.eval_every == 0):
            row.update(self._eval(s))
        self.step_idx = s
        self._final_done = bool(final)
        row["time/step_s"] = time.perf_counter() - t_step
        row["time/step_s_cum"] = float(prev.get("time/step_s_cum") or 0.0) + row["time/step_s"]
        self._write("metrics", row)
        if synced.failures:
            self._parity_failure(f"step {s}: " + "; ".join(synced.failures))
        return row

    def recalibrate(self, masters: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Re-calibrate the rollout graph's static constants from ``masters`` (``cfg.recalibrate``)."""
        from qpass.calibration.run import graph_constants, load_masters, recalibrate

        t0 = time.perf_counter()
        load_masters(self.calibration_model, masters)
        rep = recalibrate(self.rollout_qg, self.calibration_model, self.calibration.token_ids)
        self.calib_amax = {s: a for s, a in rep["group_amax"].items()}
        self.calib_amax.update(graph_constants(self.rollout_qg)[0])
        self._recalibrated_since_load = True
        return {"calib/recalibrated": True, "calib/amax_change_max": rep["amax_change_max"],
                "calib/rac_channels_changed": rep["rac_channels_changed"], "time/recalibrate_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ run
    def save_checkpoint(self, path: str | Path) -> Path:
        """:func:`qpass.apps.grpo.checkpoint.save_checkpoint` of this trainer."""
        from qpass.apps.grpo.checkpoint import save_checkpoint

        return save_checkpoint(self, path)

    def load_checkpoint(self, path: str | Path) -> int:
        """:func:`qpass.apps.grpo.checkpoint.load_checkpoint` into this trainer; returns the step restored."""
        from qpass.apps.grpo.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def run(self, steps: int | None = None, *, progress: bool = False,
            on_step: Callable[[dict[str, Any]], None] | None = None) -> GRPOResult:
        """Initial checks (on a fresh run), then GRPO steps up to ``cfg.steps``; stops early on the time budget.

        A resumed trainer (:meth:`load_checkpoint`) continues at the step after the checkpoint and
        skips the initial checks (their result is the checkpoint's). The step numbered ``cfg.steps``
        is the final one (bit-exact check, eval, diagnostics forced).

        Args:
            steps: at most this many steps in this call (>= 1; default: all remaining); a call
                that stops before ``cfg.steps`` this way runs no final checks (the run goes on
                after a resume), so a chained run's rows equal an unchained run's.
            progress: report the steps as a phase (:mod:`qpass.progress`; shown by the ``qpass grpo``
                command's reporter: a progress bar on a terminal, plain lines otherwise); False: silence.
            on_step: called with each row after it is written.
        Raises:
            ValueError: ``steps < 1``, or the run is already complete. ParityError: see :meth:`step`.
        """
        from qpass.progress import reporting

        if not progress:
            with reporting(None):
                return self.run(steps, progress=True, on_step=on_step)
        remaining = self.cfg.steps - self.step_idx
        if remaining < 1:
            raise ValueError(f"the run is complete: step {self.step_idx} of {self.cfg.steps}")
        n = remaining if steps is None else int(steps)
        if n < 1:
            raise ValueError(f"steps must be >= 1, got {n}")
        n = min(n, remaining)
        t_start = time.perf_counter()
        budget = self.cfg.max_time_s
        if self.initial is None:
            self.initial = self.initial_checks()
        if self.cfg.recalibrate and self.step_idx > 0 and not self._recalibrated_since_load:
            self.recalibrate(self.le.export_weights())  # resumed: what the last step's re-calibration had produced
        initial = self.initial
        rows: list[dict[str, Any]] = []
        stop = "completed" if n == remaining else "segment"
        self._final_done = False
        label = f"grpo {self.recipe_name}".strip()
        with phase(f"{label}: steps {self.step_idx + 1}-{self.step_idx + n} of {self.cfg.steps}", total=n, unit="step") as bar:
            for i in range(n):
                elapsed = time.perf_counter() - t_start
                prev = rows[-1]["time/step_s"] if rows else None
                if budget is not None and prev is not None and elapsed + prev > budget:
                    stop = "time budget"
                    break
                # the step after which the budget would be spent is the final one (final checks in its row)
                over = budget is not None and prev is not None and elapsed + 2 * prev > budget
                last = self.step_idx + 1 == self.cfg.steps or over
                row = self.step(final=last)
                rows.append(row)
                bar.advance(note=f"reward {row['reward/mean']:.3f}, G_abs {_num(row.get('gap/token/g_abs')):.4f}")
                if on_step is not None:
                    on_step(row)
                if over and i < n - 1:
                    stop = "time budget"
                    break
        final = self.final_checks() if rows and stop != "segment" and not self._final_done else {}
        return GRPOResult(rows, initial, final, stop, time.perf_counter() - t_start)
