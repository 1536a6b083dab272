"""The real window driven like a user, with the scripted engine standing in for speed."""

from __future__ import annotations

import json

from PySide6.QtCore import Qt

from app.chat_view import Entry
from specmemo_core.errors import OutOfMemoryError
from specmemo_core.storage.chatstore import ChatStore

from .scripted import ScriptedBackend, default_reply, fake_runtime


class Answers:
    """Stands in for Dialogs: records questions, answers with fixed choices."""

    def __init__(self, choice: str | None = None, *later: str) -> None:
        self.choice, self.later, self.asked, self.told = choice, list(later), [], []

    def ask(self, title, text, choices):
        """The first answer is ``choice``; each later question takes the next of ``later`` (if any)."""
        self.asked.append((title, text, choices))
        answer = self.choice
        if self.later:
            self.choice = self.later.pop(0)
        return answer

    def tell(self, title, text):
        self.told.append((title, text))

    def inform(self, title, text):
        self.told.append((title, text))


def type_and_send(qtbot, window, text: str) -> None:
    window.input.setFocus()
    window.input.setPlainText(text)
    qtbot.keyClick(window.input, Qt.Key.Key_Return)


def wait_reply(qtbot, window) -> None:
    qtbot.waitUntil(lambda: not window.generating, timeout=15000)


def test_send_streams_text_in_order_and_saves_it(qtbot, make_window, folder):
    window = make_window(fake_runtime(ScriptedBackend(delay=0.05)))
    pieces, snapshots = [], []
    window.chat.worker.token_ready.connect(pieces.append)  # direct: in the worker's order

    def snapshot() -> bool:
        snapshots.append(window.view.reply_text)
        return not window.generating

    type_and_send(qtbot, window, "hello there")
    assert window.generating
    qtbot.waitUntil(snapshot, timeout=15000)
    expected = default_reply("hello there")
    final = "".join(expected)
    assert pieces == expected and window.view.reply_text == final
    partial = [s for s in snapshots if s and s != final]
    assert partial, "the reply should have been seen while it streamed"
    assert all(final.startswith(s) for s in snapshots)  # only ever a growing prefix, in order
    assert window.input.toPlainText() == ""
    assert [e.role for e in window.view.entries] == ["user", "assistant"]
    assert "w11" in window.view.toPlainText()
    pieces = expected
    store = ChatStore(folder / "history.sqlite3")
    (conv,) = store.list()
    assert conv.title == "hello there"
    assert [(m.role, m.content, m.complete) for m in store.messages(conv.id)] == [
        ("user", "hello there", True), ("assistant", "".join(pieces), True)]
    store.close()


def test_shift_enter_adds_a_line_and_does_not_send(qtbot, make_window):
    window = make_window(fake_runtime())
    window.input.setFocus()
    qtbot.keyClicks(window.input, "first")
    qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.input, "second")
    assert window.input.toPlainText() == "first\nsecond" and not window.generating


def test_stop_mid_reply_keeps_the_partial_reply(qtbot, make_window, folder):
    backend = ScriptedBackend(delay=0.05, script=lambda text: [f"t{i} " for i in range(300)])
    window = make_window(fake_runtime(backend))
    type_and_send(qtbot, window, "tell me a long story")
    qtbot.waitUntil(lambda: window.view.reply_text.count("t") >= 3, timeout=10000)
    assert window.stop_button.isEnabled()
    qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    wait_reply(qtbot, window)
    reply = window.history[-1][2]
    assert reply.startswith("t0 t1 t2") and not reply.rstrip().endswith("t299")
    assert "Stopped" in window.hint.text()
    store = ChatStore(folder / "history.sqlite3")
    last = store.messages(window.conversation_id)[-1]
    assert (last.role, last.content, last.complete) == ("assistant", reply, False)
    store.close()


