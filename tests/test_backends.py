"""The backend seam: the Backend protocol, the built-in catalog and the one registration path
(:func:`qpass.apps.plugins.load_backends`, built-ins plus the ``qpass.backends`` entry-point group)."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

from qpass.apps import plugins
from qpass.backends.base import Backend, BackendUnavailable, ModuleBackend
from qpass.backends.catalog import BUILTIN
from qpass.errors import QpassError


def test_every_builtin_is_a_backend():
    assert sorted(b.name for b in BUILTIN) == ["cuda", "megatron", "onnx", "sglang", "triton", "vllm"]
    for b in BUILTIN:
        assert isinstance(b, Backend) and b.install_hint.startswith("pip install")


def test_unavailable_backend_names_its_install_hint():
    b = ModuleBackend("nope", "qpass_no_such_module", ("qpass_no_such_module",), "pip install qpass-nope")
    assert not b.available()
    with pytest.raises(BackendUnavailable, match="needs qpass_no_such_module: pip install qpass-nope"):
        b.register()


def test_load_backends_unknown_and_reference(monkeypatch):
    monkeypatch.setattr(plugins, "_REGISTERED", {})
    with pytest.raises(QpassError, match=r"unknown backend 'cuda-magic'; known: \['cuda', 'megatron', 'onnx', 'sglang', 'triton', 'vllm'\]"):
        plugins.load_backends(["cuda-magic"])
    assert plugins.load_backends(["reference"]) == {}  # the reference kernels are core: nothing to load


class _Fake:
    def __init__(self, name: str) -> None:
        self.name, self.install_hint, self.calls = name, "pip install fake", 0

    def available(self) -> bool:
        return True

    def register(self) -> None:
        self.calls += 1


def _entry_points(monkeypatch, **objs):
    eps = [types.SimpleNamespace(name=k, value=f"fakepkg:{k}", load=(lambda v=v: v)) for k, v in objs.items()]
    real = importlib.metadata.entry_points
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points",
                        lambda group=None, **kw: eps if group == plugins.ENTRY_POINT_GROUP else real(group=group, **kw))


def test_third_party_backend_through_entry_point(monkeypatch):
    monkeypatch.setattr(plugins, "_REGISTERED", {})
    fake = _Fake("fakekernels")
    _entry_points(monkeypatch, fakekernels=lambda: fake)  # a factory is accepted too
    assert "fakekernels" in plugins.discover_backends()
    got = plugins.load_backends(["fakekernels"])
    plugins.load_backends(["fakekernels"])  # idempotent
    assert got["fakekernels"] is fake and fake.calls == 1 and plugins.registered_backends() == ["fakekernels"]


def test_bad_entry_points_are_named(monkeypatch):
    _entry_points(monkeypatch, broken=object())
    with pytest.raises(QpassError, match=r"entry point 'broken' \(fakepkg:broken\) in group 'qpass.backends' is not a qpass Backend"):
        plugins.discover_backends()
    _entry_points(monkeypatch, triton=_Fake("triton"))
    with pytest.raises(QpassError, match="uses the backend name 'triton', which is taken"):
        plugins.discover_backends()


def test_triton_registers_its_kernels_only_through_the_app_layer(triton_backend):
    from qpass import ops

    assert triton_backend.name == "triton"
    assert "triton" in ops.kernel_backends("nvfp4_linear") and "triton" in ops.kernel_backends("fp8_linear")
