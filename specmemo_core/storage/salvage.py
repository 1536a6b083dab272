"""Read what is still readable from a damaged chat history file, row by row.

One damaged page must not hide the whole history: rows are read in id order, and where a read raises
``sqlite3.DatabaseError`` the reader probes the following ids one at a time until it is past the damage."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

# NOTE: a bound on single-id probes past one damaged region, so a file with wildly sparse ids cannot stall the
# start-up; ids are dense here (INTEGER PRIMARY KEY, never reused gaps beyond deleted chats).
MAX_PROBES = 200_000
_CONV = {"id": int, "title": str, "created": float, "updated": float, "system_prompt": str, "settings_json": str}
_MSG = {"id": int, "conversation_id": int, "role": str, "content": str, "created": float, "complete": int,
        "stats_json": str}


@dataclass(frozen=True)
class Salvage:
    """What was copied out of a damaged history file into the new one."""

    original: Path  # the damaged file, set aside and never changed
    conversations: int
    messages: int

    @property
    def summary(self) -> str:
        return (f"The chat history was damaged. {self.messages} message(s) in {self.conversations} chat(s) were "
                f"recovered; the damaged file is kept as {self.original}.")


def salvage(damaged: Path, into: sqlite3.Connection) -> Salvage:
    """Copy every readable conversation and message of ``damaged`` (opened read-only, its WAL ignored) into
    ``into`` (an empty, current-schema history) in one transaction; a chat whose own row is lost gets a
    placeholder title. A file that cannot be opened at all yields nothing."""
    try:
        with closing(sqlite3.connect(damaged.resolve().as_uri() + "?mode=ro&immutable=1", uri=True)) as src:
            conversations = [_typed(row, _CONV) for row in _readable(src, "conversations", _CONV)]
            messages = [_typed(row, _MSG) for row in _readable(src, "messages", _MSG)]
    except sqlite3.DatabaseError:
        return Salvage(damaged, 0, 0)
    conversations = [c for c in conversations if c is not None]
    messages = [m for m in messages if m is not None]
    known = {c["id"] for c in conversations}
    for m in messages:
        if m["conversation_id"] not in known:
            known.add(m["conversation_id"])
            conversations.append({"id": m["conversation_id"], "title": "Recovered chat", "created": m["created"],
                                  "updated": m["created"]})
    into.execute("BEGIN IMMEDIATE")
    try:
        for table, rows in (("conversations", conversations), ("messages", messages)):
            for row in rows:
                into.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                             tuple(row.values()))
        into.execute("COMMIT")
    except BaseException:
        into.execute("ROLLBACK")
        raise
    return Salvage(damaged, len(conversations), len(messages))


def _typed(row: dict[str, object], types: dict[str, type]) -> dict[str, object] | None:
    """The row with its values checked against the column types (damage can also garble a value)."""
    out: dict[str, object] = {}
    for name, value in row.items():
        kind = types[name]
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
        out[name] = value
    return out


def _readable(src: sqlite3.Connection, table: str, types: dict[str, type]) -> Iterator[dict[str, object]]:
    """Rows of ``table`` in id order, skipping the ones on damaged pages; only columns the file has."""
    try:
        have = [row[1] for row in src.execute(f"PRAGMA table_info({table})")]
    except sqlite3.DatabaseError:
        return
    cols = [c for c in types if c in have]
    if "id" not in cols:
        return
    scan = f"SELECT {', '.join(cols)} FROM {table} WHERE id > ? ORDER BY id"
    last, probe, top = 0, 0, _top_id(src, table)
    while True:
        try:
            for row in src.execute(scan, (last,)):
                last = row[0]
                yield dict(zip(cols, row))
            return
        except sqlite3.DatabaseError:
            probe = max(probe, last) + 1  # past the id that failed last time, so every pass makes progress
            found = _next_readable(src, table, probe, top)
            if found is None:
                return
            probe, last = found, found - 1


def _next_readable(src: sqlite3.Connection, table: str, start: int, top: int) -> int | None:
    """The first id from ``start`` whose lookup does not raise (its page is readable), if any up to ``top``."""
    for ident in range(start, min(top, start + MAX_PROBES) + 1):
        try:
            src.execute(f"SELECT * FROM {table} WHERE id = ?", (ident,)).fetchall()
        except sqlite3.DatabaseError:
            continue
        return ident
    return None


def _top_id(src: sqlite3.Connection, table: str) -> int:
    """The largest id (0 when even that cannot be read: then nothing past the first damage is probed)."""
    try:
        return int(src.execute(f"SELECT max(id) FROM {table}").fetchone()[0] or 0)
    except sqlite3.DatabaseError:
        return 0