def test_regenerate_replaces_the_last_reply(qtbot, make_window, folder):
    replies = iter(["first answer", "second answer"])
    backend = ScriptedBackend(script=lambda text: [next(replies)])
    window = make_window(fake_runtime(backend))
    type_and_send(qtbot, window, "question")
    wait_reply(qtbot, window)
    assert window.history[-1][2] == "first answer"
    qtbot.mouseClick(window.regenerate_button, Qt.MouseButton.LeftButton)
    wait_reply(qtbot, window)
    assert [(r, c) for _, r, c in window.history] == [("user", "question"), ("assistant", "second answer")]
    assert [e.text for e in window.view.entries] == ["question", "second answer"]
    store = ChatStore(folder / "history.sqlite3")
    assert [m.content for m in store.messages(window.conversation_id)] == ["question", "second answer"]
    store.close()
    window.copy_reply()
    from PySide6.QtGui import QGuiApplication
    assert QGuiApplication.clipboard().text() == "second answer"


def test_restart_finds_the_history(qtbot, make_window):
    window = make_window(fake_runtime())
    type_and_send(qtbot, window, "remember me")
    wait_reply(qtbot, window)
    conv_id = window.conversation_id
    window.close()
    again = make_window(fake_runtime())  # a new window on the same history file: a new, empty chat
    assert again.sidebar.titles() == ["remember me"]
    assert again.conversation_id is None and again.view.entries == []
    assert again.pages.currentWidget() is again.welcome
    again.sidebar.list.setCurrentRow(0)  # the last chat is one click away
    assert again.conversation_id == conv_id and again.title.text() == "remember me"
    assert [e.role for e in again.view.entries] == ["user", "assistant"]
    assert again.pages.currentWidget() is again.view
    assert "remember me" in again.view.toPlainText()
    type_and_send(qtbot, again, "and now?")  # the conversation goes on with its old turns
    wait_reply(qtbot, again)
    assert [r for _, r, _ in again.history] == ["user", "assistant", "user", "assistant"]


def test_conversations_new_rename_search_delete_export(qtbot, make_window, tmp_path):
    window = make_window(fake_runtime())
    type_and_send(qtbot, window, "about cats")
    wait_reply(qtbot, window)
    first = window.conversation_id
    window.new_conversation()
    type_and_send(qtbot, window, "about dogs")
    wait_reply(qtbot, window)
    assert len(window.sidebar.ids()) == 2
    window.sidebar.rename(first, "Cats")
    assert "Cats" in window.sidebar.titles()
    window.sidebar.search.setText("DOGS")
    assert window.sidebar.titles() == ["about dogs"]
    window.sidebar.search.setText("")
    window.export(tmp_path / "chat.md", "md")
    window.export(tmp_path / "chat.json", "json")
    assert "about dogs" in (tmp_path / "chat.md").read_text()
    assert [m["role"] for m in json.loads((tmp_path / "chat.json").read_text())["messages"]] == ["user", "assistant"]
    window.sidebar.delete(window.conversation_id)
    assert window.sidebar.titles() == ["Cats"] and window.view.entries == []


def test_empty_message_is_not_sent(qtbot, make_window):
    window = make_window(fake_runtime())
    type_and_send(qtbot, window, "   \n  ")
    assert not window.generating and window.view.entries == []
    assert "Type a message first" in window.hint.text()
    assert window.input.toPlainText() == "   \n  "


def test_huge_paste_is_refused_and_kept(qtbot, make_window):
    window = make_window(fake_runtime())
    text = "lorem ipsum " * 8334  # ~100,000 characters
    type_and_send(qtbot, window, text)
    wait_reply(qtbot, window)
    assert "too long for the model's context" in window.hint.text()
    assert window.input.toPlainText() == text  # nothing lost
    assert [e for e in window.view.entries if e.role == "user"] == []


