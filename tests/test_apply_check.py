"""``qpass apply`` / ``qpass check`` on the tiny Llama: report, checksums, every saved tensor compared, bad input.

Fast tier: the tiny model's captured pipeline is shared (conftest), one apply per module.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qpass.apps.apply import ApplyOptions, run_apply, run_check
from qpass.apps.cli import main as cli_main
from qpass.errors import QpassError
from tests._tamper import flip_rollout_scale_bit
from tests.test_grpo import FakeTok

SITE = "model.layers.1.mlp.up_proj"
_EDITED = ("report.json: its content differs from the digest qpass apply recorded in it (integrity.report_sha256): "
           "report.json was edited after it was written")


def _strict(text: str):
    def no_constants(name):
        raise AssertionError(f"{name} in report.json")

    return json.loads(text, parse_constant=no_constants)


@pytest.fixture(scope="module")
def tiny_pipe(tiny_pipeline):
    from qpass.graph.model import LoadedModel

    return dataclasses.replace(tiny_pipeline, loaded=LoadedModel(model=tiny_pipeline.loaded.model, tokenizer=FakeTok(),
                                                                 name="tiny-llama", source="random"))


@pytest.fixture(scope="module")
def applied(tiny_pipe, tmp_path_factory):
    out = tmp_path_factory.mktemp("apply") / "quads"
    status, report = run_apply("quads_nvfp4", out, ApplyOptions(prompts=2, samples=2, max_new_tokens=8, batch_size=4),
                               pipeline=tiny_pipe)
    return status, report, out


def _copy(out, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(out, d)
    return d


def test_apply_report_is_strict_json_with_checksums_and_registry_checks(applied):
    status, report, out = applied
    assert status == 0 and report["ok"]
    rep = _strict((out / "report.json").read_text())
    assert [c["check"] for c in rep["parity"]["checks"]] == ["structural", "weights_bitexact", "logprob_gap"]
    assert rep["parity"]["structural_ok"] is True and rep["parity"]["weights_bitexact"] is True
    sums = rep["artifacts"]["sha256"]
    assert {"report.md", "rollout/weights.safetensors", "rollout/hf_quant_config.json", "rollout/recipe.yaml",
            "learner/model.safetensors"} <= set(sums) and "report.json" not in sums
    assert all(len(v) == 64 for v in sums.values())
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dir, no reservation left
    # what the numbers were computed on (the probe's tokens depend on the CPU's GEMM kernels)
    import torch

    assert rep["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rep["machine"]["torch_threads"] == torch.get_num_threads() and rep["machine"]["cuda_device"] is None
    flags = open("/proc/cpuinfo").read()
    assert rep["machine"]["cpu_flags_amx_bf16"] is (" amx_bf16" in flags)
    assert f"torch CPU capability {rep['machine']['cpu_capability']}" in (out / "report.md").read_text()


def test_check_compares_every_tensor_it_wrote(applied, tiny_pipe):
    _, _, out = applied
    n_file = len(load_file(str(out / "rollout" / "weights.safetensors")))
    status, res = run_check(str(out), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 0 and res["ok"] and res["checksums_ok"] is True
    # 14 W4A4 sites x (codes, block scales, S_dec, S_enc): the old check loaded 3 of the 4 per site
    assert n_file == 4 * 14 and res["loaded"]["rollout_tensors"] == n_file and res["compared"]["rollout_tensors"] == n_file


def test_corrupted_global_scale_fails_by_checksum_then_by_name(applied, tiny_pipe, tmp_path, monkeypatch):
    """Old code: weight_global_scale was never loaded or compared, so this passed."""
    from qpass.pipeline import Pipeline

    d = _copy(applied[2], tmp_path)
    path = d / "rollout" / "weights.safetensors"
    t = load_file(str(path))
    t[f"{SITE}.weight_global_scale"] = t[f"{SITE}.weight_global_scale"] * 2
    save_file(t, str(path), metadata={"format": "qpass-rollout"})
    # the checksum stage finds it without loading or capturing anything
    monkeypatch.setattr(Pipeline, "prepare", classmethod(lambda *a, **k: pytest.fail("model loaded before the checksums")))
    status, res = run_check(str(d), ApplyOptions())
    assert status == 1 and res["checksums_ok"] is False
    assert res["failures"] == ["rollout/weights.safetensors: sha256 differs from report.json (the file changed after qpass apply wrote it)"]
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe, checksums=False)
    assert status == 1 and res["failures"] == [
        f"rollout/weights.safetensors: {SITE}.weight_global_scale: 1/1 elements differ (first at ())"]


def test_planted_block_scale_bit_is_named_by_site_group_and_position(applied, tiny_pipe, tmp_path):
    """Was the second half of the real-model test in test_main_job (same code path: a rebuild with
    ``checksums=False`` names the fused group, the site and the first differing element)."""
    d = _copy(applied[2], tmp_path)
    flip_rollout_scale_bit(d, SITE, (100, 3))
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["checksums_ok"] is False
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe, checksums=False)
    assert status == 1 and res["weights_bitexact"] is False
    assert res["mismatched_groups"] == [SITE.replace("up_proj", "gate_up")]
    assert any(f.startswith(f"{SITE}: 1/") and "(first at (100, 3))" in f for f in res["failures"])


def test_check_rejects_missing_or_corrupt_artifacts_before_loading(applied, tiny_pipe, tmp_path, capsys):
    """Moved from the real-model tier (test_main_job): the artifact checks do not depend on the model."""
    from tests.conftest import copy_apply_output

    d = copy_apply_output(applied[2], tmp_path / "copy", learner=False)
    # the report lists a learner state that is not there
    with pytest.raises(QpassError, match=r"learner state .*model.safetensors is missing"):
        run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    rep = json.loads((d / "report.json").read_text())
    del rep["artifacts"]["learner"]
    del rep["artifacts"]["sha256"]["learner/model.safetensors"]
    (d / "report.json").write_text(json.dumps(rep))
    # an edited report is refused by its own digest; re-sealed, it reads as an apply without learner state
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["failures"] == [_EDITED]
    from tests._tamper import seal

    (d / "report.json").write_text(json.dumps(seal(rep)))
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert res["loaded"] == {"rollout_tensors": 4 * 14}
    # bit-exact against the in-memory learner of the shared pipeline, which still holds the masters
    assert status == 0 and res["weights_bitexact"] is True
    weights = d / "rollout" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with pytest.raises(QpassError, match="rollout weights .* is not a readable safetensors file"):
        run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    weights.unlink()
    capsys.readouterr()
    assert cli_main(["check", str(d)]) == 2
    err = capsys.readouterr().err
    assert "rollout weights" in err and "is missing" in err
    (d / "report.json").unlink()
    with pytest.raises(QpassError, match="not a `qpass apply` output directory"):
        run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)


def test_flipped_learner_byte_found_by_checksum(applied, tmp_path, monkeypatch, capsys):
    from qpass.pipeline import Pipeline

    d = _copy(applied[2], tmp_path)
    f = d / "learner" / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10
    f.write_bytes(bytes(raw))
    monkeypatch.setattr(Pipeline, "prepare", classmethod(lambda *a, **k: pytest.fail("model loaded before the checksums")))
    assert cli_main(["check", str(d)]) == 1
    assert "learner/model.safetensors: sha256 differs" in capsys.readouterr().err


def test_extra_or_missing_tensors_are_named(applied, tiny_pipe, tmp_path):
    """Old code: an extra rollout tensor passed; a learner tensor missing from the file was silently
    taken from the freshly loaded model."""
    d = _copy(applied[2], tmp_path)
    path = d / "rollout" / "weights.safetensors"
    t = load_file(str(path))
    save_file(t | {"model.layers.0.extra": torch.zeros(3)}, str(path), metadata={"format": "qpass-rollout"})
    with pytest.raises(QpassError, match=r"1 tensor\(s\) the rollout graph has no constant for: model.layers.0.extra"):
        run_check(str(d), ApplyOptions(), pipeline=tiny_pipe, checksums=False)
    save_file(t, str(path), metadata={"format": "qpass-rollout"})
    lpath = d / "learner" / "model.safetensors"
    lt = load_file(str(lpath))
    del lt["model.norm.weight"]
    save_file(lt, str(lpath), metadata={"format": "qpass-learner"})
    with pytest.raises(QpassError, match=r"missing 1 learner parameter\(s\): model.norm.weight"):
        run_check(str(d), ApplyOptions(), pipeline=tiny_pipe, checksums=False)


@pytest.mark.parametrize(("flag", "value"), [("--prompts", "0"), ("--max-new-tokens", "0"), ("--samples", "0")])
def test_cli_overrides_go_through_the_recipe_validation(flag, value, tmp_path, capsys, monkeypatch):
    """Old code: model_copy(update=...) skipped validation; --prompts 0 crashed after the model load."""
    import qpass.graph.model as gm

    monkeypatch.setattr(gm, "load_model", lambda *a, **k: pytest.fail("model loaded before the flags were validated"))
    assert cli_main(["apply", "quads_nvfp4", "--out", str(tmp_path / "o"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} 0: Input should be greater than or equal to 1" in err
    assert not (tmp_path / "o").exists()


def test_output_reserved_by_another_run_or_a_dangling_link_exits_2_before_work(tmp_path, capsys, monkeypatch):
    """Old code: both runs exited 0 (the later deleted the earlier output); a dangling link ran the
    whole job and then failed with a traceback."""
    import qpass.graph.model as gm
    from qpass.atomic import atomic_dir

    monkeypatch.setattr(gm, "load_model", lambda *a, **k: pytest.fail("work started"))
    out = tmp_path / "o"
    with atomic_dir(out):
        assert cli_main(["apply", "quads_nvfp4", "--out", str(out)]) == 2
    assert "being written by another run" in capsys.readouterr().err
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    assert cli_main(["apply", "quads_nvfp4", "--out", str(link)]) == 2
    assert "dangling symbolic link" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "o"]


# ----------------------------------------------------------------------------- integrity across commands


def test_edited_recipe_text_inside_the_report_fails_with_and_without_checksums(applied, tiny_pipe, tmp_path):
    """Old code: ``qpass check`` rebuilt the graphs from report.json's recipe text, which no checksum
    covered, so a report whose recipe says RAC 5% where the apply ran 50% passed (exit 0), both ways."""
    from tests._tamper import edit_report

    d = _copy(applied[2], tmp_path)
    edit_report(d, lambda rep: rep["recipe"].update(text=rep["recipe"]["text"].replace("ratio: 0.5", "ratio: 0.05")))
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["failures"] == [_EDITED]
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe, checksums=False)
    assert status == 1 and res["consistent"] is False
    assert res["failures"] == ["rollout/recipe.yaml differs from the recipe text in report.json (first difference at line 13: "
                               "'ratio: 0.5' vs 'ratio: 0.05')"]


def test_no_checksums_still_compares_the_quantization_config_with_the_rebuilt_rollout(applied, tiny_pipe, tmp_path):
    """Old code: with --no-checksums hf_quant_config.json was never read (an edited RAC ratio passed)."""
    from tests._tamper import RAC_SITE, set_rac_ratio

    d = _copy(applied[2], tmp_path)
    set_rac_ratio(d, 0.05)
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["failures"] == [
        "rollout/hf_quant_config.json: sha256 differs from report.json (the file changed after qpass apply wrote it)"]
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe, checksums=False)
    assert status == 1 and res["failures"] == [
        f"rollout/hf_quant_config.json: quantization.rac[{RAC_SITE}].ratio: the file has 0.05, the rebuilt rollout 0.5"]


def test_resealed_edits_are_caught_by_the_cross_checks(applied, tiny_pipe, tmp_path):
    """A consistent forgery (checksums and digest rewritten): the files still have to agree with each
    other and with the graphs rebuilt from the recipe. Old code: all three passed."""
    from tests._tamper import RAC_SITE, edit_report, edit_text, reseal, set_rac_ratio

    d = _copy(applied[2], tmp_path)
    set_rac_ratio(d, 0.05)
    reseal(d)
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["checksums_ok"] is True and res["failures"] == [
        f"rollout/hf_quant_config.json: quantization.rac[{RAC_SITE}].ratio: the file has 0.05, the rebuilt rollout 0.5"]
    d = _copy(applied[2], tmp_path / "b")
    edit_report(d, lambda rep: rep["sites"].update(rac=0))
    reseal(d)
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["failures"] == ["report.json: sites.rac is 0, the graphs rebuilt from the recipe have 4"]
    d = _copy(applied[2], tmp_path / "c")
    edit_text(d, "rollout/recipe.yaml", "ratio: 0.5", "ratio: 0.05")
    reseal(d)
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["failures"][0].startswith("rollout/recipe.yaml differs from the recipe text in report.json")


def test_a_file_check_reads_must_be_covered_by_the_checksums(applied, tiny_pipe, tmp_path):
    from tests._tamper import edit_report, seal

    d = _copy(applied[2], tmp_path)

    def drop(rep):
        del rep["artifacts"]["sha256"]["rollout/hf_quant_config.json"]
        seal(rep)

    edit_report(d, drop)
    status, res = run_check(str(d), ApplyOptions(), pipeline=tiny_pipe)
    assert status == 1 and res["failures"] == [
        "rollout/hf_quant_config.json: read by this command but not covered by the checksums in report.json"]
