"""The main window: conversations, the streaming chat, the input box, settings and failure dialogs.

It owns no model logic: replies come from the worker thread (worker.py), models from the
model manager (model_manager.py), history from ChatStore, plans from planning.py.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFileDialog, QHBoxLayout, QLabel, QMainWindow, QProgressDialog, QPushButton, QSplitter, QStackedWidget,
    QToolButton, QVBoxLayout, QWidget,
)

from specmemo_core.errors import (
    ContextFullError, FetchError, HeadsError, ModelFileError, OutOfMemoryError, SpecMemoError,
)
from specmemo_core.storage.atomic import write_text_atomic
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.storage.chatstore import ChatStore, ChatStoreError
from specmemo_core.tools.train.speed_up import SpeedUpJob

from . import theme
from .chat_input import ChatInput
from .chat_view import ChatView
from .context_window import TooLongError
from .conversation_list import ConversationList
from .device_timing import DeviceTimer
from .dialogs import Dialogs, describe
from .heads_training import HeadsTrainer, free_memory, job_for_runtime
from .menus import Command, about_html, build_menus, shortcuts_html
from .model_manager import Loader, ModelManager
from .planning import smaller_settings
from .runtime import EngineBackend, LoadCancelled, Runtime, load_runtime, memory_in_use
from .settings import ChatSettings, model_path_problem, save_settings
from .serving import LocalServing
from .settings_panel import SettingsDialog
from .speed_up_dialog import SpeedUpDialog
from .status_bar import ChatStatusBar
from .welcome import WelcomePanel
from .worker import ChatThread, Job, NoModelError, ReplyStats

TITLE_WORDS = 8
SAVE_EVERY_S = 2.0  # a streaming reply is saved (as incomplete) this often, so a crash keeps most of it
NO_MODEL_HINT = "Load one from the Model menu: the default model, or a model file of your own."
SPEED_UP = "Speed up this model…"
BUSY_TRAINING = ("Busy: training heads needs the memory a reply would use, so the chat waits. Your message stays "
                 "in the box: send it when training ends, or cancel training (Model ▸ Speed up this model…).")


def title_from(text: str) -> str:
    words = text.split()
    return " ".join(words[:TITLE_WORDS]) + ("…" if len(words) > TITLE_WORDS else "")


def chip_text(runtime: Runtime) -> str:
    """The header's model chip: model · precision · tree · context."""
    tree = f"tree {runtime.tree}" if runtime.speculative else "plain decoding"
    return f"{runtime.backend.name} · {runtime.plan.precision} · {tree} · {runtime.capacity:,} tokens"


