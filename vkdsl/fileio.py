"""Atomic file writes: a killed process leaves either the old file or the new one, never half."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def worded(e: OSError, folder: Path, what: str) -> OSError:
    """e as one line: what, and why in words -- a file where a folder should be (errno says only
    "File exists" or "Not a directory"), else the system's reason."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    err = OSError(f"{what} ({f'{blocker} is a file, not a folder' if blocker else e.strerror})")
    err.errno = e.errno
    return err


def make_folder(path) -> Path:
    """mkdir -p, a failure worded (see worded)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise worded(e, path, f"{path}: cannot create this folder") from None
    return path


@contextlib.contextmanager
def atomic_path(path):
    """Yields a temp path in the target's folder for a writer that wants a file name (e.g.
    gguf.GGUFWriter); on success it is fsynced and moved into place, on failure removed."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: a folder is there, expected a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise worded(e, path.parent, f"{path}: cannot write there") from None
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path, data: bytes) -> Path:
    """Write bytes through atomic_path."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return Path(path)
