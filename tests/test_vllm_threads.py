"""``keep_torch_threads``: what an in-process vLLM-CPU worker does to torch's threading is undone when
the engine has started (unit tier: vLLM's two changes are replayed, no vLLM needed; the live-engine
check is ``test_vllm_engine.py::test_engine_start_leaves_torch_threads_alone``)."""

from __future__ import annotations

import torch

from qpass.backends.vllm.engine import keep_torch_threads


def test_restores_set_num_threads_and_the_thread_count():
    orig_fn, n = torch.set_num_threads, torch.get_num_threads()
    target = 1 if n != 1 else 2
    try:
        with keep_torch_threads():
            orig_fn(target)  # vLLM's set_torch_threads_for_runtime (1 thread for serving)
            torch.set_num_threads = lambda x: None  # vLLM's cpu_worker.init_device: a no-op that only warns
            assert torch.get_num_threads() == target
        assert torch.set_num_threads is orig_fn
        assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads = orig_fn
        orig_fn(n)


def test_restores_even_when_the_engine_start_fails():
    orig_fn, n = torch.set_num_threads, torch.get_num_threads()
    try:
        try:
            with keep_torch_threads():
                torch.set_num_threads = lambda x: None
                raise RuntimeError("engine start failed")
        except RuntimeError:
            pass
        assert torch.set_num_threads is orig_fn
    finally:
        torch.set_num_threads = orig_fn
        orig_fn(n)
