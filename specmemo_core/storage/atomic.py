"""Replace a file whole or not at all: a failed write (disk full, killed) leaves the old file as it was."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path | str, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to a temporary file in ``path``'s folder, fsync it, then ``os.replace`` it over ``path``.

    On any OSError the temporary file is removed, ``path`` keeps its previous content (or stays absent),
    and the error is raised again for the caller to show."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode(encoding))
            f.flush()
            os.fsync(f.fileno())
        if path.exists():  # a replaced export keeps the permissions its owner gave it
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)
    return path


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX; Windows has no folder handles to fsync)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
