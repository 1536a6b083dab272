"""Chat history in one SQLite file that survives crashes, full disks and app upgrades.

Each write is its own committed transaction (WAL, checkpointed every few writes and on close), so a kill loses
at most the reply in flight; message writes that fail for reasons that pass (disk full, read-only folder, a lock
held too long) wait in `pending` for flush_pending() and in a journal file (journal.py) that the next start
replays. A damaged file is set aside and what can still be read of it is copied into the new one (salvage.py)."""

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
from specmemo_core.storage.data_folder import data_dir
from specmemo_core.storage.journal import PendingJournal, PendingWrite
from specmemo_core.storage.salvage import Salvage, salvage
from specmemo_core.text import encodable

log = logging.getLogger(__name__)

FILE_NAME = "history.sqlite3"
_CONV_COLS = "id, title, created, updated, system_prompt, settings_json"
_MSG_COLS = "id, conversation_id, role, content, created, complete, stats_json"
_SAVE = "save the message"
CHECKPOINT_WRITES, CHECKPOINT_S = 50, 30.0  # fold the WAL into the main file this often (whichever comes first)
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


class WalLostError(StoreWriteError):
    """The history's write-ahead log was deleted under the running store: writing on would be writing blind.
    What it held was folded into the main file; message writes wait in `pending` and the journal."""


