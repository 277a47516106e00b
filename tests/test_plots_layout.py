"""Plots a user looks at in the first hour: nothing overlaps, one-point runs are framed, RAC marks are readable.

* GRPO curves (``qpass grpo`` / ``qpass grpo-plot``): the figure title sits above the first row's
  panel titles; a panel of one step gets one step of room either side and its value printed; a
  constant series gets a visible y range; log panels carry plain, non-colliding tick labels.
* RAC heatmap (``qpass apply``): the compensated channels are one strip of exactly that many red
  cells (not a marker on every channel), and the per-channel norm's tick labels do not collide.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")


def _run(tmp_path, name, rows, evals=()):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (d / "config.json").write_text(json.dumps({"recipe": name}))
    return d


def _bbox(artist, renderer):
    return artist.get_window_extent(renderer)


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_grpo_figure_title_is_above_every_panel_title(tmp_path):
    from qpass.apps.grpo.plots import runs_figure

    rows = [{"step": s, "gap/token/g_abs": 0.4 / s, "gap/max_abs": 2.0 + s, "reward/mean": 0.1 * s} for s in (1, 2, 3)]
    fig = runs_figure([_run(tmp_path, "quads_nvfp4", rows)], title="GRPO quads_nvfp4", preset="quads")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    sup = _bbox(fig._suptitle, r)
    titles = [_bbox(ax.title, r) for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert titles and all(sup.y0 >= t.y1 for t in titles), (sup, max(t.y1 for t in titles))


def test_a_one_step_run_is_framed_and_labelled(tmp_path):
    from qpass.apps.grpo.plots import runs_figure

    run = _run(tmp_path, "smoke", [{"step": 1, "gap/token/g_abs": 0.409, "gap/max_abs": 1.58, "reward/mean": 0.0}],
               evals=[{"step": 0, "eval/accuracy": 0.25}])
    fig = runs_figure([run], title="GRPO smoke")
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    g = axes["G_abs = mean |log p_prox - log q| (token mean)"]
    assert g.get_xlim() == (0.0, 2.0)  # one step either side, not a degenerate axis
    lo, hi = g.get_ylim()
    assert lo < 0.409 < hi and hi / lo >= 3.9  # log panel: a factor 2 either side
    assert [t.get_text() for t in g.texts] == ["0.409"]
    reward = axes["training reward (mean)"]
    assert reward.get_ylim() == pytest.approx((-0.05, 0.05))  # a constant series gets a visible range
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    for ax in axes.values():  # no two visible y tick labels collide
        labels = [_bbox(t, r) for t in ax.get_yticklabels(which="both") if t.get_visible() and t.get_text()]
        assert not any(_overlap(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]), ax.get_title()


def test_rac_heatmap_marks_exactly_the_compensated_channels_in_one_strip():
    from qpass.apps.report import residual_heatmap_figure

    g = torch.Generator().manual_seed(0)
    k = 576
    resid = torch.randn(96, k, generator=g) * torch.exp(torch.randn(k, generator=g)) * 0.05
    channels = torch.topk(resid.pow(2).sum(0), k // 2).indices
    fig = residual_heatmap_figure(resid, channels, "model.layers.10.mlp.gate_proj: NVFP4 activation residual")
    heat, norm, strip = fig.axes[:3]
    assert strip.get_title(loc="left").startswith("compensated channels (red): 288 of 576 (50%)")
    (img,) = strip.get_images()
    marks = torch.as_tensor(img.get_array().data).reshape(-1)
    assert marks.shape == (k,) and int(marks.sum()) == 288
    assert torch.equal(marks.nonzero().flatten(), channels.sort().values)
    assert not norm.collections  # no scatter marker per compensated channel on the norm curve
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    for ax in (heat, norm, strip):
        for axis_labels in (ax.get_yticklabels(which="both"), ax.get_xticklabels(which="both")):
            boxes = [_bbox(t, r) for t in axis_labels if t.get_visible() and t.get_text()]
            assert not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def test_heatmap_without_rac_has_no_strip():
    from qpass.apps.report import residual_heatmap_figure

    fig = residual_heatmap_figure(torch.rand(8, 64), None, "w4a4 site")
    assert len([ax for ax in fig.axes if ax.get_images() or ax.lines]) == 2  # heatmap + norm (+ colorbar)
