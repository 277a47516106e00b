"""Outputs written atomically: single files (:func:`write_atomic`) and whole directories (:func:`atomic_dir`).

* A file is written to a temp file in the same directory, fsync'ed, then ``os.replace``'d: a reader
  (or a crash, or Ctrl-C) never sees a half-written file.
* A directory is built in a hidden sibling temp directory and renamed into place at the end. The
  output path is **reserved** when the block starts (an exclusive lock file ``.NAME.qpass-lock``
  next to it, holding the owner's host and pid), so a second writer of the same path fails at once
  instead of silently replacing the first one's result at the end; and the final rename refuses a
  directory that appeared (or was replaced) while the block ran. An exception, Ctrl-C or SIGTERM
  removes the temp directory (or, with ``keep_partial``, moves it to ``NAME.partial``): ``DIR`` is
  either complete or absent.

Every qpass command that writes an output directory (``apply``, ``study``, ``grpo``) goes through
:func:`atomic_dir`; every file through :func:`write_atomic` (JSON through :mod:`qpass.jsonio`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

from qpass.errors import QpassError

__all__ = ["AtomicDir", "OutputBusy", "atomic_dir", "check_output_file", "check_output_location", "check_output_path", "current_umask", "pid_alive", "write_atomic"]


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


class OutputBusy(QpassError):
    """Another process holds the output path's reservation, or the path changed under this run."""


FORCE_HINT = ("--force replaces an existing output only if it is an empty directory or a previous "
              "output of the same command (it holds {marker}); it never deletes anything else")


def check_output_path(final: str | Path, *, force: bool = False, marker: str = "report.json") -> None:
    """Validate an output directory path before any long work (called by :func:`atomic_dir`).

    Raises:
        QpassError: ``final`` is a symbolic link (dangling or not: the rename at the end would
            replace the link, not write where it points); it exists and ``force`` is False; it
            exists and is not replaceable (a file, or a non-empty directory without ``marker``);
            its parent is a file; its name is too long for the file system; no file can be created
            where it would go (read-only, a pseudo file system such as /proc, no permission).
    """
    final = Path(final)
    _check_name_lengths(final, "output path")  # first: stat() itself fails on an over-long name
    if final.is_symlink():
        target = os.readlink(final)
        state = "a dangling symbolic link" if not final.exists() else "a symbolic link"
        raise QpassError(f"output path {final} is {state} (-> {target}); give a real directory path "
                         f"(e.g. the link's target {Path(final.parent, target).resolve()})")
    if final.exists():
        why_not = (f"a file" if not final.is_dir() else
                   f"a non-empty directory without {marker}" if any(final.iterdir()) and not (final / marker).is_file()
                   else None)
        if why_not is not None:  # --force would refuse too: say so instead of suggesting it
            raise QpassError(f"output path {final} exists and is {why_not}; choose another --out "
                             f"({FORCE_HINT.format(marker=marker)})")
        if not force:
            kind = "an empty directory" if not any(final.iterdir()) else f"a previous output, it holds {marker}"
            raise QpassError(f"output directory {final} already exists ({kind}); pass --force to replace it")
    _check_parent_and_writable(final, "output path")


#: Room a sibling name needs beyond the output's own name (``.NAME.partial-XXXXXXXX``, ``.NAME.qpass-lock``).
_SIBLING_ROOM = 18
NAME_MAX = 255  # bytes per path component on Linux file systems (ext4, xfs, btrfs, tmpfs)


def _check_name_lengths(final: Path, what: str) -> None:
    """Every component of ``final`` fits :data:`NAME_MAX` bytes, the last one with room for the
    temp / lock siblings (checked lexically: ``stat`` of an over-long name raises ENAMETOOLONG)."""
    for i, part in enumerate(final.parts):
        room = _SIBLING_ROOM if i == len(final.parts) - 1 else 0
        if len(os.fsencode(part)) + room > NAME_MAX:
            raise QpassError(f"{what} {str(final)[:60]}...: the name {part[:24]!r}... is {len(os.fsencode(part))} bytes, "
                             f"more than a file system allows here (at most {NAME_MAX - room})")


def _check_parent_and_writable(path: Path, label: str) -> None:
    """Raise :class:`QpassError` ``"<label> <path>: <p> is not a directory"`` when the nearest existing
    ancestor ``p`` of ``path`` is not a directory; then :func:`_check_writable`."""
    for p in path.parents:
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise QpassError(f"{label} {path}: {p} is not a directory")
            break
    _check_writable(path, label)


