"""Load the kernel package in the execution mode a tensor needs.

``@triton.jit`` builds either a GPU ``JITFunction`` or a CPU ``InterpretedFunction`` depending on
``TRITON_INTERPRET`` *when the decorator runs*. To let the same process run CUDA tensors on the GPU
and CPU tensors under the interpreter (tests, ``qpass bench --quick``) regardless of import order,
the ``kernels`` package is imported twice under two module names, once per mode, with the
interpreter switch set only for the duration of that import.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

_KERNEL_DIR = Path(__file__).with_name("kernels")
_NAMES = {False: "qpass.backends.triton._kernels_gpu", True: "qpass.backends.triton._kernels_interp"}
_LIBS: dict[bool, ModuleType] = {}
_LOCK = threading.Lock()


def _import_copy(interpret: bool) -> ModuleType:
    from triton import knobs

    name = _NAMES[interpret]
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved_knob = knobs.runtime.__dict__.pop("interpret", None)
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(
            name, _KERNEL_DIR / "__init__.py", submodule_search_locations=[str(_KERNEL_DIR)]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            raise
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if saved_knob is not None:
            knobs.runtime.__dict__["interpret"] = saved_knob
    return mod


def wants_interpreter(device: torch.device) -> bool:
    """CPU tensors always run under the interpreter; CUDA tensors too when TRITON_INTERPRET=1."""
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def kernel_lib(device: torch.device | str) -> ModuleType:
    """The kernels package compiled for ``device`` (a module with submodules ``amax``, ``nvfp4_quant``...)."""
    interpret = wants_interpreter(torch.device(device))
    lib = _LIBS.get(interpret)
    if lib is None:
        with _LOCK:
            lib = _LIBS.get(interpret)
            if lib is None:
                lib = _LIBS[interpret] = _import_copy(interpret)
    return lib
