"""Moving bytes into the data folder: progress reports, a hashing copy, and the error for a
folder that cannot be written. Shared by the pip route (``sources``) and the frozen app's
own download (``wheel_fetch``)."""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path
from typing import BinaryIO, Callable

from specmemo_core.errors import FetchError
from specmemo_core.storage.data_folder import data_dir

Progress = Callable[[str, float], None]  # (stage text, fraction of that stage done, 0..1)

CHUNK = 8 << 20  # large blocks: hashing runs at disk speed
_STORAGE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def hash_copy(src: BinaryIO, dst: BinaryIO | None, total: int, progress: Progress, stage: str) -> str:
    """sha256 of a stream, optionally copying it: one pass over 100 MB instead of two."""
    digest, done = hashlib.sha256(), 0
    while block := src.read(CHUNK):
        digest.update(block)
        if dst is not None:
            dst.write(block)
        done += len(block)
        progress(stage, min(done / max(total, 1), 1.0))
    return digest.hexdigest()


def storage_failure(exc: BaseException, dest: Path) -> FetchError | None:
    """The error for a data folder that cannot be written (read-only, no permission, full),
    naming the folder and how to choose another; None when ``exc`` is not such a failure."""
    if not isinstance(exc, OSError) or exc.errno not in _STORAGE_ERRNOS:
        return None
    folder = data_dir()
    where = folder if dest.is_relative_to(folder) else dest.parent
    return FetchError(f"the data folder {where} cannot be written ({exc.strerror or exc}), so {dest.name} cannot be "
                      f"saved. Make it writable or free space there, or set SPECMEMO_DATA_DIR=/some/writable/folder "
                      f"to keep SpecMemo's data in another folder")
