"""The worker thread alone, with the scripted engine: order, stop, context window, failures."""

from __future__ import annotations

import pytest

from app.context_window import TooLongError, fit_window
from app.worker import ChatThread, Job, NoModelError
from specmemo_core.errors import OutOfMemoryError
from specmemo_core.runtime.decoding import GenerationConfig

from .scripted import ScriptedBackend, default_reply


@pytest.fixture
def chat(qtbot):
    thread = ChatThread()
    yield thread
    thread.shutdown()


def count(messages):
    return ScriptedBackend().count_tokens(messages)


def test_fit_window_drops_whole_oldest_turns():
    history = []
    for i in range(5):
        history += [{"role": "user", "content": "u" * 40}, {"role": "assistant", "content": "a" * 40}]
    whole = count(history + [{"role": "user", "content": "hi"}])
    assert fit_window(history, "hi", "", start=0, count_tokens=count, capacity=whole + 10, reserve=10).start == 0
    window = fit_window(history, "hi", "", start=0, count_tokens=count, capacity=whole, reserve=10)
    assert window.start == 2 and window.dropped_turns == 1  # one turn (user + reply) left
    assert history[window.start]["role"] == "user"
    with pytest.raises(TooLongError, match="too long"):
        fit_window(history, "x" * 4000, "", start=0, count_tokens=count, capacity=200, reserve=10)


def test_streams_pieces_in_order_and_reports_stats(qtbot, chat):
    backend = ScriptedBackend()
    chat.configure(backend, 4096, True)
    pieces, done = [], []
    chat.worker.token_ready.connect(pieces.append)
    chat.worker.finished.connect(done.append)
    chat.generate(Job(1, [], "hello", GenerationConfig(max_new_tokens=64)))
    qtbot.waitUntil(lambda: bool(done), timeout=10000)
    assert pieces == default_reply("hello")
    stats = done[0]
    assert stats.text == "".join(pieces) and not stats.stopped
    assert stats.tokens == len(pieces) and stats.steps == len(pieces) - 1
    assert stats.mean_accepted == 1.0  # each scripted step gives the reply one token (though it says it accepted 2)


def test_reuses_the_session_while_the_history_matches(qtbot, chat):
    backend = ScriptedBackend()
    chat.configure(backend, 4096, True)
    done = []
    chat.worker.finished.connect(done.append)
    chat.generate(Job(1, [], "one"))
    qtbot.waitUntil(lambda: len(done) == 1, timeout=10000)
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": done[0].text}]
    chat.generate(Job(1, history, "two"))
    qtbot.waitUntil(lambda: len(done) == 2, timeout=10000)
    assert len(backend.sessions) == 1
    chat.generate(Job(1, [], "three"))  # regenerate-like: the history no longer matches
    qtbot.waitUntil(lambda: len(done) == 3, timeout=10000)
    assert len(backend.sessions) == 2


def test_stop_ends_the_reply_early(qtbot, chat):
    backend = ScriptedBackend(delay=0.05, script=lambda text: [f"t{i} " for i in range(400)])
    chat.configure(backend, 100000, True)
    pieces, done = [], []
    chat.worker.token_ready.connect(pieces.append)
    chat.worker.finished.connect(done.append)
    chat.generate(Job(1, [], "long please", GenerationConfig(max_new_tokens=400)))
    qtbot.waitUntil(lambda: len(pieces) >= 3, timeout=10000)
    chat.stop()
    qtbot.waitUntil(lambda: bool(done), timeout=10000)
    assert done[0].stopped and 3 <= len(pieces) < 400
    assert done[0].text == "".join(pieces)


def test_failures_arrive_typed_with_the_users_text(qtbot, chat):
    """Out of memory, a message too long, and an exception the worker has no name for (a bug in an
    engine): each reaches the GUI thread as the exception object itself, and the worker keeps working."""
    backend = ScriptedBackend(fail_next=OutOfMemoryError("The device ran out of memory during the reply."))
    chat.configure(backend, 256, True)
    failures, done = [], []
    chat.worker.failed.connect(lambda *args: failures.append(args))
    chat.worker.finished.connect(done.append)
    chat.generate(Job(1, [], "hello", GenerationConfig(max_new_tokens=16)))
    qtbot.waitUntil(lambda: bool(failures), timeout=10000)
    assert isinstance(failures[0][0], OutOfMemoryError) and failures[0][1] == "hello"
    chat.generate(Job(1, [], "x" * 100_000, GenerationConfig(max_new_tokens=16)))
    qtbot.waitUntil(lambda: len(failures) == 2, timeout=10000)
    assert isinstance(failures[1][0], TooLongError) and "too long" in str(failures[1][0])
    backend.fail_next = ZeroDivisionError("division by zero")
    chat.generate(Job(1, [], "again", GenerationConfig(max_new_tokens=16)))
    qtbot.waitUntil(lambda: len(failures) == 3, timeout=10000)
    assert type(failures[2][0]) is ZeroDivisionError and failures[2][1] == "again"
    chat.generate(Job(1, [], "and again", GenerationConfig(max_new_tokens=16)))
    qtbot.waitUntil(lambda: bool(done), timeout=10000)
    assert done[0].text == "".join(default_reply("and again"))


def test_no_model_yet(qtbot, chat):
    failures = []
    chat.worker.failed.connect(lambda *args: failures.append(args))
    chat.generate(Job(1, [], "hello"))
    qtbot.waitUntil(lambda: bool(failures), timeout=10000)
    assert isinstance(failures[0][0], NoModelError) and "No model is loaded" in str(failures[0][0])

