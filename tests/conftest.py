"""Shared fixtures and the test tiers.

Tiers (markers registered in ``pyproject.toml``):

* unit (no marker): tiny random models and synthetic tensors, seconds each
  (``python -m pytest -q -m "not slow and not gpu and not distributed"``);
* ``slow``: the real default model (SmolLM2-135M). The whole tier shares ONE load + capture
  (``default_pipeline``) and ONE ``qpass apply`` output (``quads_apply_dir``) per pytest run;
* ``gpu``: needs CUDA, skipped here when no device is visible;
* ``distributed``: spawns torch.distributed gloo processes on CPU.

The README test command (``.ci/run``) runs everything that is not ``gpu``
(``python -m pytest -q -m "not gpu"``); run with plain ``pytest``, gpu tests skip without CUDA.

Determinism: every test starts from ``torch``/``random``/``numpy`` seeded with 0 (autouse fixture
below), Hypothesis runs derandomized (its examples are a function of the test), and the Triton tests
seed from their node id (``tests/_triton_testutil.fresh_seed``).
"""

from __future__ import annotations

import os
import random
import sys
import shutil
import warnings
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

try:  # derandomized: the same examples every run (a failure reproduces with the same command)
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("qpass", derandomize=True, database=None, print_blob=True)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "qpass"))
except ImportError:  # hypothesis is a test extra; modules that need it fail on their own import
    pass


_DEFAULT_MODEL_FIXTURES = {"default_loaded", "default_pipeline", "quads_apply_dir"}
_CPU_SECONDS: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="qpass: list the N tests that used the most CPU seconds (this process + reaped children, "
                          "setup/call/teardown together) and the total; unlike --durations it does not grow when "
                          "other jobs share the CPU, so it estimates the time on an idle machine")


def _cpu_now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    t0 = _cpu_now()
    yield
    _CPU_SECONDS[item.nodeid] = _cpu_now() - t0


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    n = config.getoption("--cpu-durations")
    if n is None or not _CPU_SECONDS:
        return
    tr = terminalreporter
    tr.write_sep("=", f"CPU seconds per test (top {n})")
    for nodeid, sec in sorted(_CPU_SECONDS.items(), key=lambda kv: -kv[1])[:n]:
        tr.write_line(f"{sec:9.2f}s  {nodeid}")
    tr.write_line(f"{sum(_CPU_SECONDS.values()):9.2f}s  total CPU over {len(_CPU_SECONDS)} tests "
                  f"(process CPU at exit incl. collection: {_cpu_now():.1f}s)")


def _vllm_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config, items):
    """``vllm`` tests are deselected where vLLM is not importable, unless ``$CI`` is set. Every test that uses a default-model fixture is in the ``slow`` tier (marked or not), so
    ``-m "not slow"`` never loads the model; ``gpu`` tests skip (not fail) without a CUDA device."""
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="gpu tier: needs a CUDA device")
    if not _vllm_importable() and not os.environ.get("CI"):  # on CI a missing vLLM must fail, not vanish
        keep = [it for it in items if it.get_closest_marker("vllm") is None]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("vllm") is not None])
            items[:] = keep
    for item in items:
        if _DEFAULT_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fixed_seeds():
    """Every test starts from the same global RNG state, whatever ran before it."""
    torch.manual_seed(0)
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    yield


@pytest.fixture(autouse=True, scope="session")
def _reproducers_in_tmp(tmp_path_factory):
    """Pass-failure reproducers written by tests go to pytest's temp dir, not the shared /tmp."""
    os.environ["QPASS_REPRODUCER_DIR"] = str(tmp_path_factory.mktemp("reproducers"))
    yield
    os.environ.pop("QPASS_REPRODUCER_DIR", None)


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A 2-layer Llama with random weights (hidden 64, MLP 128, 4 heads / 2 KV heads, vocab 256)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                      tie_word_embeddings=False)
    m = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # give one input channel a real outlier, as in real LLM activations
        for layer in m.model.layers:
            layer.post_attention_layernorm.weight[5] = 20.0
    for p in m.parameters():
        p.requires_grad_(False)
    return m


@pytest.fixture(scope="session")
def tiny_pipeline():
    from qpass.graph.model import LoadedModel
    from qpass.pipeline import Pipeline

    m = tiny_llama()
    return Pipeline.prepare(loaded=LoadedModel(model=m, tokenizer=None, name="tiny-llama", source="random"),
                            batch_size=4, max_len=32)


# ----------------------------------------------------------------------------- slow tier (default model)


@pytest.fixture(scope="session")
def default_loaded():
    from qpass.graph.model import load_model

    return load_model("default")


@pytest.fixture(scope="session")
def default_pipeline(default_loaded):
    """The default model captured once per run with a 4-row rollout batch and a 64-slot KV cache.

    Shared by every slow test: ``build`` clones the base graphs, so tests may train what they build,
    but nothing may modify ``default_pipeline`` itself.
    """
    from qpass.pipeline import Pipeline

    return Pipeline.prepare(loaded=default_loaded, batch_size=4, max_len=64)


QUADS_APPLY_OPTIONS = {"prompts": 2, "samples": 2, "max_new_tokens": 8, "batch_size": 4}


@pytest.fixture(scope="session")
def quads_apply_dir(default_pipeline, tmp_path_factory):
    """ONE ``qpass apply quads_nvfp4`` on the default model per run: ``(status, report, out_dir)``.

    Read-only for its users: a test that corrupts artifacts works on ``copy_apply_output(out, tmp)``.
    """
    from qpass.apps.apply import ApplyOptions, run_apply

    out = tmp_path_factory.mktemp("apply") / "quads"
    status, report = run_apply("quads_nvfp4", out, ApplyOptions(**QUADS_APPLY_OPTIONS), pipeline=default_pipeline)
    return status, report, out


def copy_apply_output(src: Path, dst: Path, *, learner: bool = True) -> Path:
    """A private copy of an apply output to corrupt: report and rollout files are copied; the large
    learner state (270 MB on the default model) is hard-linked when possible, so tests must only
    read it (``save_file`` rewrites in place and would reach the shared original)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():  # report.json, report.md, plots (report.json lists the sha256 of each)
        if f.is_file():
            shutil.copy(f, dst / f.name)
    shutil.copytree(src / "rollout", dst / "rollout")
    if learner and (src / "learner").is_dir():
        (dst / "learner").mkdir()
        for f in (src / "learner").iterdir():
            try:
                os.link(f, dst / "learner" / f.name)
            except OSError:
                shutil.copy(f, dst / "learner" / f.name)
    return dst


def check_plugin_without_engine(monkeypatch, engine: str, available, register, plugin_classes) -> None:
    """With every module of ``engine`` (``"vllm"``, ``"sglang"``) hidden, the plugin's ``available()`` and
    ``register()`` are False and ``plugin_classes()`` raises ImportError (its cache cleared before and after)."""
    for name in [m for m in sys.modules if m == engine or m.startswith(f"{engine}.")] + [engine]:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import <engine>...` raise ImportError
    plugin_classes.cache_clear()
    try:
        assert available() is False
        assert register() is False
        with pytest.raises(ImportError):
            plugin_classes()
    finally:
        plugin_classes.cache_clear()


@pytest.fixture
def triton_backend():
    """The Triton backend registered through the app layer's one registration path."""
    pytest.importorskip("triton")
    from qpass.apps.plugins import load_backends

    return load_backends(["triton"])["triton"]
