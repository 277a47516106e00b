"""The sweep's arms run in ``qpass grpo``: the RL-time operand-ablation recipes, FP8, TIS / MIS /
decoupled corrections, and MoE GRPO with the routing-mismatch diagnostic and routing replay."""

from __future__ import annotations

import types

import pytest
import torch

from qpass.apps.grpo.cli import _grpo_config, build_grpo_parser
from qpass.apps.grpo.sweep import ARMS
from tests.test_grpo import FakeTok, tiny_cfg, tiny_trainer  # noqa: F401


def _cfg_of_arm(name: str, **over):
    a = build_grpo_parser().parse_args(["--recipe", ARMS[name].recipe, "--out", "x", *ARMS[name].flags])
    cfg = _grpo_config(a, 1, None)
    base = tiny_cfg(steps=1, eval_every=0, diag_every=0, bitexact_every=1, loss=cfg.loss,
                    routing_replay=cfg.routing_replay, **over)
    return base


@pytest.mark.parametrize("arm", ["w16a4_rollout", pytest.param("w4a16_rollout", marks=pytest.mark.slow),
                                 pytest.param("fp8_block", marks=pytest.mark.slow),
                                 pytest.param("naive_decoupled", marks=pytest.mark.slow), "naive_tis",
                                 pytest.param("naive_mis", marks=pytest.mark.slow)])
def test_dense_arm_runs_a_step(tiny_pipeline, arm):
    cfg = _cfg_of_arm(arm)
    row = tiny_trainer(tiny_pipeline, ARMS[arm].recipe, cfg).step(final=True)
    assert row["parity/fp_ok"] is True and row["gap/token/g_abs"] > 0  # a quantized rollout: a nonzero gap
    kind = {"naive_tis": "tis", "naive_mis": "mis"}.get(arm, "none")
    assert cfg.loss.correction.kind == kind
    if arm.startswith("naive_"):
        assert cfg.loss.ratio == "decoupled"
    assert 0.0 <= row["corr/affected_frac"] <= 1.0
    assert "routing/mismatch_mean" not in row  # a dense model has no router


def test_arm_flags_win_over_the_common_flags():
    """`-- --ratio coupled` for every job must not turn the TIS arm's decoupled objective off."""
    from pathlib import Path

    from qpass.apps.grpo.sweep import plan_jobs

    job = plan_jobs([ARMS["naive_tis"]], [0], "default")[0]
    argv = job.argv(Path("S"), steps=2, device="cpu", kernels="reference", threads=1, checkpoint_every=10, total_time_s=60,
                    extra=["--ratio", "coupled", "--correction", "none"])
    a = build_grpo_parser().parse_args(argv)
    assert (a.ratio, a.correction) == ("decoupled", "tis")


def test_assemble_routes_layout():
    from qpass.moe.routing import assemble_routes

    # chunk 0: B = 2 rows (1 real), P = 2, response width 2 -> T = 4; chunk 1: B = 2 (2 real), P = 3, width 1 -> T = 4
    r0 = torch.arange(2 * 4 * 1).reshape(8, 1)
    r1 = 100 + torch.arange(2 * 4 * 1).reshape(8, 1)
    b0 = types.SimpleNamespace(input_ids=torch.zeros(2, 4), prompt_len=2, n_real=1)
    b1 = types.SimpleNamespace(input_ids=torch.zeros(2, 4), prompt_len=3, n_real=2)
    out = assemble_routes([{"layers.0": r0}, {"layers.0": r1}], [b0, b1], prompt_len=3, width=3)["layers.0"]
    assert out.shape == (3, 6, 1)
    assert out[0, :, 0].tolist() == [-1, 0, 1, 2, 3, -1]  # one left pad (P 2 -> 3), right pad to width 3
    assert out[1, :, 0].tolist() == [100, 101, 102, 103, -1, -1]
    assert out[2, :, 0].tolist() == [104, 105, 106, 107, -1, -1]


@pytest.fixture(scope="module")
def moe_pipe():
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline
    from tests.test_moe import tiny_moe

    return Pipeline.prepare(loaded=LoadedModel(model=tiny_moe("mixtral", vocab=256), tokenizer=None, name="tiny-mixtral",
                                               source="random"), batch_size=4, max_len=32)


@pytest.mark.slow  # ~1 min: two MoE GRPO steps on CPU
def test_moe_grpo_logs_routing_mismatch_and_replays_routes(moe_pipe):
    rows = {}
    for replay in (False, True):
        cfg = tiny_cfg(steps=1, eval_every=0, diag_every=0, bitexact_every=1, routing_replay=replay, shadow=False)
        tr = tiny_trainer(moe_pipe, "quads_nvfp4_moe", cfg)
        assert tr.moe and tr.route_diag and tr.graph_ro.decode.mode == "off"
        rows[replay] = tr.step(final=True)
        routes = tr.last_sampled.routes
        assert set(routes) == {"layers.0", "layers.1"} and routes["layers.0"].shape[-1] == 2  # top-2
    off, on = rows[False], rows[True]
    for r in (off, on):
        assert 0.0 <= r["routing/mismatch_mean"] <= r["routing/mismatch_max"] <= 1.0 and r["routing/layers"] == 2
        assert set(r["routing/mismatch_per_layer"]) == {"layers.0", "layers.1"}
    assert off["routing/replay"] is False and on["routing/replay"] is True
    # the same rollout (the replay changes only the learner) ...
    assert off["rollout/n_tokens"] == on["rollout/n_tokens"] and off["reward/mean"] == on["reward/mean"]
    # the first MoE layer's input does not depend on any routing: the learner's own routes there are the same with
    # and without replay; deeper layers see the replayed routes upstream, so their own choices may change
    assert off["routing/mismatch_per_layer"]["layers.0"] == on["routing/mismatch_per_layer"]["layers.0"]
    # ... and the replay changes the learner's log-probs wherever a route differed
    if off["routing/mismatch_mean"] > 0:
        assert off["gap/token/g_abs"] != on["gap/token/g_abs"]


def test_moe_replay_refusals(tiny_pipeline, moe_pipe):
    with pytest.raises(ValueError, match="routing_replay needs an MoE model"):
        tiny_trainer(tiny_pipeline, "naive_nvfp4", tiny_cfg(routing_replay=True, shadow=False))
    with pytest.raises(ValueError, match="cuda_graphs='on' would replay without them"):
        tiny_trainer(moe_pipe, "naive_nvfp4", tiny_cfg(cuda_graphs="on", shadow=False))


def test_cli_refuses_routing_replay_on_the_dense_default_model_before_loading(tmp_path, capsys, monkeypatch):
    import qpass.graph.model as gm
    from qpass.apps.grpo.cli import main

    monkeypatch.setattr(gm, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert main(["grpo", "--recipe", "quads_nvfp4", "--out", str(tmp_path / "r"), "--routing-replay", "on"]) == 2
    assert "--routing-replay on needs an MoE model" in capsys.readouterr().err
    assert main(["grpo", "--recipe", "quads_nvfp4", "--out", str(tmp_path / "r"), "--kernel-tiles", "fast"]) == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err
