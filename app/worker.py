"""Generation off the GUI thread: one long-lived QObject worker on a QThread, streaming by signals.

The worker knows the core only through the ChatBackend interface (runtime.py), so tests
can inject a scripted engine. The GUI thread talks to it through ``ChatThread``: queued
calls in, signals out, and ``stop()`` — a threading.Event the core checks between steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QThread, Signal, Slot

from specmemo_core.runtime.decoding import GenerationConfig, ReplyStats
from specmemo_core.errors import SpecMemoError

from .context_window import Messages, fit_window, system_messages

CONTEXT_MARGIN = 16  # tokens: re-encoded replies may split a little differently


class NoModelError(SpecMemoError):
    """A reply was asked for before any model was loaded."""

    def __init__(self) -> None:
        super().__init__("No model is loaded: load the default model or choose a model file, then send again.")


@dataclass(frozen=True)
class Job:
    """One reply to produce: ``history`` is every earlier message of the conversation."""

    conversation: int
    history: Messages
    user_text: str
    config: GenerationConfig = field(default_factory=GenerationConfig)
    system_prompt: str = ""


class ChatWorker(QObject):
    """Lives on the worker thread; every slot runs there."""

    accepted = Signal(str)  # the message fits and generation starts (the GUI may clear the input)
    context_trimmed = Signal(int)  # turns of this conversation now outside the model's context
    token_ready = Signal(str)
    stats_updated = Signal(object)  # ReplyStats, while streaming
    finished = Signal(object)  # ReplyStats with the whole reply text
    failed = Signal(object, str)  # the exception (TooLongError, OutOfMemoryError, NoModelError, …), the user's text

    def __init__(self) -> None:
        super().__init__()
        self.cancel = threading.Event()
        self._backend = None
        self._capacity = 0
        self._speculate = True
        self._session = None
        self._conversation: int | None = None
        self._start = 0  # first history message inside the model's context

    @Slot(object, int, bool)
    def configure(self, backend: object, capacity: int, speculate: bool) -> None:
        self._backend, self._capacity, self._speculate = backend, capacity, speculate
        self._session = None  # the next reply builds a session with the new settings

    @Slot(object)
    def generate(self, job: Job) -> None:
        """Answer ``job``; every failure (typed by the core, or anything else) is reported by ``failed``."""
        if self._backend is None:
            self.failed.emit(NoModelError(), job.user_text)
            return
        self.cancel.clear()
        try:
            session, dropped = self._session_for(job)
        except Exception as exc:  # noqa: BLE001 - TooLongError, or a backend that broke: the window decides
            self._session = None
            self.failed.emit(exc, job.user_text)
            return
        if dropped:
            self.context_trimmed.emit(dropped)
        self.accepted.emit(job.user_text)
        self._stream(session, job, dropped)

    def _session_for(self, job: Job) -> tuple[object, int]:
        """A session whose messages are the context window of ``job.history``; reused when it
        already holds exactly that window, so the KV cache of earlier turns is kept."""
        if job.conversation != self._conversation:
            self._conversation, self._start, self._session = job.conversation, 0, None
        reserve = job.config.max_new_tokens + CONTEXT_MARGIN
        window = fit_window(job.history, job.user_text, job.system_prompt, start=self._start,
                            count_tokens=self._backend.count_tokens, capacity=self._capacity, reserve=reserve,
                            fewest=self._backend.fewest_tokens(job.user_text))
        self._start = window.start
        wanted = system_messages(job.system_prompt) + job.history[window.start:]
        if self._session is None or self._session.messages != wanted:
            self._session = None  # free the old KV cache before allocating the new one
            self._session = self._backend.new_session(self._capacity, job.system_prompt, self._speculate)
            self._session.messages.extend(dict(m) for m in job.history[window.start:])
        dropped = sum(1 for m in job.history[:window.start] if m["role"] == "user")
        return self._session, dropped

    def _stream(self, session: object, job: Job, dropped: int) -> None:
        stats = ReplyStats(context_turns_dropped=dropped)
        start = last = time.perf_counter()
        try:
            for piece in session.send(job.user_text, job.config, self.cancel):
                now = time.perf_counter()
                stats.add(piece.step, piece.text, now - start)
                if piece.text:
                    self.token_ready.emit(piece.text)
                if now - last > 0.2:
                    last = now
                    self.stats_updated.emit(stats)
        except Exception as exc:  # noqa: BLE001 - OutOfMemoryError, ContextFullError, or a bug in the engine
            self._session = None  # its KV cache may be half-written: the next reply builds a new one
            self.failed.emit(exc, job.user_text)
            return
        stats.seconds = time.perf_counter() - start
        stats.stopped = self.cancel.is_set()
        stats.text = session.messages[-1]["content"]  # exactly what the session keeps
        self.finished.emit(stats)


class ChatThread(QObject):
    """The GUI thread's handle on the worker: owns the QThread, forwards calls as queued signals."""

    _configure = Signal(object, int, bool)
    _generate = Signal(object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("specmemo-chat-worker")
        self.worker = ChatWorker()
        self.worker.moveToThread(self.thread)
        self._configure.connect(self.worker.configure)
        self._generate.connect(self.worker.generate)
        self.thread.start()

    def configure(self, backend: object, capacity: int, speculate: bool) -> None:
        self._configure.emit(backend, capacity, speculate)

    def generate(self, job: Job) -> None:
        self._generate.emit(job)

    def stop(self) -> None:
        """Ask the reply in flight to end after its current step (safe from any thread)."""
        self.worker.cancel.set()

    def shutdown(self) -> None:
        self.stop()
        self.thread.quit()
        self.thread.wait()
