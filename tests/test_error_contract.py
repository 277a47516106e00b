"""The ``qpass`` error contract (issue 31 items 2-3), table-driven over every subcommand.

Exit 2 for bad input with a message naming the file / flag / recipe line, 1 only for a failed
parity check, 130 / 143 for SIGINT / SIGTERM, 70 for an internal error (a bug: traceback shown),
and never a traceback for a user error. Bad input is refused **before any model load**: the table
runs ``qpass.apps.cli.main(argv)`` in-process with the model loader replaced by a tripwire
(:class:`HeavyWork`, a BaseException no command catches), so a row that got as far as loading a
model fails, and most rows take milliseconds. A few rows run the real console entry point in a
subprocess for the real exit statuses (2, 130, 143).

Old code (a264965): the non-UTF-8 recipe, the list-valued pass name, a too-long or unwritable
output path and garbage checkpoints escaped as tracebacks; ``--prompts 100000``, ``--top-p 1.5``,
``--checkpoint-every`` without ``--checkpoint-dir``, a BERT model directory, a ``../`` recipe name,
``qpass study --out /proc/...`` and many more were accepted and failed (or silently did the wrong
thing) only after the model load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qpass.apps.cli import COMMANDS
from qpass.apps.cli import main as cli_main


class HeavyWork(BaseException):
    """Raised by the tripwired model loader: the command got past validation with bad input."""


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Every path to a model load or a benchmark run raises :class:`HeavyWork`."""
    import qpass.graph.model
    import qpass.pipeline

    def tripwire(*a, **k):
        raise HeavyWork(f"model load / heavy work reached with args {a!r:.200}")

    monkeypatch.setattr(qpass.graph.model, "load_model", tripwire)
    monkeypatch.setattr(qpass.pipeline.Pipeline, "prepare", classmethod(tripwire))
    try:
        import qpass.apps.bench.triton_bench as tb

        monkeypatch.setattr(tb, "run", tripwire)
    except ImportError:
        pass
    return tripwire


