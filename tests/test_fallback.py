"""torch.export fails inside one module: capture falls back on it per module, with the reason reported."""

from __future__ import annotations

import types

import torch

from qpass.apps.apply import uncaptured_linears
from qpass.runtime import TorchLearner, sync_weights
from qpass.graph.model import LoadedModel
from qpass.parity.checker import check_weights_bitexact
from qpass.pipeline import Pipeline
from qpass.recipe import load_recipe
from qpass.sampling import positions_from_mask

from .conftest import tiny_llama


def _data_dependent_mlp(model: torch.nn.Module) -> None:
    """Layer 1's MLP branches on a tensor value: torch.export cannot trace that."""
    mlp = model.model.layers[1].mlp
    orig = type(mlp).forward

    def forward(self, x):
        y = orig(self, x)
        if bool(y.float().abs().sum() > 0):  # data-dependent Python branch
            return y
        return y * 2

    mlp.forward = types.MethodType(forward, mlp)


def test_export_failure_falls_back_on_the_module_and_reports_it():
    model = tiny_llama(seed=3)
    _data_dependent_mlp(model)
    pipe = Pipeline.prepare(loaded=LoadedModel(model, None, "tiny-branchy", "test"), batch_size=2, max_len=24)
    (op,) = pipe.base_scoring.captured.opaque
    assert op.name == "model.layers.1.mlp" and op.reason
    assert [o.name for o in pipe.base_step.captured.opaque] == ["model.layers.1.mlp"]
    # the MLP's three linears are not sites, and say why; everything else is
    sites = pipe.base_scoring.sites
    assert "model.layers.1.mlp.up_proj" not in sites and "model.layers.0.mlp.up_proj" in sites and len(sites) == 15 - 3
    unc = uncaptured_linears(model, sites, pipe.base_scoring.captured.opaque)
    assert {u["module"] for u in unc} == {f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    assert all("opaque node because torch.export failed" in u["reason"] for u in unc)
    # the captured graph computes what the eager model computes
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=am, position_ids=positions_from_mask(am), use_cache=False).logits
        got = pipe.base_scoring.gm(ids, am, positions_from_mask(am))
    assert torch.equal(got, want)
    # a recipe still applies to the other sites; the opaque module trains and syncs like any parameter
    learner, rollout = pipe.build(load_recipe("quads_nvfp4"))
    assert learner.history[0].matches == 11 and rollout.history[0].matches == 11
    le = TorchLearner(learner)
    le.token_logprobs(ids, am).sum().backward()
    w = learner.attr("model.model.layers.1.mlp.up_proj.weight")
    assert w.grad is not None and w.grad.abs().sum() > 0
    with torch.no_grad():
        w.add_(torch.sign(w.grad), alpha=-0.01)
    sync_weights(learner, rollout)
    assert torch.equal(rollout.attr("model.model.layers.1.mlp.up_proj.weight"), w)
    assert check_weights_bitexact(learner, rollout).ok
