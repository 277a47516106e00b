"""Compile qpass's CUDA C++ kernels with NVRTC and launch them on torch's current stream.

The kernels (``kernels/*.cu`` and the ``*.cuh`` they include, shipped as package data) are plain CUDA C++ with inline PTX and no
header includes, so NVRTC compiles them in about a second and no CUDA toolkit is needed: NVRTC and
the driver API come from the ``cuda-bindings`` package (``pip install "qpass[cuda]"``), the NVRTC
library from ``nvidia-cuda-nvrtc`` (a dependency of CUDA builds of torch). Compiling needs no GPU
(``compile_cubin``: the CPU tests compile every variant for sm_90 and read its resources); loading and
launching need one.

A compiled variant is keyed by (source file, macro definitions, target architecture); cubins are
cached in memory and on disk (``$QPASS_CUDA_CACHE`` or ``~/.cache/qpass/cuda``, written atomically),
so a process pays NVRTC once per variant and machine.

Launches go through ``cuLaunchKernel`` on ``torch.cuda.current_stream()``, so they are ordered with
torch's work and are captured by CUDA graphs like any torch kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from qpass.errors import QpassError

KERNEL_DIR = Path(__file__).with_name("kernels")
NVRTC_OPTIONS = ("--std=c++17", "--fmad=false", "--extra-device-vectorization")


class CudaKernelError(QpassError):
    """NVRTC compile failure, a missing ``cuda-bindings`` install, or a failed driver call."""


def available() -> bool:
    """True when ``cuda.bindings`` (NVRTC + driver API) can be imported."""
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.bindings.nvrtc  # noqa: F401
    except Exception:  # noqa: BLE001 (any import failure means: not available)
        return False
    return True


def _bindings():
    try:
        from cuda.bindings import driver, nvrtc
    except Exception as exc:  # noqa: BLE001
        raise CudaKernelError(
            f"qpass's CUDA kernels need the cuda-bindings package (pip install 'qpass[cuda]'): {exc}"
        ) from exc
    return driver, nvrtc


def _check(res, what: str):
    """Unwrap a cuda-bindings ``(status, *values)`` tuple; raise naming ``what`` on failure."""
    status, *vals = res if isinstance(res, tuple) else (res,)
    if int(status) != 0:
        raise CudaKernelError(f"{what} failed: {status!r}")
    return vals[0] if len(vals) == 1 else tuple(vals)


def _cache_dir() -> Path:
    return Path(os.environ.get("QPASS_CUDA_CACHE") or Path.home() / ".cache" / "qpass" / "cuda")


def variant_key(source: str, defines: dict[str, int], arch: str) -> str:
    """Stable key of one compiled variant (source text, macros, architecture, NVRTC options)."""
    h = hashlib.sha256()
    h.update(source.encode())
    h.update(repr(sorted(defines.items())).encode())
    h.update(arch.encode())
    h.update(repr(NVRTC_OPTIONS).encode())
    return h.hexdigest()[:24]


_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"\s*$', re.MULTILINE)


def kernel_source(name: str) -> str:
    """``kernels/<name>.cu`` with each ``#include "<file>.cuh"`` line replaced by that file of
    ``kernels/`` (once per file; NVRTC is given no include path, so the variant key hashes what it
    compiles).

    Raises:
        CudaKernelError: an included file that does not exist.
    """
    seen: set[str] = set()

    def expand(text: str) -> str:
        def one(m: re.Match) -> str:
            inc = m.group(1)
            if inc in seen:
                return f"// {inc}: already included"
            seen.add(inc)
            path = KERNEL_DIR / inc
            if not path.exists():
                raise CudaKernelError(f"kernels/{name}.cu includes {inc}, which is not in {KERNEL_DIR}")
            return expand(path.read_text())
        return _INCLUDE.sub(one, text)

    return expand((KERNEL_DIR / f"{name}.cu").read_text())


def compile_cubin(name: str, defines: dict[str, int], arch: str = "sm_90") -> bytes:
    """NVRTC-compile ``kernels/<name>.cu`` with ``-D`` macros for ``arch``; returns the cubin.

    Raises:
        CudaKernelError: cuda-bindings missing, or the compile failed (the NVRTC log is in the message).
    """
    source = kernel_source(name)
    key = variant_key(source, defines, arch)
    disk = _cache_dir() / f"{name}-{arch}-{key}.cubin"
    if disk.exists():
        return disk.read_bytes()
    _, nvrtc = _bindings()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS),
            *(f"-D{k}={int(v)}".encode() for k, v in sorted(defines.items()))]
    res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    log_size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    # NVRTC writes into these buffers: they must be mutable, never ``b" " * n`` (for n == 1 that is
    # CPython's shared one-byte object, which the write would corrupt for the whole process)
    log = bytearray(max(log_size, 1))
    nvrtc.nvrtcGetProgramLog(prog, log)
    if int(res[0]) != 0:
        text = bytes(log).rstrip(b"\0").decode(errors="replace")
        raise CudaKernelError(f"NVRTC could not compile {name}.cu {defines} for {arch}:\n{text}")
    size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    buf = bytearray(size)
    _check(nvrtc.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
    cubin = bytes(buf)
    nvrtc.nvrtcDestroyProgram(prog)
    try:
        disk.parent.mkdir(parents=True, exist_ok=True)
        tmp = disk.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        os.replace(tmp, disk)
    except OSError:
        pass  # the cache is an optimisation only
    return cubin


@dataclass(frozen=True)
class Kernel:
    """A loaded kernel function of one device."""

    name: str
    function: object
    device: int


_LOADED: dict[tuple, Kernel] = {}
_LOCK = threading.Lock()


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return f"sm_{major}{minor}"


def get_kernel(name: str, entry: str, defines: dict[str, int], device_index: int) -> Kernel:
    """Compile (or take from the caches) and load ``entry`` of ``kernels/<name>.cu`` on a device."""
    key = (name, entry, tuple(sorted(defines.items())), device_index)
    hit = _LOADED.get(key)
    if hit is not None:
        return hit
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            return hit
        import torch

        driver, _ = _bindings()
        cubin = compile_cubin(name, defines, device_arch(device_index))
        torch.cuda.init()
        with torch.cuda.device(device_index):
            torch.cuda.current_stream()  # makes torch's primary context current on this thread
            mod = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
            fn = _check(driver.cuModuleGetFunction(mod, entry.encode()), f"cuModuleGetFunction({entry})")
        k = Kernel(entry, fn, device_index)
        _LOADED[key] = k
        return k


_SHARED_OPT_IN: dict[int, int] = {}


def _allow_shared(driver, kernel: Kernel, nbytes: int) -> None:
    """``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` of the kernel raised to ``nbytes`` (kept)."""
    key = id(kernel.function)
    if _SHARED_OPT_IN.get(key, 0) >= nbytes:
        return
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(driver.cuFuncSetAttribute(kernel.function, attr, nbytes), f"cuFuncSetAttribute({kernel.name}, {nbytes} B)")
    _SHARED_OPT_IN[key] = nbytes


_ARG_TYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int32, "f": ctypes.c_float}


def launch(kernel: Kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, sig: str,
           shared_bytes: int = 0) -> None:
    """``cuLaunchKernel`` on torch's current stream of the kernel's device.

    Args:
        args: kernel arguments in order; tensors and ``None`` for pointers (``p``), ints (``i``),
            floats (``f``), ``ctypes.Structure`` values passed by value (``s``), as ``sig`` spells
            them (one letter per argument).
        shared_bytes: dynamic shared memory of the launch (the kernel is opted in to that size first).
    """
    import torch

    driver, _ = _bindings()
    if len(sig) != len(args):
        raise CudaKernelError(f"{kernel.name}: {len(args)} arguments for signature {sig!r}")
    holders = []
    for a, s in zip(args, sig):
        if s == "p":
            holders.append(ctypes.c_void_p(0 if a is None else a.data_ptr()))
        elif s == "s":  # a ctypes.Structure passed by value
            holders.append(a)
        else:
            holders.append(_ARG_TYPES[s](a))
    ptrs = (ctypes.c_void_p * len(holders))(*(ctypes.addressof(h) for h in holders))
    if shared_bytes:  # static + dynamic above 48 KiB needs the opt-in: set it for any dynamic size (once per size)
        _allow_shared(driver, kernel, shared_bytes)
    stream = driver.CUstream(torch.cuda.current_stream(kernel.device).cuda_stream)
    _check(driver.cuLaunchKernel(kernel.function, *grid, *block, shared_bytes, stream, ctypes.addressof(ptrs), 0),
           f"cuLaunchKernel({kernel.name})")
