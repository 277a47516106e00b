"""Single files written atomically: a temp file in the same directory, fsync, then ``os.replace``.

A reader (or a crash, or Ctrl-C) never sees a half-written file: ``path`` holds either its old
content or the complete new one. Directories of outputs use :func:`qpass.apps.artifacts.atomic_dir`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """The process umask (read by setting and restoring it; there is no read-only call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (str as UTF-8, or bytes) to ``path`` atomically; creates the parent directory.

    The file gets the mode a plain ``open`` would give (``0o666 & ~umask``), not mkstemp's 0600.
    Raises whatever the write raises; the temp file is removed first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