def test_long_chat_drops_oldest_turns_from_context_only(qtbot, make_window, folder):
    backend = ScriptedBackend(script=lambda text: ["reply " * 20])
    runtime = fake_runtime(backend)
    runtime = runtime.__class__(runtime.backend, runtime.device, runtime.inputs,
                                runtime.plan.__class__(**{**runtime.plan.__dict__, "kv_tokens": 300}),
                                runtime.settings)
    window = make_window(runtime)
    for i in range(6):
        type_and_send(qtbot, window, f"message {i} " + "words " * 20)
        wait_reply(qtbot, window)
    assert any(e.role == "notice" and "no longer seen by the model" in e.text for e in window.view.entries)
    assert "history" in window.hint.text() or any(e.role == "notice" for e in window.view.entries)
    store = ChatStore(folder / "history.sqlite3")
    assert len(store.messages(window.conversation_id)) == 12  # every turn kept in the history
    store.close()
    seen = backend.sessions[-1].messages
    assert not any("message 0" in m["content"] for m in seen)  # but not in the model's context


def test_out_of_memory_replans_smaller_and_retries(qtbot, make_window):
    backend = ScriptedBackend()
    window = make_window(fake_runtime(backend))
    window.dialogs = Answers("Re-plan smaller and retry")
    backend.fail_next = OutOfMemoryError("The device ran out of memory during the reply.")
    turns_before = window.settings.turns
    type_and_send(qtbot, window, "hello")
    qtbot.waitUntil(lambda: bool(window.dialogs.asked) and not window.generating, timeout=15000)
    wait_reply(qtbot, window)
    assert window.dialogs.asked[0][0] == "Out of memory"
    assert window.settings.turns == turns_before // 2 and window.settings.prefer == 0.0
    assert [(r, c) for _, r, c in window.history][0] == ("user", "hello")
    assert window.history[-1][1] == "assistant" and "w11" in window.history[-1][2]


def test_reply_error_keeps_the_message(qtbot, make_window, folder):
    from specmemo_core.errors import SpecMemoError

    backend = ScriptedBackend(fail_next=SpecMemoError("the engine broke"))
    window = make_window(fake_runtime(backend))
    window.dialogs = Answers("Cancel")
    type_and_send(qtbot, window, "hello")
    qtbot.waitUntil(lambda: bool(window.dialogs.asked), timeout=15000)
    (title, text, choices), = window.dialogs.asked
    assert "the engine broke" in text and choices == ["Retry", "Cancel"]
    assert window.view.entries == [Entry("user", "hello")]
    assert window.regenerate_button.isEnabled()
    store = ChatStore(folder / "history.sqlite3")
    assert [(m.role, m.content) for m in store.messages(window.conversation_id)] == [("user", "hello")]
    store.close()


def test_a_streaming_reply_is_saved_as_it_grows(qtbot, make_window, folder, monkeypatch):
    monkeypatch.setattr("app.main_window.SAVE_EVERY_S", 0.0)
    backend = ScriptedBackend(delay=0.05, script=lambda text: [f"t{i} " for i in range(300)])
    window = make_window(fake_runtime(backend))
    type_and_send(qtbot, window, "go on")
    reader = ChatStore(folder / "history.sqlite3")  # as a restarted app after a crash would see it

    def partial_saved() -> bool:
        msgs = reader.messages(window.conversation_id)
        return len(msgs) == 2 and not msgs[1].complete and msgs[1].content.startswith("t0 t1 t2")

    qtbot.waitUntil(partial_saved, timeout=10000)
    window.stop()
    wait_reply(qtbot, window)
    (user, reply) = reader.messages(window.conversation_id)
    assert reply.content == window.history[-1][2] and json.loads(reply.stats_json)["stopped"]
    reader.close()


