"""Append-only JSONL metric logs and atomic small-file writes for GRPO runs.

One JSON object per line, one line per step. :func:`append_jsonl` encodes the whole line first and
hands it to the kernel with a single ``write`` on an ``O_APPEND`` descriptor, then ``fsync``s, so
a crash or Ctrl-C leaves at most one truncated *last* line and never interleaves two rows;
:func:`read_jsonl` skips (and reports) such a tail. Values go through the one JSON writer
(:mod:`qpass.jsonio`): non-finite floats (NaN, +-inf) are written as ``null`` with a ``KEY_reason``
field beside them (strict JSON has no NaN; "no data" is what they mean in the metric rows).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qpass.atomic import write_atomic as write_text_atomic
from qpass.jsonio import dumps, json_safe
from qpass.jsonio import write_json as write_json_atomic

log = logging.getLogger(__name__)

__all__ = ["append_jsonl", "json_safe", "read_jsonl", "write_json_atomic", "write_text_atomic"]


def append_jsonl(path: str | Path, row: Mapping[str, Any], *, fsync: bool = True) -> None:
    """Append one row to a JSONL file as a single ``write`` (see module docstring).

    Args:
        path: file to append to (created if missing; its directory must exist).
        row: a mapping; values pass through :func:`json_safe`.
        fsync: flush to disk before returning (default True: one row per training step).
    Raises:
        TypeError: ``row`` is not a mapping.
        OSError: the file cannot be opened or written.
    """
    if not isinstance(row, Mapping):
        raise TypeError(f"row must be a mapping, got {type(row).__name__}")
    data = (dumps(row, compact=True) + "\n").encode()
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a truncated (non-decodable) *last* line is skipped with a warning.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not UTF-8, a line other than the last is not valid JSON, or a row is
            not a JSON object (the file is corrupt; path and line named).
    """
    try:
        lines = Path(path).read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
                         "not a qpass JSONL file") from None
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                log.warning("%s: skipping a truncated last line (%d bytes)", path, len(line))
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i + 1}: a row must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
