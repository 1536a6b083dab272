"""End to end with the real default model: the real loader, the real worker thread, --self-test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.main_window import MainWindow
from app.runtime import load_runtime
from app.settings import ChatSettings
from specmemo_core.storage.chatstore import ChatStore
from specmemo_core.planning.device import cpu_device
from specmemo_core.runtime.heads import random_heads, save_heads

from .test_main_window import Answers, type_and_send, wait_reply

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def real_window(qtbot, shared_data_dir, tmp_path):
    """A window whose loader reads the shared model cache (timing cached there too)."""
    def loader(settings, _folder, progress, cancel):
        return load_runtime(settings, shared_data_dir, progress, cancel, cpu_device())

    store = ChatStore(tmp_path / "history.sqlite3")
    window = MainWindow(store, ChatSettings(max_reply_tokens=16), tmp_path, loader)
    # questions recorded and closed, not shown: a failed reply's modal dialog would stop the suite
    window.dialogs = Answers()
    qtbot.addWidget(window)
    window.show()
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=120000)
    yield window
    window.close()
    store.close()


def test_real_model_replies_through_the_worker(qtbot, real_window, tmp_path):
    window = real_window
    assert window.runtime.backend.name == "SmolLM2-135M-Instruct"
    pieces = []
    window.chat.worker.token_ready.connect(pieces.append)  # direct: in the worker's order
    type_and_send(qtbot, window, "Write a Python function that adds two numbers.")
    wait_reply(qtbot, window)
    assert not window.dialogs.asked, window.dialogs.asked  # e.g. ("The reply failed", what went wrong, …)
    reply = window.history[-1][2]
    assert window.history[-1][1] == "assistant" and reply.strip()
    assert len(pieces) > 1 and "".join(pieces) == reply  # streamed piece by piece, nothing lost
    assert window.view.reply_text == reply
    type_and_send(qtbot, window, "Now make it subtract.")  # a second turn re-uses the session's cache
    wait_reply(qtbot, window)
    assert [r for _, r, _ in window.history] == ["user", "assistant", "user", "assistant"]
    assert "tokens/s" in window.status.speed.text()
    store = ChatStore(tmp_path / "history.sqlite3")
    assert [m.content for m in store.messages(window.conversation_id)][1] == reply
    store.close()


def test_real_bad_model_file_and_foreign_heads(qtbot, real_window, tmp_path):
    window = real_window
    before = window.runtime
    fake = tmp_path / "notes.gguf"
    fake.write_text("these are notes, not weights")
    window.dialogs = Answers("Cancel")
    window.apply_settings(window.settings.with_(model=str(fake)))
    qtbot.waitUntil(lambda: bool(window.dialogs.asked), timeout=60000)
    assert "not a GGUF file" in window.dialogs.asked[0][1] and window.runtime is before

    spec = before.backend.engine.model.spec
    heads = random_heads(2, spec.hidden_size, spec.vocab_size, base_name="another-model",
                         base_fingerprint="0123456789abcdef")
    save_heads(heads, tmp_path / "foreign-heads")
    window.dialogs = Answers("Run without heads")
    window.apply_settings(window.settings.with_(heads=str(tmp_path / "foreign-heads")))
    # the runtime without heads, not a re-plan of the previous one when its device timing ends meanwhile
    qtbot.waitUntil(lambda: bool(window.dialogs.asked) and window.runtime.settings.heads == "none", timeout=120000)
    assert "another model" in window.dialogs.asked[0][1]
    assert window.runtime.backend.engine.heads is None and not window.runtime.speculative
    type_and_send(qtbot, window, "Hello!")
    wait_reply(qtbot, window)
    assert window.history[-1][1] == "assistant"


def test_self_test_command(shared_data_root):
    env = {**os.environ, "SPECMEMO_DATA_DIR": str(shared_data_root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "app", "--self-test"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.strip().splitlines()
    assert line.startswith("self-test ok: model SmolLM2-135M-Instruct") and "16 tokens" in line
    assert "ran tree " in line and "ran tree None" not in line  # speculation was on


def test_self_test_fails_on_a_bad_model(shared_data_root, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    env = {**os.environ, "SPECMEMO_DATA_DIR": str(shared_data_root), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "app", "--self-test", "--model", str(bad)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "not a GGUF file" in done.stderr
