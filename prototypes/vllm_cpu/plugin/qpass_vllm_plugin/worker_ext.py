"""Worker extension: pass `worker_extension_cls="qpass_vllm_plugin.worker_ext.QpassWorkerExtension"`
to `vllm.LLM(...)`; then `llm.collective_rpc("qpass_readback", kwargs=...)` runs these methods
inside each worker by name (no VLLM_ALLOW_INSECURE_SERIALIZATION needed, unlike a callable).
Results travel over msgpack: return plain str/int/float/bytes/list/dict, never tensors.
"""
from __future__ import annotations

import hashlib
import time

import torch

QPARAMS = ("weight", "weight_scale", "weight_scale_2", "weight_global_scale")


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.uint8 else t.numpy().tobytes()


class QpassWorkerExtension:
    def _qpass_model(self):
        return self.model_runner.get_model()

    def qpass_readback(self, with_bytes: bool = False, only: list[str] | None = None) -> dict:
        """Per quantized module (vLLM names, fused: qkv_proj / gate_up_proj): for each NVFP4
        param -> {sha256, shape, dtype, [bytes]}, plus logical_widths and the decode cache hash."""
        out = {}
        for name, mod in self._qpass_model().named_modules():
            qm = getattr(mod, "quant_method", None)
            if type(qm).__name__ != "QpassNvfp4LinearMethod":
                continue
            if only is not None and name not in only:
                continue
            rec = {"logical_widths": list(getattr(mod, "logical_widths", []))}
            for p in QPARAMS + ("qpass_w_dec",):
                t = getattr(mod, p, None)
                if t is None:
                    continue
                b = _bytes(t)
                rec[p] = {"sha256": hashlib.sha256(b).hexdigest(), "shape": list(t.shape),
                          "dtype": str(t.dtype).replace("torch.", "")}
                if with_bytes and p != "qpass_w_dec":
                    rec[p]["bytes"] = b
            out[name] = rec
        return out

    def qpass_reload(self, weights_path: str) -> float:
        """reload_weights from a dir of HF-named safetensors, timed inside the worker."""
        t = time.perf_counter()
        self.reload_weights(weights_path=weights_path)
        return time.perf_counter() - t

    def qpass_rss(self) -> int:
        import psutil
        return psutil.Process().memory_info().rss
