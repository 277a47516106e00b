"""``qpass.graph.gguf_once``: one parse of a GGUF file per model load, nothing patched outside it.

Fast tier: a two-field GGUF written with ``gguf.GGUFWriter`` (the slow tier's
``tests/test_smoke_preset.py`` checks the default model loads to the same weights and tokenizer).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from qpass.graph.gguf_once import gguf_parsed_once

gguf = pytest.importorskip("gguf")


def _write(path, values):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.asarray(values, dtype=np.float32).reshape(4, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_one_reader_per_file_and_one_name_map_per_arch_inside_the_context(tmp_path):
    a, b = _write(tmp_path / "a.gguf", range(32)), _write(tmp_path / "b.gguf", range(32, 64))
    orig_reader, orig_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once() as counts:
        ra1, ra2, rb = gguf.GGUFReader(a), gguf.GGUFReader(str(a)), gguf.GGUFReader(b)
        m1, m2 = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2), gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        m3 = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 3)
    assert ra1 is ra2 and rb is not ra1
    assert m1 is m2 and m3 is not m1
    assert counts == {"reader_parses": 2, "reader_reuses": 1, "name_map_builds": 2, "name_map_reuses": 1}
    assert ra1.tensors[0].data.tolist() == np.arange(32, dtype=np.float32).reshape(4, 8).tolist()
    assert rb.tensors[0].data.tolist() == np.arange(32, 64, dtype=np.float32).reshape(4, 8).tolist()
    assert m1.get_name("model.embed_tokens") == "token_embd"
    assert gguf.GGUFReader is orig_reader and gguf.get_tensor_name_map is orig_map


def test_rewritten_file_is_parsed_again_and_writable_modes_are_not_shared(tmp_path):
    p = _write(tmp_path / "a.gguf", range(32))
    with gguf_parsed_once() as counts:
        first = gguf.GGUFReader(p)
        _write(p, [7.0] * 32)
        st = os.stat(p)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a new mtime even on a coarse clock
        second = gguf.GGUFReader(p)
        copy_on_write = gguf.GGUFReader(p, "c")
    assert second is not first and second.tensors[0].data.tolist() == [[7.0] * 8] * 4
    assert copy_on_write is not second
    assert counts["reader_parses"] == 2 and counts["reader_reuses"] == 0


def test_patches_are_restored_on_error():
    orig_reader, orig_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="boom"), gguf_parsed_once():
        assert gguf.GGUFReader is not orig_reader
        raise RuntimeError("boom")
    assert gguf.GGUFReader is orig_reader and gguf.get_tensor_name_map is orig_map