@dataclass(frozen=True)
class Unsaved:
    """What ``ChatStore.close`` could not save: ``count`` message writes, kept in ``journal`` for the next start."""

    count: int
    journal: Path | None
    reason: str = ""

    @property
    def question(self) -> str:
        return (f"{self.count} message(s) could not be saved yet ({self.reason}). Retry, or quit anyway: they are "
                f"kept in {self.journal} and saved the next time the app starts.")


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
            path = data_dir() / FILE_NAME
        self.path = Path(path)
        self.recovered_from: Path | None = None
        self.salvage: Salvage | None = None  # what was read back out of a damaged file (set with recovered_from)
        # Failed message writes (method name, arguments incl. the original timestamp), oldest first; each is
        # also in the journal until it is saved.
        self.pending: list[PendingWrite] = []
        self.journal = PendingJournal(self.path)
        self.last_error = ""
        self._lock = threading.RLock()  # guards the connection and keeps `pending` in order across threads
        self._writes, self._checkpointed, self._wal_id, self._closed = 0, time.monotonic(), None, False
        try:
            if not self.path.parent.is_dir():
                self.path.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(self.path.parent, 0o700)  # mkdir's mode is filtered by the umask; chmod is not
            problem = self._probe()
            if problem:
                self.recovered_from = self._set_aside(problem)
            self._connect()
            if self.recovered_from is not None:
                self.salvage = salvage(self.recovered_from, self._conn)
                log.warning("%s", self.salvage.summary)
        except (OSError, sqlite3.Error) as err:
            raise ChatStoreError(f"Cannot open the chat history {self.path}: {err}. Check that its folder is writable "
                                 "and the disk is not full, or set SPECMEMO_DATA_DIR to another folder.") from err
        self._replay()

    def _replay(self) -> None:
        """Save the writes a previous run left in the journal (they stay there if they still cannot be)."""
        self.pending = self.journal.read()
        if self.pending:
            log.warning("saving %d message write(s) left in %s", len(self.pending), self.journal.location)
            self._flush_all()

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
        self._wal_id = self._wal_identity()

    def _wal_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(f"{self.path}-wal")
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _check_wal(self) -> None:
        """Refuse to write when the WAL our connection holds is no longer the file on disk (deleted, replaced):
        commits would go to a file nobody else sees and vanish at the next crash. What the old WAL holds is
        first folded into the main file through our still-open handle."""
        if self._wal_id is None or self._wal_identity() == self._wal_id:
            return
        with suppress(sqlite3.Error):
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        raise WalLostError(f"The chat history's log file {self.path}-wal was deleted or replaced while SpecMemo Chat "
                           f"was running (a cleanup tool?). Everything saved so far was written into {self.path}; "
                           f"restart the app to go on saving. Unsaved messages are kept in {self.journal.primary} "
                           "and saved at the next start.")

    def _after_commit(self) -> None:
        """A PASSIVE checkpoint every CHECKPOINT_WRITES writes or CHECKPOINT_S seconds, so the WAL never holds
        much that only it has."""
        self._writes += 1
        if self._wal_id is None:
            self._wal_id = self._wal_identity()
        if self._writes >= CHECKPOINT_WRITES or time.monotonic() - self._checkpointed >= CHECKPOINT_S:
            self._writes, self._checkpointed = 0, time.monotonic()
            with suppress(sqlite3.Error):  # busy readers only delay it; the next write tries again
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    @contextmanager
    def _writing(self, action: str) -> Iterator[sqlite3.Connection]:
        """One committed transaction under the lock; when the block ends without error the change is on disk."""
        try:
            with self._lock:
                conn = self._conn
                self._check_wal()
                conn.execute("BEGIN IMMEDIATE")
                try:
                    yield conn
                    conn.execute("COMMIT")
                    self._after_commit()
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
        it on StoreWriteError, dropping it on any other ChatStoreError (it can never succeed: chat deleted).
        The journal follows: emptied when all are saved, rewritten when only some are."""
        saved: list[Message] = []
        with self._lock:
            before = len(self.pending)
            try:
                while self.pending:
                    try:
                        saved.append(self._apply(self.pending[0]))
                    except ChatStoreError as err:
                        self.last_error = str(err)
                        if not isinstance(err, StoreWriteError):
                            self.pending.pop(0)
                        raise
                    self.pending.pop(0)
            finally:
                if len(self.pending) != before and self.journal.location is not None:
                    self.journal.rewrite(self.pending)
        return saved

    def _flush_all(self) -> None:
        """Save what can be saved: past writes that can never succeed, up to the first one that may later."""
        while self.pending:
            try:
                self.flush_pending()
            except StoreWriteError:
                return
            except ChatStoreError:
                continue

    def _save(self, method: str, args: tuple[object, ...]) -> Message:
        with self._lock:  # queue behind older failures, so the file keeps the on-screen order
            write = PendingWrite(method, args)
            self.pending.append(write)
            try:
                return self.flush_pending()[-1]
            except ChatStoreError:
                if any(w is write for w in self.pending):
                    self._journal(write)
                raise

    def _journal(self, write: PendingWrite) -> None:
        try:
            self.journal.append(write)
        except OSError as err:  # NOTE: neither folder takes a line: the write lives in memory only, as before
            log.error("could not keep an unsaved message in %s or %s: %s", self.journal.primary,
                      self.journal.spare, err)

    def _apply(self, write: PendingWrite) -> Message:
        method, args = write.method, write.args
        if method == "add_message":
            conversation_id, role, content, complete, stats_json, created = args
            with self._writing(_SAVE) as conn:
                same = conn.execute(f"SELECT {_MSG_COLS} FROM messages WHERE conversation_id = ? AND role = ? AND "
                                    "created = ? AND content = ?", (conversation_id, role, created, content)).fetchone()
                if same is not None:  # replayed from the journal after it was saved: saved once only
                    return _message(same)
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

    def close(self, force: bool = False) -> Unsaved:
        """Save pending message writes, checkpoint (the WAL folds into the main file) and close; later calls raise
        ChatStoreError. If some writes still cannot be saved, the store stays open and the answer says how many
        (``Unsaved.question`` for the window's Retry / Quit anyway): close() again retries, close(force=True)
        closes anyway, leaving them in the journal for the next start."""
        with self._lock:
            if self._closed:
                return Unsaved(len(self.pending), self.journal.location, self.last_error)
            self._flush_all()
            unsaved = Unsaved(len(self.pending), self.journal.location, self.last_error)
            if unsaved.count and not force:
                return unsaved
            with suppress(sqlite3.Error):  # through our handle: also saves what a deleted WAL held
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._conn.close()
            self._closed = True
            return unsaved
