"""The GRPO loop over a learner graph and a (quantized) rollout graph (SPEC §5, issue 5).

Three policies, kept distinct (SPEC §5):

* **behaviour** ``q``: the rollout graph that sampled; ``log q`` is recorded at sampling time
  (the rollout engine, :class:`qpass.runtime.RolloutEngine`), never recomputed;
* **proximal** ``p_prox``: the learner at the rollout snapshot: every sampled row is scored by the
  learner *before* any optimizer step of this step, without gradient;
* **current** ``p_theta``: the learner during the update, with gradient.

One :meth:`GRPOTrainer.step`:

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

from qpass.diagnostics import clip_branch_disagreement, mismatch_metrics, update_visibility_groups
from qpass.graph.qgraph import QGraph
from qpass.progress import phase
from qpass.prompts import encode_chat
from qpass.quant.reuse import ReuseStore, reuse_weight_quantization
from qpass.rl.experience import Experience, assemble, decode_responses, micro_batches, response_logprobs
from qpass.apps.grpo.jsonl import append_jsonl
from qpass.rl.loss import Correction, LossConfig, correction_weights, group_advantages, grpo_loss
from qpass.apps.grpo.probes import evaluate, layerwise_probe, layerwise_summary, prompt_batch, score_sampled, shadow_weights
from qpass.rl.task import DEFAULT_TEMPLATE, ArithmeticTask, RewardFn, SafeReward, exact_answer_reward, format_prompt, safe_reward
from qpass.apps.grpo.weights import (
    MasterOptimizer,
    byte_visibility,
    has_learner_qdq,
    nvfp4_groups,
    snapshot_rollout_constants,
    verify_sync,
)

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


def _seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (same parts -> same seed in every recipe)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


def _num(x: Any) -> float:
    return float(x) if x is not None else float("nan")


class _LossAgg:
    """Aggregates :func:`grpo_loss` stats over micro-batches and optimizer steps of one GRPO step."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.counts = dict.fromkeys(("n_dropped", "n_kl_dropped", "n_pos", "n_neg", "n_clip_pos", "n_clip_neg",
                                     "n_coupled_clip_pos", "n_coupled_clip_neg"), 0.0)
        self.weighted = dict.fromkeys(("clip_frac", "clip_low_frac", "clip_high_frac"), 0.0)
        self.mb_losses: list[float] = []
        self.mb_pg: list[float] = []
        self.mb_kl: list[float] = []
        self.ratio_min, self.ratio_max = math.inf, -math.inf
        self.micro_done = self.micro_skipped = self.minibatch_empty = 0
        self.opt: list[dict[str, float]] = []
        self._cur = [0.0, 0.0, 0.0]

    def start_minibatch(self) -> None:
        self._cur = [0.0, 0.0, 0.0]

    def add(self, stats: dict[str, float]) -> None:
        n = stats["n_tokens"]
        self.tokens += n
        for k in self.counts:
            self.counts[k] += stats[k]
        for k in self.weighted:
            self.weighted[k] += stats[k] * n
        if math.isfinite(stats["ratio_min"]):
            self.ratio_min = min(self.ratio_min, stats["ratio_min"])
            self.ratio_max = max(self.ratio_max, stats["ratio_max"])
        self._cur[0] += stats["loss"]
        self._cur[1] += stats["pg_loss"]
        self._cur[2] += stats.get("kl", 0.0)
        self.micro_done += 1

    def end_minibatch(self) -> None:
        self.mb_losses.append(self._cur[0])
        self.mb_pg.append(self._cur[1])
        self.mb_kl.append(self._cur[2])

    def result(self) -> dict[str, float]:
        nan = float("nan")
        mean = (lambda xs: sum(xs) / len(xs) if xs else nan)  # noqa: E731
        out = {
            "loss/loss": mean(self.mb_losses),
            "loss/pg_loss": mean(self.mb_pg),
            "loss/kl": mean(self.mb_kl),
            "loss/tokens_processed": self.tokens,
            "loss/ratio_min": self.ratio_min if self.tokens else nan,
            "loss/ratio_max": self.ratio_max if self.tokens else nan,
            "loss/micro_done": float(self.micro_done),
            "loss/micro_skipped_zero_adv": float(self.micro_skipped),
            "loss/minibatch_empty": float(self.minibatch_empty),
        }
        for k, v in self.counts.items():
            out[f"loss/{k}"] = v
        c = self.counts
        # per advantage sign, over every update forward: the loss's own ratio and the coupled p_theta / q
        out["loss/clip_pos_frac"] = c["n_clip_pos"] / c["n_pos"] if c["n_pos"] else nan
        out["loss/clip_neg_frac"] = c["n_clip_neg"] / c["n_neg"] if c["n_neg"] else nan
        out["loss/coupled_clip_pos_frac"] = c["n_coupled_clip_pos"] / c["n_pos"] if c["n_pos"] else nan
        out["loss/coupled_clip_neg_frac"] = c["n_coupled_clip_neg"] / c["n_neg"] if c["n_neg"] else nan
        for k, v in self.weighted.items():
            out[f"loss/{k}"] = v / self.tokens if self.tokens else nan
        steps = [o for o in self.opt if not o["skipped"]]
        out["opt/steps"] = float(len(steps))
        out["opt/skipped"] = float(len(self.opt) - len(steps))
        out["opt/grad_norm"] = mean([o["grad_norm"] for o in self.opt])
        out["opt/grad_norm_max"] = max((o["grad_norm"] for o in self.opt), default=nan)
        out["opt/n_changed"] = sum(o["n_changed"] for o in self.opt)
        out["opt/changed_frac"] = mean([o["changed_frac"] for o in steps])
        return out


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
        from qpass.runtime.engine import as_rollout_engine, make_learner_engine, make_rollout_engine

        if cfg.recalibrate and (calibration is None or calibration_model is None):
            raise ValueError("GRPOConfig.recalibrate needs the calibration the rollout was built with and a calibration "
                             "model (qpass grpo --recalibrate needs --calibration CAL)")
        self.calibration, self.calibration_model = calibration, calibration_model
        self._calib_amax: dict[str, torch.Tensor] = {}
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
        from qpass.moe.routing import has_routing

        self.moe = has_routing(rollout.gm)
        if cfg.routing_replay and not self.moe:
            raise ValueError("GRPOConfig.routing_replay needs an MoE model (the rollout graph has no qpass::moe_route node)")
        if self.moe and rollout_engine is not None and cfg.routing_replay:
            raise ValueError(f"routing replay needs the rollout's routes; the {getattr(rollout_engine, 'name', '?')} engine "
                             "does not record them (use the built-in rollout engine)")
        if self.moe and cfg.cuda_graphs == "on":
            raise ValueError("an MoE rollout records its expert routes in Python at every decode step; "
                             "cuda_graphs='on' would replay without them (use 'auto' or 'off')")
        self.graph_ro = make_rollout_engine("qpass", qg=rollout, pad_token_id=int(pad), eos_token_id=self.eos_ids,
                                           cuda_graphs="off" if self.moe else cfg.cuda_graphs)
        self.ro = rollout_engine if rollout_engine is not None else self.graph_ro
        self.route_diag = self.moe and self.ro is self.graph_ro  # routes recorded and compared every step
        self._routes: dict[str, torch.Tensor] | None = None
        self.pad = int(pad)
        self.micro = cfg.micro_batch_size or self.ro.batch_size
        n_rows = cfg.prompts_per_step * cfg.group_size
        n_micro = math.ceil(n_rows / self.micro)
        if cfg.minibatches > n_micro:
            raise ValueError(f"GRPOConfig.minibatches={cfg.minibatches} exceeds the {n_micro} micro-batches of "
                             f"{n_rows} rows (micro_batch_size={self.micro})")
        self.reward = reward_fn if isinstance(reward_fn, SafeReward) else safe_reward(reward_fn or exact_answer_reward)
        self.answer_fn = answer_fn or exact_answer_reward
        opt_kw = dict(lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                      master_dtype=torch.float32 if cfg.master_dtype == "fp32" else None)
        make_opt = getattr(self.le, "make_optimizer", None)
        if make_opt is not None:
            self.opt = make_opt(MasterOptimizer, **opt_kw)
        else:
            self.opt = MasterOptimizer([p for p in self.le.parameters() if p.requires_grad], **opt_kw)
        self.ref = None
        if cfg.loss.beta > 0:
            ref_qg = learner.clone("learner")
            for p in ref_qg.gm.parameters():
                p.requires_grad_(False)
            self.ref = make_learner_engine("qpass", qg=ref_qg)
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
        self.batches = task.train_batches(cfg.prompts_per_step, seed=_seed(cfg.seed, 1) % (2**31))
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
            self._eval_set = ([p.meta for p in probs], self._encode(probs))
        probe_src = list(task.eval[: self.ro.batch_size]) or list(task.train[: self.ro.batch_size])
        self._probe = prompt_batch(self._encode(probe_src), self.ro.batch_size, pad_token_id=self.pad, device=self.ro.device)
        if calibration is not None:
            from qpass.calibration.run import graph_constants

            self._calib_amax = {s: calibration.group_amax(s) for s in calibration.amax if s in rollout.sites}
            self._calib_amax.update(graph_constants(rollout)[0])  # what the static sites quantize with

    # ------------------------------------------------------------------ helpers
    @property
    def device(self) -> torch.device:
        return self.ro.device

    def _encode(self, problems: Sequence[Any]) -> list[list[int]]:
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

    def _sample(self, rows: list[list[int]], step: int) -> tuple[Experience, float]:
        import contextlib

        from qpass.moe.routing import assemble_routes, generate_routes, record_routes

        cfg = self.cfg
        chunks, routes = [], []
        t0 = time.perf_counter()
        for c, start in enumerate(range(0, len(rows), self.ro.batch_size)):
            with (record_routes() if self.route_diag else contextlib.nullcontext()) as tape:
                b = self.ro.generate(rows[start:start + self.ro.batch_size], max_new_tokens=cfg.max_new_tokens,
                                     temperature=cfg.temperature, top_p=cfg.top_p, seed=_seed(cfg.seed, step, c))
            chunks.append(b)
            if tape is not None:
                routes.append(generate_routes(tape.records, batch_size=int(b.input_ids.shape[0]), prompt_len=int(b.prompt_len),
                                              seq_len=int(b.input_ids.shape[1])))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        exp = assemble(chunks, pad_token_id=self.pad, eos_token_ids=self.eos_ids, max_new_tokens=cfg.max_new_tokens)
        self._routes = (assemble_routes(routes, chunks, prompt_len=exp.prompt_len, width=exp.response_width)
                        if self.route_diag else None)
        return exp, wall

    def _route_scope(self, idx: torch.Tensor, *, own: bool = False) -> Any:
        """The routing context of a learner forward over rows ``idx`` (MoE): the rollout's routes
        replayed (``routing_replay``), or with ``own`` the learner's own routes recorded; a null
        context otherwise. The tape's ``records`` then hold the learner's own choices."""
        import contextlib

        from qpass.moe.routing import record_routes, replay_routes

        if self._routes is None:
            return contextlib.nullcontext(None)
        if self.cfg.routing_replay:
            i = idx.cpu()
            return replay_routes({ly: r[i].reshape(-1, r.shape[-1]) for ly, r in self._routes.items()}, keep_own=own)
        return record_routes() if own else contextlib.nullcontext(None)

    def _routing_row(self, own: list[dict[str, list[torch.Tensor]]], exp: Experience) -> dict[str, Any]:
        """``routing/...`` of one step: per-layer fraction of valid positions whose top-k expert set
        differs between the rollout's recorded routes and the learner's own (proximal pass)."""
        from qpass.moe.routing import routing_mismatch

        assert self._routes is not None
        learner = {ly: torch.cat([c for rec in own for c in rec.get(ly, [])]).cpu() for ly in self._routes}
        rollout = {ly: r.reshape(-1, r.shape[-1]) for ly, r in self._routes.items()}
        per = routing_mismatch(rollout, learner, exp.attention_mask.bool().reshape(-1).cpu())
        vals = [m["mismatch"] for m in per.values() if m["tokens"]]
        return {"routing/replay": bool(self.cfg.routing_replay), "routing/layers": len(per),
                "routing/tokens": max((m["tokens"] for m in per.values()), default=0),
                "routing/mismatch_mean": sum(vals) / len(vals) if vals else float("nan"),
                "routing/mismatch_max": max(vals) if vals else float("nan"),
                "routing/mismatch_per_layer": {ly: m["mismatch"] for ly, m in sorted(per.items())}}

    @torch.no_grad()
    def _score(self, module: torch.nn.Module, exp: Experience, micro: list[torch.Tensor], entropy: bool,
               own_routes: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) of every row, micro-batch by micro-batch; ``own_routes`` (a list)
        receives each micro-batch's recording of the learner's own MoE routes."""
        lps, ents = [], []
        for idx in micro:
            with self._route_scope(idx, own=own_routes is not None) as tape:
                lp, ent = response_logprobs(module, exp.select(idx), temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                            with_entropy=entropy)
            if own_routes is not None and tape is not None:
                own_routes.append(tape.records)
            lps.append(lp)
            ents.append(ent)
        return torch.cat(lps), (torch.cat(ents) if entropy else None)

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
            served = self._served_checks(self.le.export_weights())
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

    def _mirror(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy an external learner's exported weights into the learner graph (see ``learner_engine``)."""
        from qpass.errors import QpassError
        from qpass.graph.capture import site_of

        params = dict(self.learner_qg.gm.named_parameters(remove_duplicate=False))
        missing = sorted(site_of(a) for a in params if site_of(a) not in weights)
        if missing:
            raise QpassError(f"learner engine {self.le.name}: export_weights() lacks {len(missing)} weight(s), e.g. {missing[:3]}")
        with torch.no_grad():
            for a, p in params.items():
                p.copy_(weights[site_of(a)].to(device=p.device, dtype=p.dtype))

    def _served_checks(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Bit-level parity through the engine protocols: served bytes vs qpass's quantizer of the
        exported weights, and vs the external learner's own fake-quant bytes."""
        from qpass.parity.served import check_learner_bytes, check_served_weights

        served = self.ro.served_weights()
        chk = check_served_weights(weights, served)
        row: dict[str, Any] = {"parity/served_ok": chk.ok, "parity/served_checked": chk.checked,
                               "parity/served_mismatches": list(chk.mismatches[:5])}
        sites = getattr(self.le, "fake_quant_sites", None)
        if sites is not None and self.aligned:
            lb = check_learner_bytes(sites(), served)
            row.update({"parity/learner_bytes_ok": lb.ok, "parity/learner_bytes_checked": lb.checked,
                        "parity/learner_bytes_mismatches": list(lb.mismatches[:5])})
        return row

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
                       temperature=cfg.eval_temperature, seed=_seed(cfg.seed, 7, step), answer_fn=self.answer_fn)
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

    # ------------------------------------------------------------------ update
    def _update(self, exp: Experience, adv: torch.Tensor, lprox: torch.Tensor, lref: torch.Tensor | None,
                micro: list[torch.Tensor], step: int) -> tuple[dict[str, float], list[tuple[torch.Tensor, torch.Tensor]]]:
        cfg = self.cfg
        agg = _LossAgg()
        forwards: list[tuple[torch.Tensor, torch.Tensor]] = []
        gen = torch.Generator().manual_seed(_seed(cfg.seed, step, 3) % (2**63))
        n_mb = len(micro)
        mask = exp.response_mask
        first_dev = None
        for epoch in range(cfg.ppo_epochs):
            order = list(range(n_mb)) if epoch == 0 else torch.randperm(n_mb, generator=gen).tolist()
            sizes = [n_mb // cfg.minibatches + (1 if i < n_mb % cfg.minibatches else 0) for i in range(cfg.minibatches)]
            start = 0
            for g, size in enumerate(sizes):
                group = order[start:start + size]
                start += size
                rows = torch.cat([micro[j] for j in group])
                valid = mask[rows.to(mask.device)]
                norm = float(valid.sum()) if cfg.loss.agg == "token_mean" else float((valid.sum(-1) > 0).sum())
                if norm == 0:
                    agg.minibatch_empty += 1
                    continue
                self.opt.zero_grad()
                agg.start_minibatch()
                did = False
                # the step's store: the first minibatch reuses the proximal pass's QDQ, later micro-batches of a
                # minibatch the first one's; opt.step (outside the block) bumps the versions, so it invalidates
                with reuse_weight_quantization(self.quant_reuse):
                    for j in group:
                        idx = micro[j].to(mask.device)
                        sub = exp.select(idx)
                        if not bool(sub.response_mask.any()) or (cfg.loss.beta == 0 and not bool((adv[idx] != 0).any())):
                            agg.micro_skipped += 1
                            continue
                        with self._route_scope(idx):
                            logp, _ = response_logprobs(self.le, sub, temperature=cfg.temperature, top_p=cfg.top_p)
                        out = grpo_loss(logp, lprox[idx], sub.logq, adv[idx], sub.response_mask, cfg.loss,
                                        logp_ref=None if lref is None else lref[idx], normalizer=norm)
                        out.loss.backward()
                        did = True
                        agg.add(out.stats)
                        forwards.append((idx, logp.detach()))
                        if epoch == 0 and g == 0:
                            with torch.no_grad():
                                d = torch.where(sub.response_mask, (logp.detach() - lprox[idx]).abs(), torch.zeros_like(logp))
                                d = torch.nan_to_num(d, nan=math.inf)
                                first_dev = max(first_dev or 0.0, float(d.max()))
                if did:
                    agg.end_minibatch()
                    agg.opt.append(self.opt.step(cfg.grad_clip))
        res = agg.result()
        res["check/first_minibatch_ratio_maxdev"] = first_dev if first_dev is not None else float("nan")
        res["check/first_minibatch_ratio_exact"] = (first_dev == 0.0) if first_dev is not None else None
        return res, forwards

    def _disagreement(self, forwards: list[tuple[torch.Tensor, torch.Tensor]], exp: Experience, adv: torch.Tensor,
                      lshadow: torch.Tensor) -> Any:
        """Clip-branch disagreement of ``p_theta / q`` vs ``p_theta / q_bf16`` over every update forward.

        ``p_theta`` is the learner's log-prob of each token at each forward of the update (all
        epochs and minibatches, a token counted once per forward); ``q`` the quantized rollout's,
        ``q_bf16`` the BF16 shadow engine's, on the same tokens; split by advantage sign
        (:func:`qpass.diagnostics.clip_branch_disagreement`, the loss's ``eps_low`` / ``eps_high``).
        """
        mask = exp.response_mask
        if forwards:
            idx = torch.cat([i for i, _ in forwards])
            lp = torch.cat([l for _, l in forwards]).double()
        else:  # no update ran: the ratios at p_theta = p_prox are not available; report on no tokens
            idx = torch.zeros(0, dtype=torch.long, device=mask.device)
            lp = torch.zeros(0, mask.shape[1], dtype=torch.float64, device=mask.device)
        return clip_branch_disagreement(torch.exp(lp - exp.logq[idx].double()), torch.exp(lp - lshadow[idx].double()),
                                        adv[idx], mask[idx], self.cfg.loss.eps_low, self.cfg.loss.eps_high)

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
        from qpass.parity.checker import check_weights_bitexact

        cfg = self.cfg
        t_step = time.perf_counter()
        s = self.step_idx + 1
        g = cfg.group_size
        row: dict[str, Any] = {"step": s}

        # 1. sample
        problems = next(self.batches)
        prompts = self._encode(problems)
        rows = [ids for ids in prompts for _ in range(g)]
        metas = [p.meta for p in problems for _ in range(g)]
        if self.calibration is not None:
            from qpass.quant.observe import observe_input_amax

            with observe_input_amax() as tape:
                exp, t_roll = self._sample(rows, s)
            row.update(self._staleness(tape))
        else:
            exp, t_roll = self._sample(rows, s)
        n_sampled = int(exp.sampled_mask.sum())
        row.update({"time/rollout_s": t_roll, "rollout/n_tokens": n_sampled,
                    "rollout/tokens_per_s": n_sampled / t_roll if t_roll > 0 else float("nan"),
                    "rollout/decode_graph": getattr(getattr(self.ro, "decode", None), "status", "n/a")})

        # 2. rewards and advantages
        texts = decode_responses(self.tokenizer, exp)
        before = self.reward.stats()
        rewards = torch.tensor([self.reward(m, x) for m, x in zip(metas, texts)], dtype=torch.float64)
        after = self.reward.stats()
        adv64 = group_advantages(rewards, group_size=g)
        adv = adv64.float().to(self.device)
        correct = [self.answer_fn(m, x) >= 1.0 for m, x in zip(metas, texts)]
        zero_groups = int((rewards.view(-1, g).amax(-1) == rewards.view(-1, g).amin(-1)).sum())
        row.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/max": float(rewards.max()), "reward/correct_frac": sum(correct) / len(correct),
            **{k + "_step": after[k] - before[k] for k in ("reward/n_failures", "reward/n_exceptions", "reward/n_nonfinite",
                                                             "reward/n_bad_type", "reward/n_empty")},
            "adv/zero_groups": zero_groups, "adv/zero_group_frac": zero_groups / cfg.prompts_per_step,
            "adv/abs_mean": float(adv64.abs().mean()),
        })
        if cfg.mask_truncated:
            exp.response_mask = exp.response_mask & exp.finished.unsqueeze(-1)
        mask = exp.response_mask
        row.update({
            "resp/len_mean": float(exp.sampled_mask.sum(-1).float().mean()),
            "resp/finished_frac": float(exp.finished.float().mean()),
            "resp/empty_text_frac": sum(1 for x in texts if not x.strip()) / len(texts),
            "resp/n_loss_tokens": int(mask.sum()),
            "resp/n_all_masked": int((mask.sum(-1) == 0).sum()),
        })

        # 3. proximal (and reference) log-probs, before any update
        t0 = time.perf_counter()
        micro = micro_batches(exp.n, self.micro)
        own: list | None = [] if self._routes is not None else None
        with reuse_weight_quantization(self.quant_reuse):  # same weights: each site's QDQ once for all micro-batches
            lprox, ent = self._score(self.le, exp, micro, entropy=True, own_routes=own)
            lref = self._score(self.ref, exp, micro, entropy=False)[0] if self.ref is not None else None
        row["time/prox_s"] = time.perf_counter() - t0
        if own is not None:
            row.update(self._routing_row(own, exp))
        n_valid = int(mask.sum())
        row["entropy/token_mean"] = float(torch.where(mask, ent, torch.zeros_like(ent)).sum()) / n_valid if n_valid else float("nan")
        gap = mismatch_metrics(lprox, exp.logq, mask, ess_cap=cfg.ess_cap)
        row.update(gap.to_dict("gap/"))
        with torch.no_grad():
            c = torch.exp(torch.where(mask, lprox.double() - exp.logq.double(), torch.zeros_like(lprox, dtype=torch.float64)))
            cbar, affected = correction_weights(c, cfg.loss.correction)
            row["corr/affected_frac"] = float((affected & mask).sum()) / n_valid if n_valid else float("nan")

        # BF16 shadow: a BF16 rollout engine scoring the same sampled tokens
        lshadow = None
        if self.shadow is not None:
            t0 = time.perf_counter()
            with reuse_weight_quantization(self.quant_reuse):
                self.shadow.update_weights(shadow_weights(self.learner_qg, self.le.export_weights(), mode=cfg.shadow_weights))
            lshadow = score_sampled(self.shadow, exp, self.ro.batch_size, temperature=cfg.temperature, top_p=cfg.top_p)
            row.update(mismatch_metrics(lshadow, exp.logq, mask, ess_cap=cfg.ess_cap).to_dict("shadow_gap/"))
            row.update(mismatch_metrics(lprox, lshadow, mask, ess_cap=cfg.ess_cap).to_dict("prox_shadow_gap/"))
            row["time/shadow_s"] = time.perf_counter() - t0

        # 4. update
        t0 = time.perf_counter()
        upd, forwards = self._update(exp, adv, lprox, lref, micro, s)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        row.update(upd)
        row["time/update_s"] = time.perf_counter() - t0
        # cost (same process, same card): the learner's seconds of this step, and running totals over the run
        row["time/learner_s"] = row["time/prox_s"] + row["time/update_s"]
        prev = self.history["metrics"][-1] if self.history["metrics"] else {}
        row["time/rollout_s_cum"] = float(prev.get("time/rollout_s_cum") or 0.0) + row["time/rollout_s"]
        row["time/learner_s_cum"] = float(prev.get("time/learner_s_cum") or 0.0) + row["time/learner_s"]
        row["rollout/n_tokens_cum"] = int(prev.get("rollout/n_tokens_cum") or 0) + row["rollout/n_tokens"]
        if lshadow is not None:
            row.update(self._disagreement(forwards, exp, adv, lshadow).to_dict("clip/"))

        # 5. sync and verify
        t0 = time.perf_counter()
        masters = self.le.export_weights()
        if self.external:
            self._mirror(masters)
        with reuse_weight_quantization(self.quant_reuse):  # the sync's quantization, reused by the verification
            rep = self.graph_ro.update_weights(masters)
            row.update({"parity/sync_copied": rep.copied, "parity/sync_requantized": rep.requantized,
                        "time/sync_s": time.perf_counter() - t0})
            engine_failure = self._sync_engine(masters, row) if self.ro is not self.graph_ro else None
            t0 = time.perf_counter()
            ver = verify_sync(self.learner_qg, self.rollout_qg, rep.fingerprints)
        self.quant_reuse.clear()  # the full bit-exact check below and the next step quantize afresh
        row.update(ver.to_dict("parity/"))
        failures: list[str] = [] if ver.ok else [f"sync fingerprints: {ver.mismatches[:3]}"]
        if engine_failure:
            failures.append(engine_failure)
        run_full = self.aligned and (final or (cfg.bitexact_every and s % cfg.bitexact_every == 0))
        if run_full:
            br = check_weights_bitexact(self.learner_qg, self.rollout_qg)
            row.update({"parity/bitexact_ok": br.ok, "parity/bitexact_groups": len(br.groups),
                        "parity/bitexact_failures": br.failures()[:5]})
            if not br.ok:
                failures.append(f"bit-exact: {br.failures()[:3]}")
        if self.external:
            sv = self._served_checks(masters)
            row.update(sv)
            if not sv["parity/served_ok"]:
                failures.append(f"served bytes vs exported weights: {sv['parity/served_mismatches'][:3]}")
            if not sv.get("parity/learner_bytes_ok", True):
                failures.append(f"served bytes vs learner fake-quant bytes: {sv['parity/learner_bytes_mismatches'][:3]}")
        row["time/verify_s"] = time.perf_counter() - t0
        if cfg.recalibrate:
            row.update(self._recalibrate(masters))
        del masters

        # update visibility
        t0 = time.perf_counter()
        snap = snapshot_rollout_constants(self.rollout_qg)
        row.update({f"vis/{k}": v for k, v in byte_visibility(self.snapshot, snap).items()})
        diag = cfg.diag_every and (final or s % cfg.diag_every == 0)
        if diag and snap.nvfp4:
            row["vis/value_frac"] = update_visibility_groups(self.snapshot.nvfp4_tensors(), snap.nvfp4_tensors()).total.value_frac
        self.snapshot = snap
        row["time/visibility_s"] = time.perf_counter() - t0

        # 6. periodic diagnostics
        if diag:
            row.update(self._layerwise(s))
        if self._eval_set is not None and (final or s % cfg.eval_every == 0):
            row.update(self._eval(s))
        self.step_idx = s
        self._final_done = bool(final)
        row["time/step_s"] = time.perf_counter() - t_step
        row["time/step_s_cum"] = float(prev.get("time/step_s_cum") or 0.0) + row["time/step_s"]
        self._write("metrics", row)
        if failures:
            self._parity_failure(f"step {s}: " + "; ".join(failures))
        return row

    def _staleness(self, tape: Any) -> dict[str, Any]:
        """The ``calib/`` staleness keys of one sampling (module docstring)."""
        from qpass.calibration.run import staleness

        st = staleness(tape.amax, self._calib_amax)
        return {"calib/sites": st["sites"], "calib/amax_ratio_max": st["ratio_max"], "calib/amax_ratio_median": st["ratio_median"],
                "calib/amax_ratio_min": st["ratio_min"], "calib/sites_over": st["sites_over"], "calib/worst_site": st["worst_site"]}

    def _recalibrate(self, masters: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Re-calibrate the rollout graph's static constants from ``masters`` (``cfg.recalibrate``)."""
        from qpass.calibration.run import graph_constants, load_masters, recalibrate

        t0 = time.perf_counter()
        load_masters(self.calibration_model, masters)
        rep = recalibrate(self.rollout_qg, self.calibration_model, self.calibration.token_ids)
        self._calib_amax = {s: a for s, a in rep["group_amax"].items()}
        self._calib_amax.update(graph_constants(self.rollout_qg)[0])
        self._recalibrated_since_load = True
        return {"calib/recalibrated": True, "calib/amax_change_max": rep["amax_change_max"],
                "calib/rac_channels_changed": rep["rac_channels_changed"], "time/recalibrate_s": time.perf_counter() - t0}

    def _sync_engine(self, masters: dict[str, torch.Tensor], row: dict[str, Any]) -> str | None:
        """Update the live rollout engine from ``masters`` and compare the bytes it serves with qpass's
        quantizer of them (:func:`qpass.parity.served.check_served_weights`). Returns a failure or None."""
        from qpass.parity.served import check_served_weights

        t0 = time.perf_counter()
        self.ro.update_weights(masters)
        row["time/engine_sync_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        chk = check_served_weights(masters, self.ro.served_weights())
        row.update({"parity/engine": self.ro.name, "parity/engine_bitexact_ok": chk.ok, "parity/engine_sites": chk.checked,
                    "parity/engine_mismatches": list(chk.mismatches[:5]), "time/engine_verify_s": time.perf_counter() - t0})
        return None if chk.ok else f"{self.ro.name} engine serves other bytes than qpass's quantizer: {chk.mismatches[:3]}"

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
            self._recalibrate(self.le.export_weights())  # resumed: what the last step's re-calibration had produced
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
