"""Parse a GGUF file once per model load.

``transformers`` reads a GGUF checkpoint three times for one ``from_pretrained`` pair (the
tokenizer, the config, the weights), each time through a new ``gguf.GGUFReader`` that parses the
whole metadata block again (about 3 s per parse for the default model's 49k-token vocabulary on one
CPU core), and it rebuilds ``gguf.get_tensor_name_map(arch, n_layers)`` once per submodule of the
model (about 400 times). Inside :func:`gguf_parsed_once` both are memoized: one reader per file
(read-only memory map, ``mode="r"``; keyed on the resolved path, size and mtime) and one name map
per ``(arch, n_layers)``. The readers return the same bytes, so the loaded weights, config and
tokenizer are the same as without it; only the repeated parsing goes.

Outside the context nothing is patched; a missing ``gguf`` package makes it a no-op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["gguf_parsed_once"]


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[dict[str, int]]:
    """Memoize ``gguf.GGUFReader`` (mode ``"r"``) and ``gguf.get_tensor_name_map`` while the context is open.

    Yields:
        counters ``{"reader_parses": n, "reader_reuses": n, "name_map_builds": n, "name_map_reuses": n}``
        (updated as the context runs; for tests and logs).
    Restores both attributes of the ``gguf`` module on exit, also on error.
    """
    counts = {"reader_parses": 0, "reader_reuses": 0, "name_map_builds": 0, "name_map_reuses": 0}
    try:
        import gguf
    except ImportError:
        yield counts
        return
    orig_reader, orig_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, int, int], Any] = {}
    maps: dict[tuple[Any, int], Any] = {}

    def memo(cache: dict, key: tuple, hit: str, miss: str, make: Any) -> Any:
        counts[hit if key in cache else miss] += 1
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> Any:
        if mode != "r":
            return orig_reader(path, mode)
        p = Path(path).resolve()
        st = p.stat()
        return memo(readers, (str(p), st.st_size, st.st_mtime_ns), "reader_reuses", "reader_parses",
                    lambda: orig_reader(path, mode))

    def name_map(arch: Any, n_blocks: int) -> Any:
        return memo(maps, (arch, n_blocks), "name_map_reuses", "name_map_builds", lambda: orig_map(arch, n_blocks))

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield counts
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = orig_reader, orig_map
