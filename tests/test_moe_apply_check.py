"""``qpass apply`` + ``qpass check`` on a tiny random Mixtral: the MoE main job end to end (unit tier).

Same code path as ``qpass apply recipes/quads_nvfp4_moe.yaml --model moe-default`` (per-expert
sites, gate/up groups, RAC on W13, routing replay in the behavioural probe), on hidden 32 / 2 layers
/ 4 experts / top-2 so it runs in seconds.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file

from qpass.apps.apply import ApplyOptions, run_apply, run_check
from tests._tamper import flip_rollout_scale_bit
from tests.test_grpo import FakeTok
from tests.test_moe import E, tiny_moe

SITE = "model.layers.1.mlp.experts.2.up_proj"
N_LAYERS = 2


@pytest.fixture(scope="module")
def moe_pipe():
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    # vocab 256: FakeTok's letters map to ids up to 219
    m = tiny_moe("mixtral", vocab=256)
    return Pipeline.prepare(loaded=LoadedModel(model=m, tokenizer=FakeTok(), name="tiny-mixtral", source="random"),
                            batch_size=4, max_len=32)


@pytest.fixture(scope="module")
def moe_applied(moe_pipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_apply") / "quads_moe"
    status, report = run_apply("quads_nvfp4_moe", out, ApplyOptions(prompts=2, samples=2, max_new_tokens=6, batch_size=4),
                               pipeline=moe_pipe)
    return status, report, out


def test_moe_apply_with_behavioural_probe_reports_replay_and_routing_mismatch(moe_applied):
    status, report, out = moe_applied
    assert status == 0 and report["ok"] is True
    on_disk = json.loads((out / "report.json").read_text())
    p = on_disk["parity"]
    assert p["structural_ok"] is True and p["weights_bitexact"] is True and p["mismatched_groups"] == []
    assert [c["check"] for c in p["checks"]] == ["structural", "weights_bitexact", "logprob_gap"]
    gap = p["logprob_gap"]
    assert gap["tokens"] > 0 and gap["routing_replay"]["tokens"] == gap["tokens"]
    assert sorted(gap["routing_mismatch"]["layers"]) == [f"layers.{i}" for i in range(N_LAYERS)]
    assert all(0.0 <= v["mismatch"] <= 1.0 and v["tokens"] > 0 for v in gap["routing_mismatch"]["layers"].values())
    # the floor is the BF16 pair: same weights on both sides, so routes agree (or nearly) and no replay is run
    assert p["floor_logprob_gap"]["tokens"] > 0 and "routing_replay" not in p["floor_logprob_gap"]
    # every expert linear is a W4A4 site with a saved code tensor; RAC only on gate/up (W13)
    w = load_file(str(out / "rollout" / "weights.safetensors"))
    for layer in range(N_LAYERS):
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in w
    q = json.loads((out / "rollout" / "hf_quant_config.json").read_text())["quantization"]
    rac = set(q["rac"])
    assert rac == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(N_LAYERS) for e in range(E)
                   for p in ("gate_proj", "up_proj")}
    assert on_disk["sites"]["rac"] == len(rac) == N_LAYERS * E * 2
    # expert linears have no row-aligned input comparison (routed tokens): left out and counted, not crashed on
    skipped = on_disk["diagnostics"]["activation_mismatch_skipped"]
    assert skipped["sites"] == N_LAYERS * E * 3 and ".mlp.experts." in skipped["example"]
    assert not any(".mlp.experts." in s for s in on_disk["diagnostics"]["activation_mismatch_rel"])


def test_moe_check_reverifies_every_expert_tensor(moe_applied, moe_pipe):
    _, _, out = moe_applied
    status, res = run_check(str(out), ApplyOptions(), pipeline=moe_pipe)
    assert status == 0 and res["ok"] is True and res["failures"] == []
    assert res["structural_ok"] is True and res["weights_bitexact"] is True
    n_saved = len(load_file(str(out / "rollout" / "weights.safetensors")))
    assert res["compared"]["rollout_tensors"] == n_saved == res["loaded"]["rollout_tensors"]


def test_moe_check_names_the_expert_group_of_a_planted_scale_bit(moe_applied, moe_pipe, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(moe_applied[2], d)
    flip_rollout_scale_bit(d, SITE, (3, 1))
    status, res = run_check(str(d), ApplyOptions(), pipeline=moe_pipe)
    assert status == 1 and res["checksums_ok"] is False
    status, res = run_check(str(d), ApplyOptions(), pipeline=moe_pipe, checksums=False)
    assert status == 1 and res["weights_bitexact"] is False
    assert res["mismatched_groups"] == ["model.layers.1.mlp.experts.2.gate_up"]
    assert any(f.startswith(f"{SITE}: 1/") and "(first at (3, 1))" in f for f in res["failures"])
