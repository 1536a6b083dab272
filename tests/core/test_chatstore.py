"""Chat history: round trips, search, exports, migrations, damaged files, full disks and hard kills."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specmemo_core.storage.chatstore import MIGRATIONS, ChatStore, ChatStoreError, StoreVersionError, StoreWriteError
from specmemo_core.errors import SpecMemoError

REPO = Path(__file__).resolve().parents[2]

V1_DDL = (
    "CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, created REAL NOT NULL,"
    " updated REAL NOT NULL)",
    "CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL"
    " REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,"
    " created REAL NOT NULL)",
)


@pytest.fixture
def store(tmp_path: Path):
    s = ChatStore(tmp_path / "history.sqlite3")
    yield s
    s.close()


def test_schema_version_matches_migrations() -> None:
    assert ChatStore.SCHEMA_VERSION == len(MIGRATIONS) == 2
    assert issubclass(StoreWriteError, SpecMemoError) and issubclass(StoreVersionError, SpecMemoError)


def test_round_trip_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    with_store = ChatStore(path)
    conv = with_store.create("Trip", system_prompt="Be brief.", settings={"temperature": 0.7})
    first = with_store.add_message(conv.id, "user", "Hello")
    second = with_store.add_message(conv.id, "assistant", "Hi!", stats={"tokens_per_s": 42.0})
    with_store.close()

    again = ChatStore(path)
    assert again.recovered_from is None
    got = again.get(conv.id)
    assert (got.title, got.system_prompt, json.loads(got.settings_json)) == ("Trip", "Be brief.", {"temperature": 0.7})
    assert again.messages(conv.id) == [first, second]
    assert json.loads(again.messages(conv.id)[1].stats_json) == {"tokens_per_s": 42.0}
    again.close()


def test_ordering(store: ChatStore) -> None:
    a = store.create("A")
    b = store.create("B")
    c = store.create("C")
    assert [x.title for x in store.list()] == ["C", "B", "A"]
    time.sleep(0.002)
    store.add_message(a.id, "user", "bump")  # activity moves a chat to the top
    assert [x.title for x in store.list()] == ["A", "C", "B"]
    ids = [store.add_message(b.id, "user", str(i)).id for i in range(5)]
    assert [m.content for m in store.messages(b.id)] == ["0", "1", "2", "3", "4"]
    assert ids == sorted(ids)
    assert store.messages(c.id) == []


def test_rename_delete_and_search(store: ChatStore) -> None:
    pct = store.create("Save 100% now")
    other = store.create("100 percent")
    under = store.create("snake_case names")
    store.add_message(other.id, "user", "Was ist ÄRGER?")
    store.rename(other.id, "  Renamed  ")
    assert store.get(other.id).title == "Renamed"
    assert [c.id for c in store.search("100%")] == [pct.id]  # % is literal, not a wildcard
    assert [c.id for c in store.search("e_c")] == [under.id]  # so is _
    assert [c.id for c in store.search("ärger")] == [other.id]  # message contents, Unicode case folded
    assert [c.id for c in store.search("SAVE")] == [pct.id]
    assert store.search("nowhere") == []

    store.delete(other.id)
    assert [c.id for c in store.list()] == [under.id, pct.id]
    assert store._conn.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0
    with pytest.raises(ChatStoreError, match="reload the list"):
        store.get(other.id)
    with pytest.raises(ChatStoreError, match="reload the list"):
        store.rename(other.id, "x")
    with pytest.raises(ChatStoreError) as err:
        store.add_message(other.id, "user", "to a deleted chat")
    assert not isinstance(err.value, StoreWriteError) and store.pending == []


def test_streaming_reply_incomplete_then_complete(store: ChatStore) -> None:
    conv = store.create()
    store.add_message(conv.id, "user", "Tell me a story")
    reply = store.add_message(conv.id, "assistant", "", complete=False)
    assert store.messages(conv.id)[-1].complete is False
    done = store.update_message(reply.id, "Once upon a time.", complete=True, stats={"tokens": 5})
    assert done.id == reply.id and done.complete is True and done.created == reply.created
    assert store.messages(conv.id)[-1] == done
    assert json.loads(done.stats_json) == {"tokens": 5}
    with pytest.raises(ChatStoreError, match="no longer exists"):
        store.update_message(99999, "x", complete=True)
    assert store.pending == []


def test_delete_messages_after(store: ChatStore) -> None:
    conv = store.create()
    other = store.create()
    u1 = store.add_message(conv.id, "user", "q1")
    store.add_message(conv.id, "assistant", "a1")
    keep_other = store.add_message(other.id, "user", "elsewhere")
    store.add_message(conv.id, "assistant", "a1 again")
    assert store.delete_messages_after(conv.id, u1.id) == 2
    assert [m.content for m in store.messages(conv.id)] == ["q1"]
    assert store.messages(other.id) == [keep_other]


def test_exports(store: ChatStore) -> None:
    conv = store.create("Export me", system_prompt="You are terse.", settings={"max_tokens": 64})
    store.add_message(conv.id, "user", "What is 2+2?")
    store.add_message(conv.id, "assistant", "4", stats={"accepted": 3})
    store.add_message(conv.id, "assistant", "Half a repl", complete=False)

    md = store.export_markdown(conv.id)
    assert md.startswith("# Export me\n")
    assert "You are terse." in md
    assert md.index("### User") < md.index("What is 2+2?") < md.index("### Assistant") < md.index("\n4\n")
    assert "incomplete" in md

    doc = json.loads(store.export_json(conv.id))
    assert doc["schema_version"] == 2
    assert doc["conversation"]["title"] == "Export me"
    assert doc["conversation"]["settings"] == {"max_tokens": 64}
    assert [m["content"] for m in doc["messages"]] == ["What is 2+2?", "4", "Half a repl"]
    assert [m["complete"] for m in doc["messages"]] == [True, True, False]
    assert doc["messages"][1]["stats"] == {"accepted": 3}
    for stamp in (doc["conversation"]["created"], doc["messages"][0]["created"]):
        assert stamp.endswith("+00:00") and stamp[4] == "-" and "T" in stamp


def test_migrates_v1_database_without_losing_rows(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    conn = sqlite3.connect(path)
    for ddl in V1_DDL:
        conn.execute(ddl)
    conn.execute("INSERT INTO conversations VALUES (7, 'Old chat', 1000.0, 2000.0)")
    conn.execute("INSERT INTO messages VALUES (1, 7, 'user', 'old question', 1500.0)")
    conn.execute("INSERT INTO messages VALUES (2, 7, 'assistant', 'old answer', 1600.0)")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()

    store = ChatStore(path)
    assert store.recovered_from is None
    assert store.get(7) == store.list()[0]
    assert (store.get(7).title, store.get(7).system_prompt, store.get(7).settings_json) == ("Old chat", "", "{}")
    msgs = store.messages(7)
    assert [(m.id, m.role, m.content, m.created, m.complete, m.stats_json) for m in msgs] == [
        (1, "user", "old question", 1500.0, True, "{}"), (2, "assistant", "old answer", 1600.0, True, "{}")]
    assert store._conn.execute("PRAGMA user_version").fetchone()[0] == 2
    indexes = [r[1] for r in store._conn.execute("PRAGMA index_list(messages)")]
    assert "messages_by_conversation" in indexes
    assert store.add_message(7, "user", "new question").id == 3
    store.close()


def test_newer_database_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE future (x)")
    conn.execute("PRAGMA user_version = 9")
    conn.commit()
    conn.close()
    before = path.read_bytes()
    with pytest.raises(StoreVersionError, match="Update the app"):
        ChatStore(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.sqlite3"]


def test_random_bytes_are_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    junk = os.urandom(8192)
    path.write_bytes(junk)
    store = ChatStore(path)
    assert store.recovered_from is not None
    assert store.recovered_from.name.startswith("history.sqlite3.corrupt-")
    assert store.recovered_from.read_bytes() == junk
    conv = store.create("fresh")
    assert store.list() == [conv]
    store.close()
    assert ChatStore(path).recovered_from is None


@pytest.mark.parametrize("damage", ["scribbled pages", "wrong freelist count"])
def test_failed_integrity_check_is_set_aside(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "history.sqlite3"
    store = ChatStore(path)
    conv, doomed = store.create(), store.create()
    for i in range(300):
        store.add_message(conv.id, "user", f"message {i} " + "x" * 200)
        store.add_message(doomed.id, "user", "y" * 200)
    store.delete(doomed.id)  # leaves free pages behind
    store.close()  # checkpoints the WAL into the main file
    data = bytearray(path.read_bytes())
    if damage == "scribbled pages":  # SQLite itself reports the file as malformed
        for start in range(2 * 4096, len(data) - 4096, 3 * 4096):
            data[start:start + 64] = b"\xff" * 64
    else:  # readable, but PRAGMA quick_check lists a problem
        free = int.from_bytes(data[36:40], "big")
        assert free > 0
        data[36:40] = (free + 3).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    again = ChatStore(path)
    assert again.recovered_from is not None and again.recovered_from.read_bytes() == bytes(data)
    assert again.salvage is not None and again.salvage.original == again.recovered_from
    # whatever could be read back is exactly what was saved (the deleted chat stays deleted)
    recovered = [m.content for c in again.list() for m in again.messages(c.id)]
    assert len(recovered) == again.salvage.messages
    assert set(recovered) <= {f"message {i} " + "x" * 200 for i in range(300)}
    again.close()


def test_files_are_private(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "specmemo"
    store = ChatStore(folder / "history.sqlite3")
    store.add_message(store.create().id, "user", "secret")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in ("history.sqlite3", "history.sqlite3-wal", "history.sqlite3-shm"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._conn.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    store.close()


def test_default_path_is_in_data_dir(data_dir: Path) -> None:
    store = ChatStore()
    assert store.path == data_dir / "history.sqlite3" and store.path.exists()
    store.close()


def test_disk_full_keeps_messages_pending_until_flushed(store: ChatStore) -> None:
    conv = store.create()
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")  # the next page allocation fails: SQLITE_FULL
    big = "x" * 100_000
    with pytest.raises(StoreWriteError, match="disk is full.*kept on screen"):
        store.add_message(conv.id, "user", big)
    assert [write.method for write in store.pending] == ["add_message"]
    with pytest.raises(StoreWriteError):  # a later message queues behind it, keeping the order
        store.add_message(conv.id, "assistant", "small")
    assert len(store.pending) == 2
    assert store.messages(conv.id) == []

    store._conn.execute("PRAGMA max_page_count = 1073741823")
    saved = store.flush_pending()
    assert [m.content for m in saved] == [big, "small"]
    assert store.pending == []
    assert store.messages(conv.id) == saved


def test_read_only_keeps_messages_pending(store: ChatStore) -> None:
    conv = store.create()
    store._conn.execute("PRAGMA query_only = ON")  # writes fail with SQLITE_READONLY, like a read-only folder
    with pytest.raises(StoreWriteError, match="read-only.*kept on screen"):
        store.add_message(conv.id, "user", "hello")
    with pytest.raises(StoreWriteError, match="Try again"):
        store.rename(conv.id, "not queued")
    assert len(store.pending) == 1
    store._conn.execute("PRAGMA query_only = OFF")
    assert [m.content for m in store.flush_pending()] == ["hello"]


def test_worker_thread_may_write_too(store: ChatStore) -> None:
    conv = store.create()

    def write(tag: str) -> None:
        for i in range(40):
            store.add_message(conv.id, "assistant", f"{tag}{i}")

    worker = threading.Thread(target=write, args=("w",))
    worker.start()
    write("m")
    worker.join()
    contents = [m.content for m in store.messages(conv.id)]
    assert len(contents) == 80
    assert [c for c in contents if c[0] == "w"] == [f"w{i}" for i in range(40)]


CHILD = """
import os, random, signal, sys, threading, time
from pathlib import Path
from specmemo_core.storage.chatstore import ChatStore
store = ChatStore(Path(sys.argv[1]))
conv = store.create("crash")
if sys.argv[2] == "during":  # SIGKILL from another thread, most likely while a commit is under way
    threading.Timer(random.uniform(0.0, 0.01), os.kill, (os.getpid(), signal.SIGKILL)).start()
for i in range(50):
    if i == 30 and sys.argv[2] == "between":
        reply = store.add_message(conv.id, "assistant", "streaming...", complete=False)
        print(reply.id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    msg = store.add_message(conv.id, "user", "message %d " % i + "x" * 100_000)
    print(msg.id, flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
@pytest.mark.parametrize("when", ["between", "during"])
def test_hard_kill_loses_nothing_committed(tmp_path: Path, when: str) -> None:
    path = tmp_path / "history.sqlite3"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), when], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=60)
    assert proc.returncode == -9, proc.stderr
    reported = [int(line) for line in proc.stdout.splitlines(keepends=True) if line.endswith("\n")]
    if when == "between":
        assert len(reported) == 31

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    present = {row[0] for row in conn.execute("SELECT id FROM messages")}
    conn.close()
    assert set(reported) <= present
    store = ChatStore(path)
    assert store.recovered_from is None
    if when == "between":  # the reply in flight shows as interrupted
        assert store.messages(store.list()[0].id)[-1].complete is False
    store.close()
