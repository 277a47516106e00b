"""The main job's building blocks: load a model, capture both graphs once, apply a recipe's passes.

    pipe = Pipeline.prepare("default", batch_size=16, max_len=96)
    learner, rollout = pipe.build(load_recipe("quads_nvfp4"))
    # learner: QGraph(kind="scoring", side="learner"); rollout: QGraph(kind="step", side="rollout")

Each :meth:`Pipeline.build` clones the captured base graphs (own parameters and buffers) and runs
the recipe's learner and rollout pass lists through the :class:`qpass.compiler.manager.PassManager`, so several
recipes can be built from one capture (the base graphs stay untouched and serve as the BF16
engine-drift floor).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from qpass.errors import CaptureError
from qpass.graph.capture import capture_scoring, capture_step
from qpass.graph.model import LoadedModel, load_model
from qpass.graph.qgraph import QGraph
from qpass.moe.experts import prepare_moe
from qpass.ops import current_backend
from qpass.compiler.manager import PassContext, PassManager
from qpass.compiler.recipe import Recipe, check_site_globs
from qpass.tables import check_kernels

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


@dataclasses.dataclass
class Pipeline:
    """A loaded model and its two captured base graphs.

    Attributes:
        loaded: model + tokenizer.
        base_scoring: captured scoring graph (side ``base``; shares parameters with the model).
        base_step: captured step graph with a static KV cache of ``max_len`` for ``batch_size`` rows.
        timings: seconds spent loading and capturing.
    """

    loaded: LoadedModel
    base_scoring: QGraph
    base_step: QGraph
    timings: dict[str, float]

    @classmethod
    def prepare(
        cls,
        model: str = "default",
        *,
        dtype: str | torch.dtype = "bf16",
        device: str = "cpu",
        batch_size: int = 16,
        max_len: int = 96,
        loaded: LoadedModel | None = None,
    ) -> "Pipeline":
        """Load ``model`` (unless ``loaded`` is given) and capture the scoring and step graphs."""
        from qpass.progress import phase

        dt = DTYPES[dtype] if isinstance(dtype, str) else dtype
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        with phase("load the model and capture both graphs (torch.export)", total=2 if loaded else 3, unit="step") as ph:
            lm = loaded or load_model(model, dtype=dt, device=device)
            prepare_moe(lm.model)  # per-expert sites + routing op (no-op for dense or prepared models)
            timings["load_s"] = time.perf_counter() - t0
            if loaded is None:
                ph.advance(note=f"{lm.name} loaded")
            sc = QGraph.from_capture(capture_scoring(lm.model))
            if not sc.sites:
                raise CaptureError(
                    f"{lm.name}: the captured graph has no linear projection (aten.linear with a weight parameter); "
                    "qpass quantizes linear layers, so there is nothing to do"
                )
            ph.advance(note="scoring graph captured")
            st = QGraph.from_capture(capture_step(lm.model, batch_size=batch_size, max_len=max_len, opaque=sc.captured.opaque))
            ph.advance(note="step graph captured")
        timings["capture_scoring_s"], timings["capture_step_s"] = sc.captured.export_s, st.captured.export_s
        return cls(lm, sc, st, timings)

    def build(
        self,
        recipe: Recipe,
        *,
        debug: bool = True,
        reproducer_dir: Path | None = None,
        calibration: object | None = None,
        kernels: str | None = None,
    ) -> tuple[QGraph, QGraph]:
        """Clone the base graphs and apply ``recipe`` (learner passes, then rollout passes).

        Args:
            kernels: the kernel backend the rollout will run on (default: the current one,
                :func:`qpass.ops.current_backend`); every rollout op must have a kernel there.
        Raises:
            RecipeError: a pass's ``targets``/``exclude`` pattern matches no captured site (checked
                before any pass runs, see :func:`qpass.compiler.recipe.check_site_globs`); see also
                :meth:`qpass.compiler.manager.PassManager.run`.
            PassError (and subclasses): see :meth:`qpass.compiler.manager.PassManager.run`.
            KernelMissingError: a lowered site's op has no kernel on ``kernels`` (names the site,
                op, spec and backend), or a static activation scale the backend's kernel lacks —
                never a silent fallback at run time.
        """
        kw = {"debug": debug, "reproducer_dir": reproducer_dir, "calibration": calibration, "kernels": kernels}
        learner = self.build_side(recipe, "learner", **kw)
        rollout = self.build_side(recipe, "rollout", **kw)
        return learner, rollout

    def build_side(
        self,
        recipe: Recipe,
        side: str,
        *,
        share_params: bool = False,
        debug: bool = True,
        reproducer_dir: Path | None = None,
        calibration: object | None = None,
        kernels: str | None = None,
    ) -> QGraph:
        """One side of :meth:`build`: clone the base graph of ``side`` (``learner``: the scoring
        graph, ``rollout``: the step graph) and run that side's pass list of ``recipe``.

        With ``share_params`` the clone shares the base graph's parameters (for callers that never
        train and build many configurations, e.g. ``qpass study``: no pass writes a parameter;
        lowering passes add constants and drop parameters from the clone only) and the learner's
        parameters keep their ``requires_grad``; otherwise the learner clone's own parameters
        require grad. Buffers (the static KV cache) are always the clone's own.

        Raises:
            ValueError: ``side`` is neither ``learner`` nor ``rollout``.
            RecipeError: a pass's ``targets``/``exclude`` pattern matches no captured site (checked
                before any pass runs, see :func:`qpass.compiler.recipe.check_site_globs`).
            PassError (and subclasses): see :meth:`qpass.compiler.manager.PassManager.run`.
            KernelMissingError: (rollout) a lowered site's op has no kernel on ``kernels`` (default:
                the current backend), as in :meth:`build`.
        """
        if side not in ("learner", "rollout"):
            raise ValueError(f"side must be 'learner' or 'rollout', got {side!r}")
        check_site_globs(recipe, list(dict.fromkeys([*self.base_scoring.sites, *self.base_step.sites])), self.loaded.name)
        ctx = PassContext(debug=debug, reproducer_dir=reproducer_dir, calibration=calibration, recipe_path=recipe.path)
        base = self.base_scoring if side == "learner" else self.base_step
        qg = base.clone(side, share_params=share_params)
        if side == "learner" and not share_params:
            for p in qg.gm.parameters():
                p.requires_grad_(True)
        PassManager(recipe.learner if side == "learner" else recipe.rollout, side=side).run(qg, ctx)
        if side == "rollout":
            backend = kernels or current_backend()
            check_kernels(((r.op, r.spec, r.site) for r in qg.quant.values() if r.lowered), backend)
            from qpass.ops import static_act_kernel_check

            for r in qg.quant.values():
                if r.lowered and getattr(r.act_spec, "global_source", "dynamic") == "static":
                    static_act_kernel_check(backend, r.site)
        return qg

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.loaded.tokenizer