def _bomb(levels: int = 4, width: int = 9) -> str:
    items = ["&a0 [" + ",".join(['"lol"'] * width) + "]"]
    items += [f"&a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "name: x\ndescription:\n" + "".join(f"  - {it}\n" for it in items)


RAC = "name: {n}\nrollout:\n  - pass: w4a4_lower\n  - pass: residual_compensation\n"


#: The recipe part of the export rows' reports (``qpass.apps.integrity`` checks it before the model fields).
_EXP_RECIPE = {"recipe": {"name": "x", "text": "name: x\n"}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Bad inputs of every class: recipes, model references, apply outputs, checkpoints, run dirs."""
    c = tmp_path_factory.mktemp("bad_inputs")
    files: dict[str, str | bytes] = {
        "nonutf8.yaml": "name: x\n# caf\u00e9\nrollout: []\n".encode("latin-1"),
        "dupkey.yaml": "name: x\nrollout:\n  - pass: w4a4_lower\nrollout: []\n",
        "ratio_yes.yaml": RAC.format(n="x") + "    ratio: yes\n",
        "pass_list.yaml": "name: x\nrollout:\n  - pass: [w4a4_lower]\n",
        "check_list.yaml": "name: x\nparity:\n  - check: [structural]\n",
        "traversal.yaml": "name: ../../escaped\nrollout: []\n",
        "bomb.yaml": _bomb(),
        "badregex.yaml": RAC.format(n="x") + '    targets: ["re:(unclosed"]\n',
        "prompts_recipe.yaml": "name: x\nparity:\n  - check: logprob_gap\n    prompts: 1000\n",
        "fp8.yaml": "name: f\nrollout:\n  - pass: fp8_lower\n",
        "garbage.yaml": bytes(range(256)),
        "afile": "not a directory",
        "bert/config.json": json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}),
        "bert/model.safetensors": b"\0" * 16,
        "noweights/config.json": json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}),
        "badcfg/config.json": b"\xff\xfe{",
        "listcfg/config.json": "[1, 2]",
        "fake.gguf": b"PK\x03\x04 not a gguf",
        "model.txt": "hello",
        "rep_garbage/report.json": b"\x80\x81\x82",
        "rep_list/report.json": "[]",
        "rep_types/report.json": json.dumps({"recipe": {"text": 5}, "parity": {"probe": {"rollout_batch": 4, "max_len": 64}}}),
        "rep_batch/report.json": json.dumps({"recipe": {"text": "name: x\n"}, "parity": {"probe": {"rollout_batch": "4", "max_len": 64}}}),
        "rep_badrecipe/report.json": json.dumps({"recipe": {"text": "name: x\nrollout:\n  - pass: nope\n"},
                                                 "parity": {"probe": {"rollout_batch": 4, "max_len": 64}}}),
        "rep_badrecipe/rollout/recipe.yaml": "name: x\nrollout:\n  - pass: nope\n",  # the copy equals the report's text
        "rep_badrecipe/rollout/hf_quant_config.json": "{}",
        "rep_empty/report.json": "{}",
        "rep_arts/report.json": json.dumps({"recipe": {"text": "name: x\n"}, "parity": {"probe": {"rollout_batch": 4, "max_len": 64}},
                                            "artifacts": {"rollout": "weights"}}),
        "rep_weights/report.json": json.dumps({"recipe": {"text": "name: x\n"}, "parity": {"probe": {"rollout_batch": 4, "max_len": 64}},
                                               "artifacts": {"rollout": {"weights": "rollout/weights.safetensors"}}}),
        "rep_weights/rollout/weights.safetensors": b"\xff" * 64,
        "rep_weights/rollout/recipe.yaml": "name: x\n",  # complete but for the weights (the integrity chain reads these first)
        "rep_weights/rollout/hf_quant_config.json": "{}",
        # export rows: a recipe (report text == its copy) so the integrity chain reaches the field under test
        "exp_noref/report.json": json.dumps({"model": {}, **_EXP_RECIPE}),
        "exp_noref/rollout/hf_quant_config.json": "{}",
        "exp_badqcfg/report.json": json.dumps({"model": {"ref": "default"}, **_EXP_RECIPE}),
        "exp_badqcfg/rollout/hf_quant_config.json": json.dumps({"quantization": {"sites": [1]}}),
        "exp_modelref/report.json": json.dumps({"model": {"ref": ["default"]}, **_EXP_RECIPE}),
        "exp_modelref/rollout/hf_quant_config.json": json.dumps({"quantization": {}}),
        "exp_nomodel/report.json": json.dumps({"model": "default", **_EXP_RECIPE}),
        "exp_nomodel/rollout/hf_quant_config.json": "{}",
        **{f"{d}/rollout/recipe.yaml": "name: x\n" for d in ("exp_noref", "exp_badqcfg", "exp_modelref", "exp_nomodel")},
        "prompts_nonutf8.jsonl": b'"ok"\n"caf\xe9"\n',
        "prompts_bad.jsonl": '"ok"\n{not json\n',
        "prompts_nums.json": "[1, 2]",
        "cal_garbage/calibration.json": b"\x80 not json",
        "run_garbage/metrics.jsonl": b"\x00\xff garbage\n",
        "run_badjson/metrics.jsonl": "{not json\n",
        "run_listrow/metrics.jsonl": "[1]\n[2]\n",
    }
    for name, data in files.items():
        p = c / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    (c / "rep_dir" / "report.json").mkdir(parents=True)
    return c


# (id, argv with {C} = corpus dir and {O} = a fresh output path, substrings the error must contain)
ROWS: list[tuple[str, str, tuple[str, ...]]] = [
    # ---- apply: recipes (item 4), values (item 3), model references, output paths
    ("apply-nonutf8", "apply {C}/nonutf8.yaml --out {O}", ("nonutf8.yaml: not UTF-8 text: byte 0xe9 at offset 13 (line 2, column 6)",)),
    ("apply-binary-recipe", "apply {C}/garbage.yaml --out {O}", ("garbage.yaml",)),
    ("apply-dupkey", "apply {C}/dupkey.yaml --out {O}", ("dupkey.yaml:4: duplicate key 'rollout' (first at line 2)",)),
    ("apply-ratio-yes", "apply {C}/ratio_yes.yaml --out {O}", ("ratio_yes.yaml:5:", "ratio: Input should be a valid number")),
    ("apply-pass-list", "apply {C}/pass_list.yaml --out {O}", ("pass_list.yaml:3: 'pass:' (a pass name) must be a string, got a list",)),
    ("apply-check-list", "apply {C}/check_list.yaml --out {O}", ("check_list.yaml:3: 'check:'",)),
    ("apply-traversal-name", "apply {C}/traversal.yaml --out {O}", ("traversal.yaml:1: recipe name '../../escaped' is not a safe file name",)),
    ("apply-alias-bomb", "apply {C}/bomb.yaml --out {O}", ("bomb.yaml:3: YAML anchor &a0 is not allowed",)),
    ("apply-bad-regex", "apply {C}/badregex.yaml --out {O}", ("badregex.yaml:5:", "is not a valid regular expression")),
    ("apply-recipe-prompts", "apply {C}/prompts_recipe.yaml --out {O}", ("prompts_recipe.yaml:4:", "probe set has 24 prompts")),
    ("apply-missing-recipe", "apply {C}/nope.yaml --out {O}", ("recipe file", "nope.yaml does not exist", "quads_nvfp4")),
    ("apply-recipe-is-dir", "apply {C} --out {O}", ("is a directory, not a recipe file",)),
    ("apply-prompts-100000", "apply quads_nvfp4 --out {O} --prompts 100000", ("--prompts 100000", "probe set has 24 prompts")),
    ("apply-prompts-0", "apply quads_nvfp4 --out {O} --prompts 0", ("--prompts 0",)),
    ("apply-samples-0", "apply quads_nvfp4 --out {O} --samples 0", ("--samples 0",)),
    ("apply-max-new-tokens-huge", "apply quads_nvfp4 --out {O} --max-new-tokens 1000000000", ("--max-new-tokens 1000000000", "32768")),
    ("apply-prompts-type", "apply quads_nvfp4 --out {O} --prompts many", ("--prompts", "invalid int value: 'many'")),
    ("apply-batch-0", "apply quads_nvfp4 --out {O} --batch-size 0", ("--batch-size", "expected an integer >= 1, got 0")),
    ("apply-threads-neg", "apply quads_nvfp4 --out {O} --threads -2", ("--threads",)),
    ("apply-dtype", "apply quads_nvfp4 --out {O} --dtype int8", ("--dtype", "invalid choice: 'int8'")),
    ("apply-model-missing", "apply quads_nvfp4 --out {O} --model {C}/nothing", ("--model", "nothing' does not exist")),
    ("apply-model-bert", "apply quads_nvfp4 --out {O} --model {C}/bert", ("--model", "BertForMaskedLM (bert), not a causal LM")),
    ("apply-model-noweights", "apply quads_nvfp4 --out {O} --model {C}/noweights", ("noweights holds no weight files",)),
    ("apply-model-badcfg", "apply quads_nvfp4 --out {O} --model {C}/badcfg", ("badcfg/config.json is not a readable JSON config",)),
    ("apply-model-listcfg", "apply quads_nvfp4 --out {O} --model {C}/listcfg", ("listcfg/config.json is not a model config",)),
    ("apply-model-fake-gguf", "apply quads_nvfp4 --out {O} --model {C}/fake.gguf", ("fake.gguf' is not a GGUF file",)),
    ("apply-model-txt", "apply quads_nvfp4 --out {O} --model {C}/model.txt", ("model.txt' is a file but not a .gguf file",)),
    ("apply-out-under-file", "apply quads_nvfp4 --out {C}/afile/sub", ("afile is not a directory",)),
    ("apply-out-is-file", "apply quads_nvfp4 --out {C}/afile", ("afile exists and is a file",)),
    ("apply-out-proc", "apply quads_nvfp4 --out /proc/qpass-out", ("output path /proc/qpass-out: cannot create files in /proc",)),
    ("apply-out-name-too-long", "apply quads_nvfp4 --out {C}/" + "n" * 300, ("300 bytes, more than a file system allows",)),
    ("apply-device", "apply quads_nvfp4 --out {O} --device tpu", ("--device", "invalid choice")),
    ("apply-seed-overflow", "apply quads_nvfp4 --out {O} --seed 99999999999999999999", ("--seed", "seed in [0, 2^63 - 1]")),
    # ---- check: recipes, saved outputs, --json, model
    ("check-nonutf8", "check {C}/nonutf8.yaml", ("nonutf8.yaml: not UTF-8 text", "offset 13")),
    ("check-dupkey", "check {C}/dupkey.yaml", ("duplicate key 'rollout'",)),
    ("check-not-an-output", "check {C}/bert", ("no report.json",)),
    ("check-missing-path", "check {C}/missing/dir", ("does not exist",)),
    ("check-report-garbage", "check {C}/rep_garbage", ("rep_garbage/report.json is not a readable qpass report",)),
    ("check-report-list", "check {C}/rep_list", ("rep_list/report.json is not a readable qpass report",)),
    ("check-report-dir", "check {C}/rep_dir", ("no report.json",)),
    ("check-report-text-type", "check {C}/rep_types", ("rep_types/report.json: recipe.text must be",)),
    ("check-report-batch-type", "check {C}/rep_batch", ("parity.probe.rollout_batch must be a positive integer, got '4'",)),
    ("check-report-missing-fields", "check {C}/rep_empty", ("rep_empty/report.json is not a readable qpass report (KeyError",)),
    ("check-report-artifacts-type", "check {C}/rep_arts", ("artifacts.rollout must be an object, got 'weights'",)),
    ("check-garbage-weights", "check {C}/rep_weights", ("rollout/weights.safetensors",)),
    ("check-report-bad-recipe", "check {C}/rep_badrecipe", ("recipe.yaml:3: unknown pass 'nope'",)),
    ("check-json-proc", "check quads_nvfp4 --json /proc/x.json", ("--json /proc/x.json: cannot create files in /proc",)),
    ("check-json-is-dir", "check quads_nvfp4 --json {C}", ("--json", "is a directory")),
    ("check-model-bert", "check quads_nvfp4 --model {C}/bert", ("--model", "not a causal LM")),
    ("check-kernels", "check quads_nvfp4 --kernels tpu", ("--kernels", "invalid choice")),
    # ---- export
    ("export-recipe-nonutf8", "export --model default --recipe {C}/nonutf8.yaml --out {O}", ("nonutf8.yaml: not UTF-8 text",)),
    ("export-recipe-ratio-yes", "export --model default --recipe {C}/ratio_yes.yaml --out {O}", ("ratio_yes.yaml:5:",)),
    ("export-recipe-fp8", "export --model default --recipe {C}/fp8.yaml --out {O}", ("fp8.yaml:3: rollout pass 'fp8_lower'", "NVFP4")),
    ("export-recipe-missing", "export --model default --recipe nope --out {O}", ("recipe 'nope' not found",)),
    ("export-model-missing", "export --model {C}/nothing --out {O}", ("--model", "does not exist")),
    ("export-src-bert", "export {C}/bert --out {O}", ("SRC", "not a causal LM")),
    ("export-src-fake-gguf", "export {C}/fake.gguf --out {O}", ("SRC", "not a GGUF file")),
    ("export-calibration-prompts", "export --model default --recipe quads_nvfp4 --out {O} --calibration-prompts 100",
     ("--calibration-prompts 100", "24 prompts")),
    ("export-out-proc", "export --model default --out /proc/qq", ("/proc/qq: cannot create files in /proc",)),
    ("export-out-under-file", "export --model default --out {C}/afile/ckpt", ("afile is not a directory",)),
    ("export-shard-size", "export --model default --out {O} --max-shard-size 0", ("--max-shard-size",)),
    ("export-format", "export --model default --out {O} --format gguf", ("--format", "invalid choice")),
    ("export-quant-config-types", "export {C}/exp_badqcfg --out {O}", ("hf_quant_config.json: not a qpass rollout quantization config",)),
    ("export-report-model-ref", "export {C}/exp_modelref --out {O}", ("model.ref must name a model",)),
    ("export-report-no-model", "export {C}/exp_noref --out {O}", ("names no model (model.ref); pass --model",)),
    ("export-report-model-type", "export {C}/exp_nomodel --out {O}", ("'model' must be an object",)),
    ("export-apply-dir-and-recipe", "export {C}/exp_badqcfg --recipe quads_nvfp4 --out {O}", ("--recipe applies to --model only",)),
    # ---- grpo: recipes, values and combinations (item 3), task counts, plug-ins, checkpoints
    ("grpo-nonutf8", "grpo --recipe {C}/nonutf8.yaml --out {O}", ("--recipe:", "offset 13")),
    ("grpo-traversal-name", "grpo --recipe {C}/traversal.yaml,bf16 --out {O}", ("recipe name '../../escaped' is not a safe file name",)),
    ("grpo-duplicate-recipe", "grpo --recipe bf16,bf16 --out {O}", ("names 'bf16' twice",)),
    ("grpo-top-p", "grpo --recipe bf16 --out {O} --top-p 1.5", ("--top-p 1.5", "less than or equal to 1")),
    ("grpo-eps-low", "grpo --recipe bf16 --out {O} --eps-low 1.5", ("--eps-low", "eps_low must be in [0, 1)")),
    ("grpo-mis-bounds", "grpo --recipe bf16 --out {O} --correction mis --mis-lo 3 --mis-hi 2", ("--mis-lo/--mis-hi",)),
    ("grpo-temperature-nan", "grpo --recipe bf16 --out {O} --temperature nan", ("--temperature", "finite")),
    ("grpo-lr-inf", "grpo --recipe bf16 --out {O} --lr inf", ("--lr",)),
    ("grpo-checkpoint-every-no-dir", "grpo --recipe bf16 --out {O} --checkpoint-every 1", ("--checkpoint-every", "needs --checkpoint-dir")),
    ("grpo-segment-no-dir", "grpo --recipe bf16 --out {O} --segment-steps 1", ("--segment-steps", "needs --checkpoint-dir")),
    ("grpo-resume-no-dir", "grpo --recipe bf16 --out {O} --resume", ("--resume", "needs --checkpoint-dir")),
    ("grpo-checkpoint-dir-file", "grpo --recipe bf16 --out {O} --checkpoint-dir {C}/afile", ("--checkpoint-dir", "afile exists and is not a directory")),
    ("grpo-checkpoint-dir-proc", "grpo --recipe bf16 --out {O} --checkpoint-dir /proc/ck", ("--checkpoint-dir", "cannot create files in /proc")),
    ("grpo-max-len", "grpo --recipe bf16 --out {O} --max-len 8", ("--max-len 8", "--max-new-tokens 48")),
    ("grpo-prompts-per-step", "grpo --recipe bf16 --out {O} --prompts-per-step 5000", ("--prompts-per-step 5000", "--n-train 2000")),
    ("grpo-minibatches", "grpo --recipe bf16 --out {O} --minibatches 9", ("--minibatches 9", "1 micro-batches")),
    ("grpo-task-size", "grpo --recipe bf16 --out {O} --difficulty 1 --n-train 1000", ("task:", "only 100 distinct")),
    ("grpo-operators", "grpo --recipe bf16 --out {O} --operators /", ("task:", "operators")),
    ("grpo-operators-other-task", "grpo --recipe bf16 --out {O} --task larger --operators +", ("--operators applies to --task arithmetic",)),
    ("grpo-reward-missing", "grpo --recipe bf16 --out {O} --reward no_such_module_q:f", ("--reward", "No module named 'no_such_module_q'")),
    ("grpo-reward-empty-module", "grpo --recipe bf16 --out {O} --reward :f", ("--reward ':f': cannot import",)),
    ("grpo-reward-not-callable", "grpo --recipe bf16 --out {O} --reward os:sep", ("--reward 'os:sep' is not callable",)),
    ("grpo-format-weight", "grpo --recipe bf16 --out {O} --reward format --format-weight 2", ("--format-weight",)),
    ("grpo-tp", "grpo --recipe bf16 --out {O} --tp 2", ("--tp needs --learner megatron",)),
    ("grpo-model-bert", "grpo --recipe bf16 --out {O} --model {C}/bert", ("--model", "not a causal LM")),
    ("grpo-out-proc", "grpo --recipe bf16 --out /proc/run", ("--out", "cannot create files in /proc")),
    ("grpo-out-under-file", "grpo --recipe bf16 --out {C}/afile/run", ("afile is not a directory",)),
    ("grpo-seed-overflow", "grpo --recipe bf16 --out {O} --seed 18446744073709551616", ("--seed", "seed in [0, 2^63 - 1]")),
    ("grpo-steps-0", "grpo --recipe bf16 --out {O} --steps 0", ("--steps",)),
    # ---- grpo-plot
    ("grpo-plot-not-a-run", "grpo-plot {C}/bert --out {O}.png", ("not a GRPO run directory",)),
    ("grpo-plot-garbage-metrics", "grpo-plot {C}/run_garbage --out {O}.png", ("run_garbage",)),
    ("grpo-plot-bad-json", "grpo-plot {C}/run_badjson --out {O}.png", ("run_badjson",)),
    ("grpo-plot-list-rows", "grpo-plot {C}/run_listrow --out {O}.png", ("run_listrow/metrics.jsonl:1: a row must be a JSON object",)),
    ("grpo-plot-out-proc", "grpo-plot {C}/run_badjson --out /proc/p.png", ("--out /proc/p.png: cannot create files in /proc",)),
    ("grpo-plot-smooth", "grpo-plot {C}/run_badjson --out {O}.png --smooth 0", ("--smooth",)),
    # ---- grpo-sweep (the sweep "config" is its flags plus the qpass grpo flags after '--', all checked before a job starts)
    ("grpo-sweep-unknown-arm", "grpo-sweep --state {O} --arms bogus status", ("--arms: unknown arm or set 'bogus'",)),
    ("grpo-sweep-seeds", "grpo-sweep --state {O} --seeds 0,x status", ("--seeds must be a comma list of integers, got '0,x'",)),
    ("grpo-sweep-unknown-grpo-flag", "grpo-sweep --state {O} status -- --bogus-flag 1",
     ("job bf16_s0", "unrecognized arguments: --bogus-flag 1")),
    ("grpo-sweep-owned-flag", "grpo-sweep --state {O} run -- --seed 3", ("--seed after '--' is set by the sweep per job",)),
    ("grpo-sweep-bad-grpo-value", "grpo-sweep --state {O} run -- --top-p 1.5", ("job bf16_s0", "--top-p")),
    ("grpo-sweep-no-action", "grpo-sweep --state {O}", ("the following arguments are required",)),
    # ---- grpo-compare
    ("grpo-compare-missing-run", "grpo-compare {C}/nothing_s0 --out {O}.json", ("nothing_s0 is not a GRPO run directory (no metrics.jsonl)",)),
    ("grpo-compare-missing-arm-dir", "grpo-compare --arm a={C}/nothing --out {O}.json", ("arm 'a'", "nothing is not a GRPO run directory")),
    ("grpo-compare-garbage-metrics", "grpo-compare {C}/run_garbage --out {O}.json", ("run_garbage",)),
    ("grpo-compare-list-rows", "grpo-compare {C}/run_listrow --out {O}.json", ("run_listrow/metrics.jsonl:1: a row must be a JSON object",)),
    ("grpo-compare-metric-window", "grpo-compare {C}/run_listrow --metric eval/accuracy@xx --out {O}.json", ("--metric", "got 'xx'")),
    ("grpo-compare-no-complete-row", "grpo-compare {C}/run_badjson --out {O}.json", ("run_badjson/metrics.jsonl holds no complete metric row",)),
    ("grpo-compare-out-proc", "grpo-compare {C}/run_badjson --out /proc/c.json", ("--out /proc/c.json: cannot create files in /proc",)),
    ("grpo-compare-out-dir", "grpo-compare {C}/run_badjson --out {C}", ("--out", "is a directory")),
    # ---- study
    ("study-prompts", "study --out {O} --prompts 100000", ("--prompts 100000", "24 prompts")),
    ("study-top-p", "study --out {O} --top-p 1.5", ("--top-p 1.5", "(0, 1]")),
    ("study-temperature", "study --out {O} --temperature -1", ("--temperature",)),
    ("study-budget", "study --out {O} --budget-s -5", ("--budget-s",)),
    ("study-bootstrap", "study --out {O} --bootstrap 0", ("--bootstrap",)),
    ("study-batch", "study --out {O} --batch-size 0", ("--batch-size",)),
    ("study-layers", "study --out {O} --layers 0", ("--layers",)),
    ("study-ratios", "study --out {O} --ratios 12,abc", ("--ratios must be comma-separated percentages",)),
    ("study-ratios-range", "study --out {O} --ratios 150", ("--ratios must be percentages in [0, 100]",)),
    ("study-seed", "study --out {O} --seed -1", ("--seed", "seed in [0, 2^63 - 1], got -1")),
    ("study-out-proc", "study --out /proc/o4", ("/proc/o4: cannot create files in /proc",)),
    ("study-model-bert", "study --out {O} --model {C}/bert", ("--model", "not a causal LM")),
    # ---- calibrate (and --calibration of the commands that read a calibration)
    ("calibrate-missing-recipe", "calibrate {C}/nope.yaml --out {O}", ("nope.yaml does not exist",)),
    ("calibrate-dupkey", "calibrate {C}/dupkey.yaml --out {O}", ("dupkey.yaml:4: duplicate key 'rollout' (first at line 2)",)),
    ("calibrate-no-out", "calibrate quads_nvfp4", ("the following arguments are required: --out",)),
    ("calibrate-prompts-missing", "calibrate quads_nvfp4 --prompts {C}/nothing.jsonl --out {O}", ("--prompts", "nothing.jsonl: cannot read")),
    ("calibrate-prompts-nonutf8", "calibrate quads_nvfp4 --prompts {C}/prompts_nonutf8.jsonl --out {O}",
     ("prompts_nonutf8.jsonl: not UTF-8 (byte offset 9)",)),
    ("calibrate-prompts-bad-line", "calibrate quads_nvfp4 --prompts {C}/prompts_bad.jsonl --out {O}", ("prompts_bad.jsonl:2: not JSON",)),
    ("calibrate-prompts-not-strings", "calibrate quads_nvfp4 --prompts {C}/prompts_nums.json --out {O}",
     ("prompts_nums.json: expected a list of non-empty strings",)),
    ("calibrate-num-prompts-0", "calibrate quads_nvfp4 --num-prompts 0 --out {O}", ("--num-prompts",)),
    ("calibrate-num-prompts-huge", "calibrate quads_nvfp4 --num-prompts 1000 --out {O}", ("--num-prompts 1000: the prompt source has 24 prompts",)),
    ("calibrate-model-bert", "calibrate quads_nvfp4 --model {C}/bert --out {O}", ("--model", "BertForMaskedLM (bert), not a causal LM")),
    ("calibrate-out-proc", "calibrate quads_nvfp4 --out /proc/qpass-cal", ("/proc/qpass-cal: cannot create files in /proc",)),
    ("calibrate-out-is-file", "calibrate quads_nvfp4 --out {C}/afile", ("afile exists and is a file",)),
    ("apply-calibration-missing", "apply quads_nvfp4 --out {O} --calibration {C}/nothing", ("--calibration", "nothing: no calibration.json there")),
    ("apply-calibration-garbage", "apply quads_nvfp4 --out {O} --calibration {C}/cal_garbage",
     ("--calibration", "cal_garbage/calibration.json is not readable JSON")),
    ("check-calibration-missing", "check quads_nvfp4 --calibration {C}/nothing", ("--calibration", "nothing: no calibration.json there")),
    ("export-calibration-missing", "export --model default --recipe quads_nvfp4 --out {O} --calibration {C}/nothing",
     ("--calibration", "nothing: no calibration.json there")),
    ("grpo-calibration-missing", "grpo --recipe bf16 --out {O} --calibration {C}/nothing", ("--calibration", "nothing: no calibration.json there")),
    ("grpo-recalibrate-alone", "grpo --recipe bf16 --out {O} --recalibrate", ("--recalibrate needs --calibration CAL",)),
    # ---- bench, recipes, the tree
    ("bench-budget", "bench --budget-s -1", ("--budget-s",)),
    ("bench-out-proc", "bench --quick --out /proc/b.json", ("--out /proc/b.json: cannot create files in /proc",)),
    ("bench-out-dir", "bench --quick --out {C}", ("--out", "is a directory")),
    ("bench-seed", "bench --seed x", ("--seed", "expected an integer seed")),
    ("recipes-flag", "recipes --bogus", ("unrecognized arguments: --bogus",)),
    ("unknown-command", "aply x", ("unknown command 'aply'", "did you mean 'apply'")),
]


def _argv(template: str, corpus: Path, out: Path) -> list[str]:
    return [a.replace("{C}", str(corpus)).replace("{O}", str(out)) for a in template.split()]


def test_every_subcommand_has_rows():
    """A subcommand added to the CLI tree without bad-input rows fails here."""
    covered = {t.split()[0] for _, t, _ in ROWS}
    assert set(COMMANDS) <= covered, set(COMMANDS) - covered
    assert len({r[0] for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize(("row", "template", "needles"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_exit_2_naming_the_culprit_before_any_model_load(row, template, needles, corpus, tmp_path, capsys,
                                                                        no_heavy_work):
    out = tmp_path / "out"
    argv = _argv(template, corpus, out)
    try:
        status = cli_main(argv)
    except SystemExit as exc:  # argparse: a real process exits with this code
        status = exc.code
    except HeavyWork as exc:
        pytest.fail(f"{row}: bad input was not refused before the model load ({exc})")
    err = capsys.readouterr().err
    assert status == 2, (row, status, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    for needle in needles:
        assert needle.replace("{C}", str(corpus)) in err, (row, needle, err[-1500:])
    assert not out.exists() and not Path(f"{out}.png").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no lock, temp or partial output either


def test_escaping_recipe_name_writes_nothing_outside_out(corpus, tmp_path, capsys, no_heavy_work):
    """Old code: ``name: ../../escaped`` with several recipes made ``--out/../../escaped`` the run directory."""
    out = tmp_path / "a" / "b" / "runs"
    assert cli_main(["grpo", "--recipe", f"{corpus}/traversal.yaml,bf16", "--out", str(out)]) == 2
    assert not (out / "../../escaped").exists() and not (tmp_path / "escaped").exists()
    capsys.readouterr()


def test_an_internal_error_is_exit_70_with_its_traceback_never_1(tmp_path, capsys, monkeypatch):
    """Exit 1 means "a parity check failed"; a bug is reported as a bug (old: the exception escaped, exit 1)."""
    import qpass.graph.model

    def broken(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(qpass.graph.model, "load_model", broken)
    assert cli_main(["apply", "bf16", "--out", str(tmp_path / "o")]) == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "qpass: internal error (ZeroDivisionError: a bug); this is a bug in qpass" in err
    assert not (tmp_path / "o").exists()


def test_garbage_grpo_checkpoint_is_bad_input(tmp_path):
    """Old code: ``torch.load`` of random bytes raised ``UnpicklingError`` (a traceback, exit 1).

    Checkpoints are ``<recipe>.ckpt`` directories now (qpass.apps.grpo.checkpoint): a file given as
    one is refused unread, and the legacy converter (the one reader of old ``.pt`` bytes) names it."""
    from qpass.apps.grpo.checkpoint import convert_legacy_checkpoint, load_checkpoint
    from qpass.errors import QpassError

    for name, data in (("garbage.pt", bytes(range(256)) * 2), ("empty.pt", b""), ("text.pt", b"hello world\n"),
                       ("zip.pt", b"PK\x03\x04" + bytes(60))):
        f = tmp_path / name
        f.write_bytes(data)
        with pytest.raises(QpassError, match=rf"{name} is a file, not a qpass-grpo-checkpoint/2 checkpoint directory"):
            load_checkpoint(object(), f)  # refused before the trainer is touched
        with pytest.raises(QpassError, match=rf"{name}: not a readable qpass-grpo-checkpoint/1 file"):
            convert_legacy_checkpoint(f)
        assert not f.with_suffix(".ckpt").exists()


def test_task_size_is_known_without_drawing():
    """Old code: 100500 problems of a 100-problem preset took ~50 s of draws before the error."""
    from qpass.rl.task import ArithmeticConfig, ArithmeticTask, difficulty_preset, task_preset

    assert [difficulty_preset(1).n_distinct(), task_preset("successor").n_distinct(), task_preset("larger").n_distinct()] \
        == [100, 900, 8010]
    assert difficulty_preset(2).n_distinct() == 100 * 100 * 2  # 100 one-or-two-digit values, 2 operators
    assert ArithmeticConfig(n_operands=(2, 3), digits=(1, 1), operators=("+",)).n_distinct() == 10**2 + 10**3
    t = ArithmeticTask(difficulty_preset(1, n_train=90, n_eval=10))  # the whole space can be drawn
    assert len({p.expression for p in t.train + t.eval}) == 100
    with pytest.raises(ValueError, match="could only draw 100 unique problems of the 101 requested"):
        ArithmeticTask(difficulty_preset(1, n_train=91, n_eval=10), max_attempts_factor=10**9)


def test_no_module_uses_a_name_it_never_binds():
    """Old code: the SGLang plugin's refusal of an activation-only checkpoint raised ``QuantizationError``
    without importing it (NameError instead of the intended error). Checked statically for every module."""
    import ast
    import builtins

    import qpass

    root = Path(qpass.__file__).parent
    problems = []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        bound = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__package__"}
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                bound.add(n.id)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.ExceptHandler) and n.name:
                bound.add(n.name)
            elif isinstance(n, ast.arg):
                bound.add(n.arg)
            elif isinstance(n, (ast.Global, ast.Nonlocal)):
                bound.update(n.names)
            elif isinstance(n, ast.MatchAs) and n.name:
                bound.add(n.name)
        problems += [f"{f.relative_to(root)}:{n.lineno}: {n.id}" for n in ast.walk(tree)
                     if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound]
    assert problems == []


# ----------------------------------------------------------------------------- real processes


def _env() -> dict[str, str]:
    import qpass

    env = dict(os.environ)
    src = str(Path(qpass.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    return env


def test_real_process_exit_2_without_traceback(corpus, tmp_path):
    for argv, needle in ((["apply", f"{corpus}/nonutf8.yaml", "--out", str(tmp_path / "o")], "offset 13"),
                         (["grpo", "--recipe", "bf16", "--out", str(tmp_path / "g"), "--top-p", "1.5"], "--top-p 1.5")):
        p = subprocess.run([sys.executable, "-m", "qpass.apps.cli", *argv], capture_output=True, text=True, env=_env(),
                           timeout=300)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


# The child stands in a sleep for the model load (after every check passed), prints a marker, and
# restores Python's SIGINT handler (a child of a non-interactive shell may inherit SIGINT ignored).
_CHILD = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
import qpass.graph.model as m
def slow_load(*a, **k):
    print("QPASS-LOADING", file=sys.stderr, flush=True)
    time.sleep(120)
m.load_model = slow_load
from qpass.apps.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("argv", "sig", "status", "word"), [
    (["apply", "bf16", "--out", "{O}", "--no-floor"], signal.SIGTERM, 143, "terminated"),
    (["grpo", "--recipe", "bf16", "--out", "{O}", "--steps", "1"], signal.SIGINT, 130, "interrupted"),
    (["study", "--out", "{O}", "--quick"], signal.SIGTERM, 143, "terminated"),
], ids=["apply-SIGTERM", "grpo-SIGINT", "study-SIGTERM"])
def test_real_process_signals_are_130_and_143_and_leave_nothing(argv, sig, status, word, tmp_path):
    import threading

    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _CHILD, *[a.replace("{O}", str(out)) for a in argv]],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=_env())
    lines: list[str] = []
    loading = threading.Event()

    def reader() -> None:
        for line in p.stderr:
            lines.append(line)
            if "QPASS-LOADING" in line:
                loading.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:  # wait until the command is past validation, inside its "model load"
        assert loading.wait(timeout=240), "".join(lines)[-2000:]
        p.send_signal(sig)
        rc = p.wait(timeout=60)
        t.join(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    rest = "".join(lines)
    assert rc == status, rest[-2000:]
    assert word in rest and "Traceback" not in rest, rest[-2000:]
    assert [x.name for x in tmp_path.iterdir()] == []  # neither DIR nor a lock or .DIR.partial-*