class MainWindow(QMainWindow):
    def __init__(self, store: ChatStore, settings: ChatSettings, data_folder: Path,
                 loader: Loader = load_runtime) -> None:
        super().__init__()
        self.setWindowTitle("SpecMemo Chat")
        self.resize(1100, 720)
        self.store, self.settings, self.data_folder = store, settings, data_folder
        self.runtime: Runtime | None = None
        self.dialogs = Dialogs(self)
        self.conversation_id: int | None = None  # None: a new chat, made when its first message is sent
        self.history: list[tuple[int, str, str]] = []  # (message id, role, content) of the open chat
        self.generating = False
        self._regenerating = False
        self._reply_id: int | None = None  # the streaming reply's row in the store
        self._reply_saved = 0.0
        self._progress: QProgressDialog | None = None
        self.trainer: HeadsTrainer | None = None  # made on first use (Model ▸ Speed up this model…)
        self._speed_up: SpeedUpDialog | None = None
        self.training_heads: str | None = None  # "background" (the chat answers meanwhile) or "blocking"
        self._colours = theme.apply(settings.theme)
        self._build()
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_scheme_changed)
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
        self.timer = DeviceTimer(data_folder, self)
        self.timer.progress.connect(self.status.show_timing)
        self.timer.ended.connect(lambda: self.status.show_timing(None))
        self.timer.measured.connect(self._on_timed)
        self._timed: tuple[object, object] | None = None  # a timing that came while a reply streamed
        self.serving = LocalServing(self)
        self.serving.serving.connect(self._on_serving)
        self.serving.failed.connect(lambda message: self.say(message, "warning"))
        self._memory_timer = QTimer(self)
        self._memory_timer.timeout.connect(self._show_memory)
        self._memory_timer.start(2000)
        self.sidebar.refresh()  # the last chats are one click away; the window opens on a new one
        self._update_buttons()

    # -- layout ----------------------------------------------------------------
    def _build(self) -> None:
        self.sidebar = ConversationList(self.store)
        self.sidebar.selected.connect(self.open_conversation)
        self.sidebar.new_requested.connect(self.new_conversation)
        self.sidebar.deleted.connect(self._on_deleted)
        split = QSplitter()
        split.addWidget(self.sidebar)
        split.addWidget(self._chat_pane())
        split.setStretchFactor(1, 1)
        split.setSizes([260, 840])
        self.setCentralWidget(split)
        self.status = ChatStatusBar()
        self.setStatusBar(self.status)
        self.commands = self._commands()
        self.actions = build_menus(self, self.commands)
        self._check_theme_action()

    def _chat_pane(self) -> QWidget:
        self.title = QLabel("New chat")
        self.title.setStyleSheet("font-weight: 600; font-size: 12pt")
        self.chip = QToolButton()
        self.chip.setObjectName("chip")
        self.chip.setText("No model loaded")
        self.chip.setToolTip("The model and plan in use (model · precision · tree · context). Click for Settings.")
        self.chip.clicked.connect(self.open_settings)
        header = QHBoxLayout()
        header.addWidget(self.title, 1)
        header.addWidget(self.chip)
        self.view = ChatView()
        self.welcome = WelcomePanel()
        self.welcome.prompt_chosen.connect(self.send_example)
        self.welcome.load_default.connect(self.load_default_model)
        self.welcome.choose_file.connect(self.choose_model_file)
        self.pages = QStackedWidget()
        self.pages.addWidget(self.welcome)
        self.pages.addWidget(self.view)
        self.view.rendered.connect(self._show_page)
        self.hint = QLabel()
        self.hint.setWordWrap(True)
        self.input = ChatInput()
        self.input.send_requested.connect(self.send)
        buttons = QHBoxLayout()
        self.stop_button = self._button("Stop", self.stop, buttons)
        self.regenerate_button = self._button("Regenerate", self.regenerate, buttons)
        self.copy_button = self._button("Copy reply", self.copy_reply, buttons)
        buttons.addStretch(1)
        self.settings_button = self._button("Settings…", self.open_settings, buttons)
        self.send_button = self._button("Send", self.send, buttons)
        self.send_button.setObjectName("primary")
        right = QWidget()
        v = QVBoxLayout(right)
        v.addLayout(header)
        v.addWidget(self.pages, 1)
        v.addWidget(self.hint)
        v.addWidget(self.input)
        v.addLayout(buttons)
        return right

    def _commands(self) -> list[Command]:
        return [  # NOTE: explicit keys: the standard ones (Preferences, Quit) are empty on some platforms
            Command("&Chat", "New chat", self.new_conversation, "Ctrl+N"),
            Command("&Chat", "Stop the reply", self.stop, "Esc"),
            Command("&Chat", "Regenerate the reply", self.regenerate, "Ctrl+R"),
            Command("&Chat", "Copy the reply", self.copy_reply, "Ctrl+Shift+C"),
            Command("&Chat", "Export as Markdown…", lambda: self._export_dialog("md")),
            Command("&Chat", "Export as JSON…", lambda: self._export_dialog("json")),
            Command("&Chat", "Quit", self.close, "Ctrl+Q"),
            Command("&Model", "Load the default model", self.load_default_model),
            Command("&Model", "Choose a model file…", self.choose_model_file),
            Command("&Model", SPEED_UP, self.speed_up),
            Command("&Model", "Settings…", self.open_settings, "Ctrl+,"),
            Command("&View", "Theme: System", lambda: self.set_theme("system")),
            Command("&View", "Theme: Light", lambda: self.set_theme("light")),
            Command("&View", "Theme: Dark", lambda: self.set_theme("dark")),
            Command("&View", "Focus the message box", self.input.setFocus, "Ctrl+L"),
            Command("&Help", "Keyboard shortcuts…", self.show_shortcuts, "F1"),
            Command("&Help", "About SpecMemo Chat", self.show_about),
        ]

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
        speed_up = self.actions[SPEED_UP]
        speed_up.setEnabled(self.runtime is not None)
        speed_up.setStatusTip("Train draft heads for the loaded model on this computer" if self.runtime else
                              "Load a model first: heads are trained for the model in use")

    def _show_page(self) -> None:
        """The welcome panel while the chat is empty, the conversation otherwise."""
        self.pages.setCurrentWidget(self.view if self.view.entries else self.welcome)

    def say(self, text: str, tone: str = "info") -> None:
        """A hint under the chat: bad input, context notices, what happens next. ``tone`` is "info",
        "success" or "warning" (the theme's colours; warning only for what needs attention)."""
        colour = {"success": self._colours.success, "warning": self._colours.warning}.get(tone, self._colours.text)
        self.hint.setStyleSheet(f"color: {colour}")
        self.hint.setText(text)

    # -- view ------------------------------------------------------------------
    def set_theme(self, choice: str) -> None:
        """View ▸ Theme: apply ``choice`` ("system", "light", "dark") and keep it in the settings."""
        self.settings = self.settings.with_(theme=choice)
        if self.runtime is not None:
            self.runtime = replace(self.runtime, settings=self.runtime.settings.with_(theme=choice))
        self._colours = theme.apply(choice)
        self._check_theme_action()
        self._save_settings(self.settings)

    def _on_scheme_changed(self, *_: object) -> None:
        if self.settings.theme == "system":
            self._colours = theme.apply("system")

    def _check_theme_action(self) -> None:
        for name in ("System", "Light", "Dark"):
            action = self.actions[f"Theme: {name}"]
            action.setCheckable(True)
            action.setChecked(self.settings.theme == name.lower())

    def show_shortcuts(self) -> None:
        self.dialogs.inform("Keyboard shortcuts", shortcuts_html(self.commands))

    def show_about(self) -> None:
        self.dialogs.inform("About SpecMemo Chat", about_html())

    # -- models ----------------------------------------------------------------
    def start(self, runtime: Runtime | None = None) -> None:
        """Use a ready runtime (tests), or load the model for the current settings."""
        if runtime is not None:
            self.apply_runtime(runtime)
            self.welcome.show_ready()
            self._time_device(runtime)
        else:
            self.load_model(self.settings)

    def load_model(self, settings: ChatSettings, show_progress: bool = True) -> None:
        self.say(f"Loading {settings.model} …")
        self.welcome.show_loading(f"Loading {settings.model} …")
        if self.runtime is None:
            self.chip.setText("Loading…")
        if show_progress:
            self._progress = QProgressDialog("Starting…", "Cancel", 0, 100, self)
            self._progress.setWindowTitle("Loading the model")
            self._progress.setMinimumDuration(300)
            self._progress.canceled.connect(self.models.cancel)
        self.models.load(settings)

    def load_default_model(self) -> None:
        self.load_model(self.settings.with_(model="default", heads="auto"))

    def choose_model_file(self) -> None:
        """Model ▸ Choose a model file…: a .gguf file (a model folder: Settings ▸ Folder…)."""
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.load_model_file(path)
        elif self.runtime is None and not self.models.busy:
            self._show_no_model("No model was chosen.")

    def load_model_file(self, path: str) -> bool:
        """Load ``path`` if it can be a model; else say why (the window stays as it was)."""
        problem = model_path_problem(path)
        if problem:
            self.say(problem, "warning")
            if self.runtime is None:
                self.welcome.show_no_model(problem)
            return False
        self.load_model(self.settings.with_(model=path, heads="auto"))
        return True

    def _on_load_progress(self, stage: str, fraction: float) -> None:
        self.welcome.show_loading(f"Loading: {stage} …")
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
        self.welcome.show_ready()
        self.say(f"{runtime.backend.name} is ready.", "success")
        self._time_device(runtime)

    # -- device timing -----------------------------------------------------------
    def _time_device(self, runtime: Runtime) -> None:
        """The plan came from the cached timing or the prior: when that is missing or stale,
        time the device in the background (the window is ready and replies meanwhile)."""
        self._timed = None
        if self.timer.start(runtime):
            self.status.show_timing(0.0)

    def _on_timed(self, timing: object, model: object) -> None:
        """The background timing is in: re-plan with it, now or once the streaming reply ends."""
        if self.generating:
            self._timed = (timing, model)
            return
        runtime = self.runtime
        if runtime is None or not isinstance(runtime.backend, EngineBackend) \
                or runtime.backend.engine.model is not model:
            return  # another model was loaded meanwhile: its own timing follows
        try:
            self.apply_runtime(runtime.with_timing(timing))
        except SpecMemoError as exc:  # the plan in force stays
            self.status.showMessage(f"The device was timed, but the plan was kept: {exc}", 10000)
            return
        self.status.showMessage(f"The device was timed: the plan now uses {chip_text(self.runtime)}.", 10000)

    def _after_reply(self) -> None:
        self.timer.replying(False)
        timed, self._timed = self._timed, None
        if timed is not None:
            self._on_timed(*timed)

    def apply_runtime(self, runtime: Runtime) -> None:
        runtime = replace(runtime, settings=runtime.settings.with_(theme=self.settings.theme))
        self.runtime, self.settings = runtime, runtime.settings
        self.chat.configure(self.serving.backend_for(runtime, runtime.settings), runtime.capacity,
                            runtime.speculative)
        self.status.show_runtime(runtime)
        self.chip.setText(chip_text(runtime))
        self._save_settings(runtime.settings)
        self.serving.update(runtime, runtime.settings)  # starts, restarts or stops off the GUI thread
        self._update_buttons()

    def _on_serving(self, url: str) -> None:
        """The server started or stopped: the chat decodes through it, or on its own again."""
        self.status.show_serving(url)
        if self.runtime is not None:
            self.chat.configure(self.serving.backend_for(self.runtime, self.settings), self.runtime.capacity,
                                self.runtime.speculative)
        if url:
            self.say(f"Serving {self.runtime.backend.name if self.runtime else 'the model'} on {url} "
                     "(OpenAI API, this computer only).", "success")

    def _save_settings(self, settings: ChatSettings) -> None:
        try:
            save_settings(self.data_folder, settings)
        except OSError as exc:
            self.say(f"Could not save the settings ({exc}); they apply until you quit.", "warning")

    def _offer(self, title: str, text: str, actions: dict[str, Callable[[], object] | None]) -> None:
        """Ask with one button per way forward and run the chosen one (None: Cancel, or closed)."""
        action = actions.get(self.dialogs.ask(title, text, list(actions)) or "")
        if action is not None:
            action()

    def _on_load_failed(self, exc: Exception, tried: ChatSettings) -> None:
        """Every loader failure ends here, typed; each type gets its ways forward, and without a
        model the window says so and offers to load one (never a dead end)."""
        self._close_progress()
        keep = self.runtime.settings if self.runtime is not None else None
        self.settings = keep or self.settings
        stays = " The previous model stays in use." if keep else ""
        again = {"Retry": lambda: self.load_model(tried)}
        other = {"Use the default model": lambda: self.load_model(tried.with_(model="default", heads="auto")),
                 "Choose another…": self.choose_model_file, "Cancel": None}
        match exc:
            case LoadCancelled():
                self.say("Loading was cancelled." + stays)
            case HeadsError():
                self._offer("Draft heads do not fit this model", str(exc) + stays,
                            {"Run without heads": lambda: self.load_model(tried.with_(heads="none", speculate=False)),
                             "Cancel": None})
            case ModelFileError():
                self._offer("Model missing or damaged", str(exc) + stays, other)
            case FetchError():
                self._offer("Download failed", str(exc) + stays, {**again, "Choose a local model…":
                                                                   self.choose_model_file, "Cancel": None})
            case _:
                self._offer("Could not load the model", describe(exc) + stays, {**again, **other})
        if self.models.busy:
            return  # a way forward is loading
        if self.runtime is not None:
            self.welcome.show_ready()  # the previous model answers as before
        else:
            self._show_no_model("Loading was cancelled." if isinstance(exc, LoadCancelled) else
                                f"{tried.model} could not be loaded: {describe(exc)}")

    def _show_no_model(self, reason: str) -> None:
        """Nothing is loaded or loading: say so everywhere, and offer the two ways to load a model."""
        self.welcome.show_no_model(reason)
        self.status.show_no_model()
        self.chip.setText("No model loaded")
        self.say(f"{reason} No model is loaded. {NO_MODEL_HINT}", "warning")

    def _show_memory(self) -> None:
        if self.runtime is not None:
            self.status.show_memory(memory_in_use(self.runtime.device))

    # -- draft heads ---------------------------------------------------------------
    def speed_up(self) -> None:
        """Model ▸ Speed up this model…: the dialog for the loaded model (the running one, if any)."""
        if self._speed_up is not None and self.trainer is not None and self.trainer.busy:
            self._speed_up.show()
            self._speed_up.raise_()
            return
        if self.runtime is None:
            self.say("Load a model first: heads are trained for the model in use. " + NO_MODEL_HINT, "warning")
            return
        try:
            job = job_for_runtime(self.runtime, self.data_folder)
        except SpecMemoError as exc:
            self.dialogs.tell("Cannot speed up this model", str(exc))
            return
        self.open_speed_up(job, model_name=self.runtime.backend.name)

    def open_speed_up(self, job: SpeedUpJob, *, model_name: str,
                      free_bytes: Callable[[], int] = free_memory) -> SpeedUpDialog:
        """Show the dialog for ``job`` (it starts by timing the device); returns it."""
        if self.trainer is None:
            self.trainer = HeadsTrainer(parent=self)
            self.trainer.progress.connect(self._on_training_progress)
        if self._speed_up is not None:
            self._speed_up.deleteLater()
        dialog = self._speed_up = SpeedUpDialog(job, self.trainer, model_name=model_name, free_bytes=free_bytes,
                                                parent=self)
        dialog.training_started.connect(self._on_training_started)
        dialog.training_ended.connect(self._on_training_ended)
        dialog.reload_requested.connect(lambda: self.load_model(self.settings.with_(heads="auto")))
        dialog.show()
        return dialog

    def _on_training_started(self, chat_usable: bool) -> None:
        self.training_heads = "background" if chat_usable else "blocking"
        self._on_training_progress("starting", 0.0)
        if not chat_usable:
            self.say(BUSY_TRAINING, "warning")

    def _on_training_progress(self, stage: str, fraction: float) -> None:
        if self.training_heads is not None:
            busy = "busy: " if self.training_heads == "blocking" else ""
            self.status.show_training(f"{busy}training heads · {stage} {round(100 * fraction)}%")

    def _on_training_ended(self, message: str) -> None:
        self.training_heads = None
        self.status.show_training("")
        self.say(message)

    # -- settings --------------------------------------------------------------
    def settings_dialog(self) -> SettingsDialog:
        return SettingsDialog(self.settings, self.runtime.inputs if self.runtime else None, self)

    def open_settings(self) -> None:
        dialog = self.settings_dialog()
        if dialog.exec():
            self.apply_settings(dialog.settings())

    def apply_settings(self, new: ChatSettings) -> None:
        """Re-plan in place when the weights stay; load again (keeping the old model until then) otherwise."""
        if self.runtime is None or self.runtime.needs_reload(new):
            self.settings = new
            self.load_model(new)
            return
        try:
            self.apply_runtime(self.runtime.replanned(new.with_(theme=self.settings.theme)))
        except SpecMemoError as exc:
            self.dialogs.tell("Settings not applied", str(exc))

    # -- conversations ---------------------------------------------------------
    def new_conversation(self) -> int:
        """A new chat (the open one, if it has no messages yet)."""
        if self.generating:
            return self.conversation_id or 0
        if self.conversation_id is not None and not self.history:
            return self.conversation_id
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
        self.title.setText(self.store.get(conversation_id).title)
        self.say("")
        self._update_buttons()

    def _on_deleted(self, conversation_id: int) -> None:
        if conversation_id == self.conversation_id:
            self.conversation_id, self.history = None, []
            self.view.set_messages([])
            self.title.setText("New chat")
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
        if self.training_heads == "blocking":
            self.say(BUSY_TRAINING, "warning")
            return
        if self.runtime is None and self.models.busy:
            self.say("The model is not loaded yet; your message stays in the box. Send it once loading finishes.")
            return
        if self.runtime is None:
            self.say("No model is loaded, so nothing can answer; your message stays in the box. "
                     + NO_MODEL_HINT, "warning")
            return
        if self.conversation_id is None:
            self.new_conversation()
        self._regenerating = False
        self._begin(self._job(self.history, text))

    def send_example(self, text: str) -> None:
        """An example prompt from the welcome panel: into the box, and sent when a model is ready."""
        self.input.setPlainText(text)
        if self.runtime is not None:
            self.send()
        else:
            self.input.setFocus()

    def regenerate(self) -> None:
        """Answer the last user message again: later messages leave the history and the view."""
        if self.generating or self.runtime is None:
            return
        if self.training_heads == "blocking":
            self.say(BUSY_TRAINING, "warning")
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
        self.timer.replying(True)
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
                self.say(str(exc), "warning")
            if self.store.get(self.conversation_id).title == "New chat":
                try:
                    self.store.rename(self.conversation_id, title_from(text))
                except ChatStoreError:
                    pass  # disk full or locked: the title is tried again with the next message
                self.title.setText(title_from(text))
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
            self.say(str(exc), "warning")
        if stats.stopped:
            self.say("Stopped. Regenerate to answer again.")
        self.status.show_speed(stats)
        self._update_buttons()
        self._after_reply()

    def _on_failed(self, exc: Exception, user_text: str) -> None:
        """Every reply failure ends here, typed: the placeholder goes, the user's message stays, and
        each type gets its way forward."""
        self.generating = False
        self._after_reply()
        self.view.drop_last("assistant")
        reply_id, self._reply_id = self._reply_id, None
        if reply_id is not None and self.history and self.history[-1][1] == "user":
            try:  # the reply's placeholder (the chat's last message) goes; the user's message stays
                self.store.delete_messages_after(self.conversation_id, reply_id - 1)
            except ChatStoreError as store_exc:
                self.say(str(store_exc), "warning")
        self._update_buttons()
        kept = " Your message is kept."
        match exc:
            case TooLongError():
                self.say(str(exc), "warning")  # the text was never taken out of the input box
            case NoModelError():
                self._show_no_model(str(exc))
            case OutOfMemoryError() if self.runtime is not None:
                self._offer("Out of memory", str(exc) + kept + " Re-plan with a smaller context and tree, and "
                            "try again?", {"Re-plan smaller and retry": self._retry_smaller, "Cancel": None})
            case ContextFullError():
                self._offer("The conversation is full", str(exc) + kept,
                            {"Move it to a new chat": lambda: self._move_to_new_chat(user_text), "Cancel": None})
            case _:
                self._offer("The reply failed", describe(exc) + kept,
                            {"Retry": lambda: self._retry(user_text), "Cancel": None})

    def _retry(self, user_text: str) -> None:
        """Answer ``user_text`` again: Regenerate if it reached the history, else Send it from the box."""
        if self.history and self.history[-1][1:] == ("user", user_text):
            self.regenerate()
        else:
            self.input.setPlainText(user_text)
            self.send()

    def _retry_smaller(self) -> None:
        self.apply_settings(smaller_settings(self.settings))
        self.regenerate()

    def _move_to_new_chat(self, user_text: str) -> None:
        self.conversation_id = None
        self.new_conversation()
        self.input.setPlainText(user_text)

    def _store_closed(self) -> bool:
        """Close the chat store; while some writes cannot be saved, ask: Retry, Quit anyway (they stay in the
        journal for the next start) or Cancel. False only for Cancel."""
        unsaved = self.store.close()
        while unsaved.count:
            choice = self.dialogs.ask("Some messages are not saved yet", unsaved.question,
                                      ["Retry", "Quit anyway", "Cancel"])
            if choice == "Retry":
                unsaved = self.store.close()
            elif choice == "Quit anyway":
                self.store.close(force=True)
                return True
            else:
                return False
        return True

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        if not self._store_closed():
            event.ignore()  # the user chose Cancel: the window stays, nothing is lost
            return
        self._memory_timer.stop()
        self.timer.shutdown()
        self.serving.shutdown()
        self.chat.shutdown()
        self.models.shutdown()
        if self.trainer is not None:
            self.trainer.shutdown()  # training stops at its next step and resumes next time
        super().closeEvent(event)