def test_an_unexpected_exception_mid_reply_offers_retry_which_answers(qtbot, make_window):
    """A bug in the engine (here a ZeroDivisionError) is shown with its type, and Retry answers the kept message."""
    backend = ScriptedBackend(fail_next=ZeroDivisionError("division by zero"))
    window = make_window(fake_runtime(backend))
    window.dialogs = Answers("Retry")
    type_and_send(qtbot, window, "hello")
    qtbot.waitUntil(lambda: bool(window.dialogs.asked), timeout=15000)
    wait_reply(qtbot, window)
    (title, text, choices), = window.dialogs.asked
    assert title == "The reply failed" and "ZeroDivisionError: division by zero" in text
    assert [(r, c[:2]) for _, r, c in window.history] == [("user", "he"), ("assistant", "w0")]


def test_first_window_is_a_welcome_with_example_prompts_that_send(qtbot, make_window):
    window = make_window(fake_runtime())
    assert window.conversation_id is None and window.pages.currentWidget() is window.welcome
    assert window.welcome.state == "ready" and len(window.welcome.examples) >= 3
    example = window.welcome.examples[0]
    qtbot.mouseClick(example, Qt.MouseButton.LeftButton)
    wait_reply(qtbot, window)
    assert window.history[0][1:] == ("user", example.text())
    assert window.pages.currentWidget() is window.view
    assert window.sidebar.titles() == [window.title.text()]


def test_header_chip_and_status_bar_fields(qtbot, make_window):
    import torch

    window = make_window(fake_runtime())
    runtime = window.runtime
    assert window.chip.text() == (f"scripted-model · {runtime.plan.precision} · "
                                  + (f"tree {runtime.tree}" if runtime.speculative else "plain decoding")
                                  + f" · {runtime.capacity:,} tokens")
    assert window.status.threads.text() == f"{torch.get_num_threads()} CPU threads"
    assert "turns fit" in window.status.plan.text()
    assert window.hint.text() == ""


def test_shortcuts_and_about_are_in_the_help_menu(qtbot, make_window):
    window = make_window(fake_runtime())
    window.dialogs = Answers()
    window.actions["Keyboard shortcuts…"].trigger()
    window.actions["About SpecMemo Chat"].trigger()
    (title, text), (about_title, about) = window.dialogs.told
    assert title == "Keyboard shortcuts" and "Shift+Enter" in text and "Esc" in text and "Ctrl+N" in text
    assert about_title == "About SpecMemo Chat" and "speculative decoding" in about


def test_theme_menu_switches_palette_and_is_saved(qtbot, make_window, folder):
    from PySide6.QtWidgets import QApplication

    from app.settings import load_settings
    from app.theme import DARK, LIGHT

    window = make_window(fake_runtime())
    try:
        window.actions["Theme: Dark"].trigger()
        assert QApplication.palette().base().color().name() == DARK.base
        assert load_settings(folder).theme == "dark" and window.actions["Theme: Dark"].isChecked()
        assert window.view.palette().base().color().name() == DARK.base  # the bubbles are re-rendered from it
        window.apply_settings(window.settings.with_(turns=4))  # a re-plan keeps the theme
        assert window.settings.theme == "dark" and load_settings(folder).theme == "dark"
    finally:
        window.actions["Theme: Light"].trigger()
    assert QApplication.palette().base().color().name() == LIGHT.base and load_settings(folder).theme == "light"


def test_ready_is_said_in_the_success_colour_and_problems_in_the_warning_colour(qtbot, make_window):
    from app.theme import LIGHT

    from .test_model_loading import StubLoader

    window = make_window(loader=StubLoader(), settings=fake_runtime().settings)
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    assert "is ready" in window.hint.text() and LIGHT.success in window.hint.styleSheet()
    type_and_send(qtbot, window, "   ")
    assert LIGHT.warning not in window.hint.styleSheet() and LIGHT.success not in window.hint.styleSheet()
    type_and_send(qtbot, window, "x " * 100_000)
    wait_reply(qtbot, window)
    assert "too long" in window.hint.text() and LIGHT.warning in window.hint.styleSheet()
