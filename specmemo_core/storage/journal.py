"""Message writes the chat history could not take yet, kept in a small append-only JSON-lines file.

One line per write, fsynced, next to the history file; when that folder cannot take even one line (a full
disk), a spare file in the temp folder takes it. The store replays both on open, oldest first, and removes
them once every write in them is saved."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from specmemo_core.storage.atomic import write_text_atomic


@dataclass(frozen=True)
class PendingWrite:
    """A message write waiting to be saved: ``ChatStore`` method name and its arguments (with the timestamp)."""

    method: str  # "add_message" or "update_message"
    args: tuple[object, ...]


class PendingJournal:
    """The journal files of one history file: ``primary`` beside it, ``spare`` in the temp folder."""

    def __init__(self, history: Path) -> None:
        self.primary = history.with_name(history.name + ".pending.jsonl")
        key = hashlib.sha256(str(history.resolve()).encode()).hexdigest()[:16]
        self.spare = Path(tempfile.gettempdir()) / f"specmemo-{key}.pending.jsonl"
        self.location: Path | None = next((p for p in (self.primary, self.spare) if p.exists()), None)

    def append(self, write: PendingWrite) -> Path:
        """Add one write (fsynced); returns the file that took it. Raises OSError when neither could."""
        line = json.dumps({"seq": time.time_ns(), "method": write.method, "args": list(write.args)},
                          ensure_ascii=False) + "\n"
        error: OSError | None = None
        for path in (self.primary, self.spare):
            try:
                _append_line(path, line.encode("utf-8"))
            except OSError as err:
                error = error or err
                continue
            self.location = path
            return path
        assert error is not None
        raise error

    def read(self) -> list[PendingWrite]:
        """Every complete line of both files, oldest first (a line cut short by a full disk is skipped)."""
        entries: list[tuple[int, PendingWrite]] = []
        for path in (self.primary, self.spare):
            with suppress(FileNotFoundError):
                for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                    with suppress(ValueError, KeyError, TypeError):
                        item = json.loads(line)
                        entries.append((int(item["seq"]), PendingWrite(str(item["method"]), tuple(item["args"]))))
        return [write for _, write in sorted(entries, key=lambda e: e[0])]

    def rewrite(self, writes: list[PendingWrite]) -> None:
        """Keep only ``writes`` (none: remove both files), replacing the journal whole.
        NOTE: when no folder can take the shorter file, the longer one stays: replaying an add that was saved
        meanwhile is harmless (the store skips a message it already has), an update is applied again."""
        text = "".join(json.dumps({"seq": seq, "method": w.method, "args": list(w.args)}, ensure_ascii=False) + "\n"
                       for seq, w in enumerate(writes))
        for path in (self.primary, self.spare):
            if not writes:
                with suppress(FileNotFoundError):
                    path.unlink()
                continue
            try:
                write_text_atomic(path, text)
            except OSError:
                continue
            for other in {self.primary, self.spare} - {path}:
                with suppress(FileNotFoundError):
                    other.unlink()
            self.location = path
            return
        if not writes:
            self.location = None


def _append_line(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)
