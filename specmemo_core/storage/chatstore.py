"""Chat history in one SQLite file that survives crashes, full disks and app upgrades.

Each write is its own committed transaction (WAL), so a kill loses at most the reply in flight; message
writes that fail for reasons that pass (disk full, read-only folder) wait in `pending` for flush_pending()."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specmemo_core.errors import SpecMemoError
from specmemo_core.text import encodable

log = logging.getLogger(__name__)

FILE_NAME = "history.sqlite3"
_CONV_COLS = "id, title, created, updated, system_prompt, settings_json"
_MSG_COLS = "id, conversation_id, role, content, created, complete, stats_json"
_SAVE = "save the message"
# Primary SQLite result codes that decide how a failure is handled, and the text Python < 3.11 gives instead.
_PERM, _READONLY, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = 3, 8, 11, 13, 14, 26
_READ_ONLY = ("the data folder is read-only", "you may write there again", "Make the data folder writable.")
_FAILURES = {_FULL: ("the disk is full", "disk space is free again", "Free some disk space."),
             _READONLY: _READ_ONLY, _PERM: _READ_ONLY, _CANTOPEN: _READ_ONLY}
_CODE_TEXT = {"disk is full": _FULL, "readonly": _READONLY, "malformed": _CORRUPT, "not a database": _NOTADB}


class ChatStoreError(SpecMemoError):
    """The chat history could not be read or changed."""


class StoreVersionError(ChatStoreError):
    """The history file comes from a newer app; it is left untouched so that app can still read it."""


class StoreWriteError(ChatStoreError):
    """A write failed for a reason that may pass (disk full, read-only folder); message writes wait in `pending`."""


@dataclass(frozen=True)
class Conversation:
    """One chat as listed in the sidebar; settings are JSON so new options need no migration."""

    id: int
    title: str
    created: float
    updated: float
    system_prompt: str
    settings_json: str


@dataclass(frozen=True)
class Message:
    """One turn; `complete` is False while a reply streams (or if the app died during it)."""

    id: int
    conversation_id: int
    role: str
    content: str
    created: float
    complete: bool
    stats_json: str


def _v1(conn: sqlite3.Connection) -> None:
    conn.execute("CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,"
                 " updated REAL NOT NULL)")
    conn.execute("CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL"
                 " REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,"
                 " created REAL NOT NULL)")


def _v2(conn: sqlite3.Connection) -> None:
    conn.execute("ALTER TABLE conversations ADD COLUMN system_prompt TEXT NOT NULL DEFAULT ''")
    conn.execute("ALTER TABLE conversations ADD COLUMN settings_json TEXT NOT NULL DEFAULT '{}'")
    conn.execute("ALTER TABLE messages ADD COLUMN complete INTEGER NOT NULL DEFAULT 1")
    conn.execute("ALTER TABLE messages ADD COLUMN stats_json TEXT NOT NULL DEFAULT '{}'")
    conn.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")


# MIGRATIONS[n] takes a file from user_version n to n + 1. Append new steps; never edit old ones.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_v1, _v2)


def _code(err: sqlite3.Error) -> int | None:
    """Primary SQLite result code (Python < 3.11 has no sqlite_errorcode, so read the text)."""
    code = getattr(err, "sqlite_errorcode", None)
    return int(code) & 0xFF if code is not None else next((v for t, v in _CODE_TEXT.items() if t in str(err)), None)


def _dump(value: dict[str, object] | None) -> str:
    return json.dumps(value or {}, sort_keys=True, ensure_ascii=False)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def _message(row: tuple) -> Message:
    return Message(row[0], row[1], row[2], row[3], row[4], bool(row[5]), row[6])


class ChatStore:
    """Conversations and messages in one file; the GUI thread and a worker thread may both write."""

    SCHEMA_VERSION = 2

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            from specmemo_core.storage.sources import data_dir  # imported late: sources pulls in torch
            path = data_dir() / FILE_NAME
        self.path = Path(path)
        self.recovered_from: Path | None = None
        # Failed message writes as (method name, arguments incl. the original timestamp), oldest first.
        self.pending: list[tuple[str, tuple[object, ...]]] = []
        self._lock = threading.RLock()  # guards the connection and keeps `pending` in order across threads
        try:
            if not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(self.path.parent, 0o700)  # mkdir's mode is filtered by the umask; chmod is not
            problem = self._probe()
            if problem:
                self.recovered_from = self._set_aside(problem)
            self._connect()
        except (OSError, sqlite3.Error) as err:
            raise ChatStoreError(f"Cannot open the chat history {self.path}: {err}. Check that its folder is writable "
                                 "and the disk is not full, or set SPECMEMO_DATA_DIR to another folder.") from err

    def _probe(self) -> str | None:
        """Why the existing file is unusable (None if fine), read-only so a newer app's file stays byte-identical."""
        if not self.path.exists():
            return None
        with open(self.path, "rb") as f:
            head = f.read(16)
        if head != b"SQLite format 3\x00":
            return None if head == b"" else "is not an SQLite database"
        try:
            conn = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True)
            try:
                self._refuse_newer(conn)
                check = [row[0] for row in conn.execute("PRAGMA quick_check")]
            finally:
                conn.close()
        except sqlite3.Error as err:
            if _code(err) in (_CORRUPT, _NOTADB):
                return f"is damaged ({err})"
            raise  # locked or unreadable is not damaged: leave the file alone
        return None if check == ["ok"] else "failed its integrity check: " + "; ".join(check[:3])

    def _refuse_newer(self, conn: sqlite3.Connection) -> int:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > self.SCHEMA_VERSION:
            raise StoreVersionError(f"The chat history {self.path} was saved by a newer version of SpecMemo Chat "
                                    f"(format {version}; this app reads up to {self.SCHEMA_VERSION}). Update the "
                                    "app to open it; the file was not changed.")
        return version

    def _set_aside(self, problem: str) -> Path:
        """Keep the damaged file (the user may want it back) and let a fresh one take its place."""
        target = self.path.with_name(f"{self.path.name}.corrupt-{datetime.now():%Y%m%d-%H%M%S-%f}")
        os.replace(self.path, target)
        for suffix in ("-wal", "-shm"):  # a stale WAL must not be replayed into the fresh file
            if Path(f"{self.path}{suffix}").exists():
                os.replace(f"{self.path}{suffix}", f"{target}{suffix}")
        log.warning("chat history %s %s; moved it to %s and started a new one", self.path, problem, target)
        return target

    def _connect(self) -> None:
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))  # born private, before SQLite opens it
        self._conn = conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        try:
            version = self._refuse_newer(conn)  # again: another process may have written it since the probe
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            conn.create_function("specmemo_fold", 1, lambda text: str(text).casefold(), deterministic=True)
            for number in range(version + 1, self.SCHEMA_VERSION + 1):
                with self._writing("upgrade the chat history") as step:  # commits together with its version number
                    MIGRATIONS[number - 1](step)
                    step.execute(f"PRAGMA user_version = {number}")
        except BaseException:
            conn.close()
            raise
        for name in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            with suppress(FileNotFoundError):
                os.chmod(name, 0o600)

    @contextmanager
    def _writing(self, action: str) -> Iterator[sqlite3.Connection]:
        """One committed transaction under the lock; when the block ends without error the change is on disk."""
        try:
            with self._lock:
                conn = self._conn
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        with suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                    raise
        except sqlite3.IntegrityError as err:
            raise ChatStoreError(f"Could not {action}: {err}. The chat was probably deleted; reload the list.") from err
        except sqlite3.Error as err:
            reason, when, fix = _FAILURES.get(_code(err) or 0, (str(err), "the problem is fixed", "Check the disk."))
            then = f"The message is kept on screen and will be saved when {when}." if action == _SAVE else "Try again."
            raise StoreWriteError(f"Could not {action} in {self.path}: {reason}. {fix} {then}") from err

    def _read(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._conn.execute(sql, params).fetchall()
            except sqlite3.Error as err:
                raise ChatStoreError(f"Could not read the chat history {self.path}: {err}. Restart the app.") from err

    def create(self, title: str = "New chat", system_prompt: str = "",
               settings: dict[str, object] | None = None) -> Conversation:
        now, title, settings_json = time.time(), encodable(title.strip()) or "New chat", _dump(settings)
        system_prompt = encodable(system_prompt)
        with self._writing("create the conversation") as conn:
            cur = conn.execute("INSERT INTO conversations (title, created, updated, system_prompt, settings_json)"
                               " VALUES (?, ?, ?, ?, ?)", (title, now, now, system_prompt, settings_json))
        return Conversation(int(cur.lastrowid or 0), title, now, now, system_prompt, settings_json)

    def rename(self, conversation_id: int, title: str) -> None:
        with self._writing("rename the conversation") as conn:
            if conn.execute("UPDATE conversations SET title = ? WHERE id = ?",
                            (encodable(title.strip()) or "New chat", conversation_id)).rowcount == 0:
                raise ChatStoreError(f"Conversation {conversation_id} no longer exists; reload the list.")

    def delete(self, conversation_id: int) -> None:
        """Delete a conversation and its messages (explicitly, not trusting the cascade alone)."""
        with self._writing("delete the conversation") as conn:
            conn.execute("DELETE FROM messages WHERE conversation_id = ?", (conversation_id,))
            conn.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def list(self) -> list[Conversation]:
        rows = self._read(f"SELECT {_CONV_COLS} FROM conversations ORDER BY updated DESC, id DESC")
        return [Conversation(*row) for row in rows]

    def search(self, text: str) -> list[Conversation]:
        """Chats whose title or a message contains `text`, ignoring case (Unicode: SQLite's LIKE folds ASCII only)."""
        pattern = "%" + text.casefold().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = self._read(f"SELECT {_CONV_COLS} FROM conversations c WHERE specmemo_fold(title) LIKE ?1 ESCAPE '\\'"
                          " OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id"
                          " AND specmemo_fold(m.content) LIKE ?1 ESCAPE '\\') ORDER BY updated DESC, id DESC",
                          (pattern,))
        return [Conversation(*row) for row in rows]

    def get(self, conversation_id: int) -> Conversation:
        rows = self._read(f"SELECT {_CONV_COLS} FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            raise ChatStoreError(f"Conversation {conversation_id} no longer exists; reload the list.")
        return Conversation(*rows[0])

    def add_message(self, conversation_id: int, role: str, content: str, complete: bool = True,
                    stats: dict[str, object] | None = None) -> Message:
        """Save a turn now; a streaming reply is added once as incomplete and completed by update_message()."""
        return self._save("add_message", (conversation_id, role, encodable(content), bool(complete), _dump(stats),
                                          time.time()))

    def update_message(self, message_id: int, content: str, complete: bool,
                       stats: dict[str, object] | None = None) -> Message:
        return self._save("update_message", (message_id, encodable(content), bool(complete), _dump(stats)))

    def flush_pending(self) -> list[Message]:
        """Retry failed message writes in order (the GUI calls this later); stops at the first failure, keeping
        it on StoreWriteError, dropping it on any other ChatStoreError (it can never succeed: chat deleted)."""
        saved: list[Message] = []
        with self._lock:
            while self.pending:
                try:
                    saved.append(self._apply(*self.pending[0]))
                except ChatStoreError as err:
                    if not isinstance(err, StoreWriteError):
                        self.pending.pop(0)
                    raise
                self.pending.pop(0)
        return saved

    def _save(self, method: str, args: tuple[object, ...]) -> Message:
        with self._lock:  # queue behind older failures, so the file keeps the on-screen order
            self.pending.append((method, args))
            return self.flush_pending()[-1]

    def _apply(self, method: str, args: tuple[object, ...]) -> Message:
        if method == "add_message":
            conversation_id, role, content, complete, stats_json, created = args
            with self._writing(_SAVE) as conn:
                cur = conn.execute("INSERT INTO messages (conversation_id, role, content, created, complete, "
                                   "stats_json) VALUES (?, ?, ?, ?, ?, ?)",
                                   (conversation_id, role, content, created, complete, stats_json))
                conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), conversation_id))
            return _message((cur.lastrowid, conversation_id, role, content, created, complete, stats_json))
        message_id, content, complete, stats_json = args
        with self._writing(_SAVE) as conn:
            conn.execute("UPDATE messages SET content = ?, complete = ?, stats_json = ? WHERE id = ?",
                         (content, complete, stats_json, message_id))
            row = conn.execute(f"SELECT {_MSG_COLS} FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None:
                raise ChatStoreError(f"Message {message_id} no longer exists; reload the conversation.")
            conn.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), row[1]))
        return _message(row)

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._read(f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [_message(row) for row in rows]

    def delete_messages_after(self, conversation_id: int, message_id: int) -> int:
        """Drop every message after `message_id` so Regenerate can answer it again; returns how many went."""
        with self._writing("delete the later messages") as conn:
            return conn.execute("DELETE FROM messages WHERE conversation_id = ? AND id > ?",
                                (conversation_id, message_id)).rowcount

    def export_markdown(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        lines = [f"# {conv.title}", "", f"_Created {_iso(conv.created)}_", ""]
        if conv.system_prompt:
            lines += ["**System prompt:**", "", conv.system_prompt, ""]
        for msg in self.messages(conversation_id):
            lines += [f"### {msg.role.capitalize()} ({_iso(msg.created)})", "", msg.content, ""]
            if not msg.complete:
                lines += ["_(incomplete: the reply was interrupted)_", ""]
        return "\n".join(lines)

    def export_json(self, conversation_id: int) -> str:
        conv = self.get(conversation_id)
        return json.dumps({
            "format": "specmemo-chat", "schema_version": self.SCHEMA_VERSION, "exported": _iso(time.time()),
            "conversation": {"id": conv.id, "title": conv.title, "created": _iso(conv.created),
                             "updated": _iso(conv.updated), "system_prompt": conv.system_prompt,
                             "settings": json.loads(conv.settings_json)},
            "messages": [{"id": m.id, "role": m.role, "content": m.content, "created": _iso(m.created),
                          "complete": m.complete, "stats": json.loads(m.stats_json)}
                         for m in self.messages(conversation_id)],
        }, indent=2, ensure_ascii=False)

    def close(self) -> None:
        """Checkpoint (the WAL folds into the main file) and close; later calls raise ChatStoreError."""
        with self._lock:
            self._conn.close()