def _check_writable(final: Path, what: str) -> None:
    """A file can be created where ``final`` goes: probed with a temp file in its nearest existing
    ancestor, removed at once (permission bits, read-only mounts and pseudo file systems alike).

    Raises:
        QpassError: naming the path and the reason.
    """
    anc = next((p for p in final.parents if p.exists()), Path("."))
    try:
        fd, probe = tempfile.mkstemp(dir=anc, prefix=".qpass-write-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise QpassError(f"{what} {final}: cannot create files in {anc} ({exc.strerror or exc})") from None


def check_output_location(path: str | Path, flag: str) -> None:
    """Validate a directory files will be written into (existing or to be created), e.g.
    ``--checkpoint-dir``, before any work.

    Raises:
        QpassError: ``{flag} PATH``: it or a parent is a file, a name too long, or a location where
            no file can be created.
    """
    path = Path(path)
    _check_name_lengths(path, flag)
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise QpassError(f"{flag} {path}: {p} exists and is not a directory")
            break
    _check_writable(path / ".qpass-write-probe", flag)


def check_output_file(path: str | Path, flag: str) -> None:
    """Validate the path of an output *file* (``--json``, a plot, a benchmark record) before any work.

    Raises:
        QpassError: ``{flag} PATH``: an existing directory, a parent that is a file, a name too
            long, or a location where no file can be created.
    """
    path = Path(path)
    _check_name_lengths(path, flag)
    if path.is_dir():
        raise QpassError(f"{flag} {path} is a directory; give a file path")
    _check_parent_and_writable(path, flag)


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``, failing with FileExistsError if ``dst`` exists (Linux renameat2).

    Where renameat2 is unavailable, a check followed by ``os.rename`` (a short race window; the
    reservation lock keeps other qpass writers out of it).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class AtomicDir:
    """Context manager behind :func:`atomic_dir`; ``kept`` is where a failed run's files went (or None)."""

    def __init__(self, final: str | Path, *, force: bool = False, marker: str = "report.json", keep_partial: bool = False):
        self.final = Path(final)
        self.force, self.marker, self.keep_partial = force, marker, keep_partial
        self.lock = self.final.parent / f".{self.final.name}.qpass-lock"
        self.tmp: Path | None = None
        self.kept: Path | None = None
        self._seen: tuple[int, int] | None = None
        self._locked = False

    # -------------------------------------------------------------- reservation
    def _reserve(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}\n"
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if self._stale():
                    self.lock.unlink(missing_ok=True)
                    continue
                owner = self._owner() or "unknown owner"
                raise OutputBusy(f"output directory {self.final} is being written by another run ({owner}; "
                                 f"reservation {self.lock}); wait for it or choose another --out") from None
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self._locked = True
            return
        raise OutputBusy(f"could not reserve {self.final} ({self.lock} keeps reappearing)")

    def _owner(self) -> str | None:
        try:
            host, pid = self.lock.read_text().split()
        except (OSError, ValueError):
            return None
        return f"pid {pid} on {host}"

    def _stale(self) -> bool:
        """The lock's owner is a dead process on this host (a SIGKILLed run); a half-written lock is
        stale once it is a minute old."""
        try:
            text = self.lock.read_text()
            host, pid = text.split()
            return host == socket.gethostname() and not pid_alive(int(pid))
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            try:
                return time.time() - self.lock.stat().st_mtime > 60
            except FileNotFoundError:
                return True

    def _release(self) -> None:
        if self._locked:
            self.lock.unlink(missing_ok=True)
            self._locked = False

    # -------------------------------------------------------------- context
    def __enter__(self) -> Path:
        check_output_path(self.final, force=self.force, marker=self.marker)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self._reserve()
        try:
            check_output_path(self.final, force=self.force, marker=self.marker)  # again, under the reservation
            self._seen = _identity(self.final)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.partial-", dir=self.final.parent))
        except BaseException:
            self._release()
            raise
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.tmp is not None
        try:
            if exc_type is not None:
                self._abandon()
                return False
            _umask_permissions(self.tmp)
            self._place()
        finally:
            self._release()
        return False

    def _abandon(self) -> None:
        if not self.tmp.exists():
            return
        if self.keep_partial:
            part = self.final.with_name(self.final.name + ".partial")
            if part.is_dir() and not part.is_symlink():
                shutil.rmtree(part, ignore_errors=True)
            os.rename(self.tmp, part)
            self.kept = part
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _place(self) -> None:
        now = _identity(self.final)
        if now != self._seen:
            self._refuse("appeared" if self._seen is None else "was replaced")
        old = None
        if now is not None:  # --force, checked at the start: move the previous output aside
            old = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.old-", dir=self.final.parent))
            os.rename(self.final, old / self.final.name)
        try:
            _rename_noreplace(self.tmp, self.final)
        except FileExistsError:
            if old is not None and not os.path.lexists(self.final):
                os.rename(old / self.final.name, self.final)
                shutil.rmtree(old, ignore_errors=True)
            self._refuse("appeared")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _refuse(self, what: str) -> None:
        kept = self.final.with_name(f"{self.final.name}.unplaced-{os.getpid()}")
        os.rename(self.tmp, kept)
        self.kept = kept
        raise OutputBusy(f"output directory {self.final} {what} while this run was writing it (another process "
                         f"wrote there); it was left untouched and this run's result is in {kept}")


def atomic_dir(final: str | Path, *, force: bool = False, marker: str = "report.json", keep_partial: bool = False) -> AtomicDir:
    """A context manager yielding a temp directory that becomes ``final`` only if the block completes.

    ``with atomic_dir(out) as tmp: ...write into tmp...``. With ``force``, an existing ``final`` is
    replaced only if it is an empty directory or a previous output (it holds ``marker``).

    Raises:
        QpassError: (on entry) see :func:`check_output_path`.
        OutputBusy: (on entry) another live process holds the reservation of ``final``; (on exit)
            ``final`` appeared or was replaced by someone else while the block ran (it is left
            alone; the result is moved to ``NAME.unplaced-PID`` and the message says so).
    """
    return AtomicDir(final, force=force, marker=marker, keep_partial=keep_partial)


def _umask_permissions(root: Path) -> None:
    """Give ``root`` and everything under it the modes a plain ``open``/``mkdir`` would have.

    ``tempfile.mkdtemp`` creates 0700 and safetensors' ``save_file`` writes 0600 files; a finished
    output directory is meant to be read by others as the process umask allows (0755 / 0644 at
    umask 022).
    """
    mask = current_umask()
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)
