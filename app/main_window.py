"""The main window: conversations, the streaming chat, the input box, settings and failure dialogs.

It owns no model logic: replies come from the worker thread (worker.py), models from the
model manager (model_manager.py), history from ChatStore, plans from planning.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtGui import QAction, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog, QHBoxLayout, QLabel, QMainWindow, QProgressDialog, QPushButton, QSplitter, QVBoxLayout, QWidget,
)

from specmemo_core.storage.atomic import write_text_atomic
from specmemo_core.storage.chatstore import ChatStore, ChatStoreError
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.errors import SpecMemoError

from .chat_input import ChatInput
from .chat_view import ChatView
from .conversation_list import ConversationList
from .dialogs import Dialogs
from .model_manager import Loader, ModelManager
from .planning import smaller_settings
from .runtime import Runtime, load_runtime, memory_in_use
from .settings import ChatSettings, save_settings
from .settings_panel import SettingsDialog
from .status_bar import ChatStatusBar
from .worker import ChatThread, Job, ReplyStats

TITLE_WORDS = 8
SAVE_EVERY_S = 2.0  # a streaming reply is saved (as incomplete) this often, so a crash keeps most of it


def title_from(text: str) -> str:
    words = text.split()
    return " ".join(words[:TITLE_WORDS]) + ("…" if len(words) > TITLE_WORDS else "")


class MainWindow(QMainWindow):
    def __init__(self, store: ChatStore, settings: ChatSettings, data_folder: Path,
                 loader: Loader = load_runtime) -> None:
        super().__init__()
        self.setWindowTitle("SpecMemo Chat")
        self.resize(1100, 720)
        self.store, self.settings, self.data_folder = store, settings, data_folder
        self.runtime: Runtime | None = None
        self.dialogs = Dialogs(self)
        self.conversation_id: int | None = None
        self.history: list[tuple[int, str, str]] = []  # (message id, role, content) of the open chat
        self.generating = False
        self._regenerating = False
        self._reply_id: int | None = None  # the streaming reply's row in the store
        self._reply_saved = 0.0
        self._progress: QProgressDialog | None = None
        self._build()
        self.chat = ChatThread(self)
        w = self.chat.worker
        w.accepted.connect(self._on_accepted)
        w.context_trimmed.connect(self._on_trimmed)
        w.token_ready.connect(self._on_token)
        w.stats_updated.connect(self.status.show_speed)
        w.finished.connect(self._on_finished)
        w.failed.connect(self._on_failed)
        self.models = ModelManager(data_folder, loader, self)
        self.models.progress.connect(self._on_load_progress)
        self.models.loaded.connect(self._on_loaded)
        self.models.failed.connect(self._on_load_failed)
        self._memory_timer = QTimer(self)
        self._memory_timer.timeout.connect(self._show_memory)
        self._memory_timer.start(2000)
        self.sidebar.refresh()
        ids = self.sidebar.ids()
        if ids:
            self.sidebar.select(ids[0])
        self._update_buttons()

    # -- layout ----------------------------------------------------------------
    def _build(self) -> None:
        self.sidebar = ConversationList(self.store)
        self.sidebar.selected.connect(self.open_conversation)
        self.sidebar.new_requested.connect(self.new_conversation)
        self.sidebar.deleted.connect(self._on_deleted)
        self.view = ChatView()
        self.hint = QLabel()
        self.hint.setWordWrap(True)
        self.hint.setStyleSheet("color: #8a4b00")
        self.input = ChatInput()
        self.input.send_requested.connect(self.send)
        buttons = QHBoxLayout()
        self.send_button = self._button("Send", self.send, buttons)
        self.stop_button = self._button("Stop", self.stop, buttons)
        self.regenerate_button = self._button("Regenerate", self.regenerate, buttons)
        self.copy_button = self._button("Copy", self.copy_reply, buttons)
        buttons.addStretch(1)
        self.settings_button = self._button("Settings…", self.open_settings, buttons)
        right = QWidget()
        v = QVBoxLayout(right)
        v.addWidget(self.view, 1)
        v.addWidget(self.hint)
        v.addWidget(self.input)
        v.addLayout(buttons)
        split = QSplitter()
        split.addWidget(self.sidebar)
        split.addWidget(right)
        split.setStretchFactor(1, 1)
        split.setSizes([260, 840])
        self.setCentralWidget(split)
        self.status = ChatStatusBar()
        self.setStatusBar(self.status)
        menu = self.menuBar().addMenu("&Chat")
        for text, slot, keys in (("New chat", self.new_conversation, QKeySequence.StandardKey.New),
                                 ("Export as Markdown…", lambda: self._export_dialog("md"), None),
                                 ("Export as JSON…", lambda: self._export_dialog("json"), None),
                                 ("Settings…", self.open_settings, QKeySequence.StandardKey.Preferences),
                                 ("Quit", self.close, QKeySequence.StandardKey.Quit)):
            action = QAction(text, self)
            action.triggered.connect(slot)
            if keys is not None:
                action.setShortcut(keys)
            menu.addAction(action)

    def _button(self, text: str, slot, row: QHBoxLayout) -> QPushButton:
        button = QPushButton(text)
        button.clicked.connect(slot)
        row.addWidget(button)
        return button

    def _update_buttons(self) -> None:
        has_reply = any(role == "assistant" for _, role, _ in self.history)
        self.send_button.setEnabled(not self.generating)
        self.stop_button.setEnabled(self.generating)
        self.regenerate_button.setEnabled(not self.generating and any(r == "user" for _, r, _ in self.history))
        self.copy_button.setEnabled(has_reply or bool(self.view.reply_text))
        self.sidebar.setEnabled(not self.generating)

    def say(self, text: str) -> None:
        """A hint under the chat: bad input, context notices, what happens next."""
        self.hint.setText(text)

    # -- models ----------------------------------------------------------------
    def start(self, runtime: Runtime | None = None) -> None:
        """Use a ready runtime (tests), or load the model for the current settings."""
        if runtime is not None:
            self.apply_runtime(runtime)
        else:
            self.load_model(self.settings)

    def load_model(self, settings: ChatSettings, show_progress: bool = True) -> None:
        self.say(f"Loading {settings.model} …")
        if show_progress:
            self._progress = QProgressDialog("Starting…", "Cancel", 0, 100, self)
            self._progress.setWindowTitle("Loading the model")
            self._progress.setMinimumDuration(300)
            self._progress.canceled.connect(self.models.cancel)
        self.models.load(settings)

    def _on_load_progress(self, stage: str, fraction: float) -> None:
        if stage == "probing the device" or self._progress is None:
            self.say(f"Loading: {stage} …")
        if self._progress is not None:
            self._progress.setLabelText(stage)
            if 0.0 < fraction < 1.0:
                self._progress.setRange(0, 100)
                self._progress.setValue(int(100 * fraction))
            else:  # a stage that reports no fraction: a busy bar, so a slow step never looks like a hang
                self._progress.setRange(0, 0)

    def _close_progress(self) -> None:
        if self._progress is not None:
            self._progress.reset()
            self._progress.deleteLater()
            self._progress = None

    def _on_loaded(self, runtime: Runtime) -> None:
        self._close_progress()
        self.apply_runtime(runtime)
        self.say(f"{runtime.backend.name} is ready.")

    def apply_runtime(self, runtime: Runtime) -> None:
        self.runtime, self.settings = runtime, runtime.settings
        self.chat.configure(runtime.backend, runtime.capacity, runtime.speculative)
        self.status.show_runtime(runtime)
        try:
            save_settings(self.data_folder, runtime.settings)
        except OSError as exc:
            self.say(f"Could not save the settings ({exc}); they apply until you quit.")

    def _on_load_failed(self, kind: str, message: str, tried: ChatSettings) -> None:
        self._close_progress()
        keep = self.runtime.settings if self.runtime is not None else None
        self.settings = keep or self.settings
        stays = " The previous model stays in use." if keep else ""
        if kind == "cancelled":
            self.say("Loading was cancelled." + stays + " Open Settings… to load a model.")
            return
        if kind == "heads":
            if self.dialogs.ask("Draft heads do not fit this model", message + stays,
                                ["Run without heads", "Cancel"]) == "Run without heads":
                self.load_model(tried.with_(heads="none", speculate=False))
            return
        if kind == "model_file":
            choice = self.dialogs.ask("Model missing or damaged", message + stays,
                                      ["Use the default model", "Choose another…", "Cancel"])
            if choice == "Use the default model":
                self.load_model(tried.with_(model="default", heads="auto"))
            elif choice == "Choose another…":
                self.open_settings()
            return
        if kind == "fetch":
            choice = self.dialogs.ask("Download failed", message, ["Retry", "Choose a local model…", "Cancel"])
            if choice == "Retry":
                self.load_model(tried)
            elif choice == "Choose a local model…":
                self.open_settings()
            return
        self.dialogs.tell("Could not load the model", message + stays)

    def _show_memory(self) -> None:
        if self.runtime is not None:
            self.status.show_memory(memory_in_use(self.runtime.device))

    # -- settings --------------------------------------------------------------
    def settings_dialog(self) -> SettingsDialog:
        return SettingsDialog(self.settings, self.runtime.inputs if self.runtime else None, self)

    def open_settings(self) -> None:
        dialog = self.settings_dialog()
        if dialog.exec():
            self.apply_settings(dialog.settings())

    def apply_settings(self, new: ChatSettings) -> None:
        """Re-plan in place when the weights stay; load again (keeping the old model until then) otherwise."""
        if self.runtime is None or self.runtime.settings.needs_reload(new):
            self.settings = new
            self.load_model(new)
            return
        try:
            self.apply_runtime(self.runtime.replanned(new))
        except SpecMemoError as exc:
            self.dialogs.tell("Settings not applied", str(exc))

    # -- conversations ---------------------------------------------------------
    def new_conversation(self) -> int:
        if self.generating:
            return self.conversation_id or 0
        conv = self.store.create(system_prompt=self.settings.system_prompt)
        self.sidebar.refresh(select=conv.id)
        self.open_conversation(conv.id)
        return conv.id

    def open_conversation(self, conversation_id: int) -> None:
        if self.generating:
            return
        self.conversation_id = conversation_id
        self.history = [(m.id, m.role, m.content) for m in self.store.messages(conversation_id)]
        self.view.set_messages([(role, text) for _, role, text in self.history])
        self.say("")
        self._update_buttons()

    def _on_deleted(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id:
            self.conversation_id, self.history = None, []
            self.view.set_messages([])
            self._update_buttons()

    def export(self, path: Path, fmt: str) -> None:
        if self.conversation_id is None:
            raise SpecMemoError("open a chat first")
        text = self.store.export_json(self.conversation_id) if fmt == "json" else \
            self.store.export_markdown(self.conversation_id)
        write_text_atomic(path, text)  # a failed write (disk full) leaves the previous export whole

    def _export_dialog(self, fmt: str) -> None:
        if self.conversation_id is None:
            self.say("Open a chat to export it.")
            return
        filt = "JSON (*.json)" if fmt == "json" else "Markdown (*.md)"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", f"chat.{fmt}", filt)
        if path:
            try:
                self.export(Path(path), fmt)
            except (OSError, SpecMemoError) as exc:
                self.dialogs.tell("Export failed", f"Could not write {path}: {exc}")

    # -- replies ---------------------------------------------------------------
    def _job(self, history: list[tuple[int, str, str]], text: str) -> Job:
        system_prompt = self.store.get(self.conversation_id).system_prompt if self.conversation_id else ""
        config = GenerationConfig(max_new_tokens=self.settings.max_reply_tokens,
                                  temperature=self.settings.temperature)
        messages = [{"role": role, "content": content} for _, role, content in history]
        return Job(self.conversation_id or 0, messages, text, config, system_prompt)

    def send(self) -> None:
        if self.generating:
            return
        text = self.input.toPlainText()
        if not text.strip():
            self.say("Type a message first: empty messages are not sent.")
            return
        if self.runtime is None:
            self.say("The model is not loaded yet; your message stays in the box. Send it once loading finishes.")
            return
        if self.conversation_id is None:
            self.new_conversation()
        self._regenerating = False
        self._begin(self._job(self.history, text))

    def regenerate(self) -> None:
        """Answer the last user message again: later messages leave the history and the view."""
        if self.generating or self.runtime is None:
            return
        last = max((i for i, (_, role, _) in enumerate(self.history) if role == "user"), default=None)
        if last is None:
            return
        try:
            if self.store.pending:  # unsaved messages (id 0) first get their ids: deleting after 0 deletes all
                self.store.flush_pending()
                self.history = [(m.id, m.role, m.content) for m in self.store.messages(self.conversation_id)]
                last = max(i for i, (_, role, _) in enumerate(self.history) if role == "user")
            msg_id, _, text = self.history[last]
            self.store.delete_messages_after(self.conversation_id, msg_id)
        except ChatStoreError as exc:
            self.dialogs.tell("Cannot regenerate", str(exc))
            return
        self.history = self.history[:last + 1]
        self.view.set_messages([(role, content) for _, role, content in self.history])
        self._regenerating = True
        self._begin(self._job(self.history[:last], text))

    def _begin(self, job: Job) -> None:
        self.generating = True
        self.say("")
        self._update_buttons()
        self.chat.generate(job)

    def stop(self) -> None:
        if self.generating:
            self.chat.stop()

    def copy_reply(self) -> None:
        QGuiApplication.clipboard().setText(self.view.reply_text)

    def _on_accepted(self, text: str) -> None:
        if not self._regenerating:
            self.input.clear()
            try:
                msg = self.store.add_message(self.conversation_id, "user", text)
                self.history.append((msg.id, "user", text))
            except ChatStoreError as exc:
                self.history.append((0, "user", text))
                self.say(str(exc))
            if self.store.get(self.conversation_id).title == "New chat":
                self.store.rename(self.conversation_id, title_from(text))
                self.sidebar.refresh()
            self.view.add("user", text)
        self.view.begin_reply()
        try:
            self._reply_id = self.store.add_message(self.conversation_id, "assistant", "", complete=False).id
        except ChatStoreError:
            self._reply_id = None  # saved whole when it finishes
        self._reply_saved = time.monotonic()

    def _on_token(self, text: str) -> None:
        self.view.append_text(text)
        if self._reply_id is not None and time.monotonic() - self._reply_saved > SAVE_EVERY_S:
            self._reply_saved = time.monotonic()
            try:
                self.store.update_message(self._reply_id, self.view.reply_text, complete=False)
            except ChatStoreError:
                pass  # waits in the store's pending list; the final save retries it

    def _on_trimmed(self, turns: int) -> None:
        notice = (f"The conversation is longer than the model's context: the oldest {turns} turn(s) are no "
                  "longer seen by the model (they stay in the history).")
        self.view.add("notice", notice)
        self.say(notice)

    def _on_finished(self, stats: ReplyStats) -> None:
        self.generating = False
        self.view.render()
        reply_id, self._reply_id = self._reply_id, None
        try:
            if reply_id is not None:
                msg = self.store.update_message(reply_id, stats.text, not stats.stopped, stats.as_dict())
            else:
                msg = self.store.add_message(self.conversation_id, "assistant", stats.text,
                                             complete=not stats.stopped, stats=stats.as_dict())
            self.history.append((msg.id, "assistant", stats.text))
        except ChatStoreError as exc:
            self.history.append((0, "assistant", stats.text))
            self.say(str(exc))
        if stats.stopped:
            self.say("Stopped. Regenerate to answer again.")
        self.status.show_speed(stats)
        self._update_buttons()

    def _on_failed(self, kind: str, message: str, user_text: str) -> None:
        self.generating = False
        self.view.drop_last("assistant")
        reply_id, self._reply_id = self._reply_id, None
        if reply_id is not None and self.history and self.history[-1][1] == "user":
            try:  # the reply's placeholder (the chat's last message) goes; the user's message stays
                self.store.delete_messages_after(self.conversation_id, reply_id - 1)
            except ChatStoreError as exc:
                self.say(str(exc))
        self._update_buttons()
        if kind == "too_long":
            self.say(message)  # the text was never taken out of the input box
        elif kind == "oom" and self.runtime is not None:
            choice = self.dialogs.ask("Out of memory", message + " Your message is kept. Re-plan with a smaller "
                                      "context and tree, and try again?", ["Re-plan smaller and retry", "Cancel"])
            if choice == "Re-plan smaller and retry":
                self.apply_settings(smaller_settings(self.settings))
                self.regenerate()
        elif kind == "no_model":
            self.say(message)
        else:
            self.dialogs.tell("The reply failed", message + " Your message is kept; try again with Regenerate "
                              "(or Send, if it is still in the box).")

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        self._memory_timer.stop()
        self.chat.shutdown()
        self.models.shutdown()
        super().closeEvent(event)
