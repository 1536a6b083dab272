"""Generation off the GUI thread: one long-lived QObject worker on a QThread, streaming by signals.

The worker knows the core only through the ChatBackend interface (runtime.py), so tests
can inject a scripted engine. The GUI thread talks to it through ``ChatThread``: queued
calls in, signals out, and ``stop()`` — a threading.Event the core checks between steps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field

from PySide6.QtCore import QObject, QThread, Signal, Slot

from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.errors import ContextFullError, SpecMemoError

from .context_window import Messages, TooLongError, fit_window, system_messages

CONTEXT_MARGIN = 16  # tokens: re-encoded replies may split a little differently


@dataclass
class ReplyStats:
    """Running totals over one reply (also what ``finished`` carries)."""

    text: str = ""
    tokens: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0  # reading the prompt, before the first token
    steps: int = 0  # verify steps after the prefill
    drafted: int = 0  # tokens those steps emitted
    stopped: bool = False
    context_turns_dropped: int = 0  # turns of this conversation outside the model's context

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: tokens after the first over the time after the prefill."""
        decoding = self.seconds - self.prefill_s
        return (self.tokens - 1) / decoding if self.steps and decoding > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        del out["text"]
        out.update(tokens_per_s=round(self.tokens_per_s, 3), mean_accepted=round(self.mean_accepted, 3))
        return out


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
    failed = Signal(str, str, str)  # kind ("too_long" | "oom" | "context" | "error" | "no_model"), message, user text

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
        if self._backend is None:
            self.failed.emit("no_model", "No model is loaded yet: wait for loading to finish, or load one "
                             "from Settings.", job.user_text)
            return
        self.cancel.clear()
        try:
            session, dropped = self._session_for(job)
        except TooLongError as exc:
            self.failed.emit("too_long", str(exc), job.user_text)
            return
        except SpecMemoError as exc:
            self.failed.emit("error", str(exc), job.user_text)
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
        window = fit_window(job.history, job.user_text, job.system_prompt, self._start,
                            self._backend.count_tokens, self._capacity, reserve,
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
                step = piece.step
                stats.tokens += len(step.token_ids)
                if step.prefill:
                    stats.prefill_s = time.perf_counter() - start
                elif step.accepted:
                    stats.steps += 1
                    stats.drafted += step.accepted
                if piece.text:
                    stats.text += piece.text
                    self.token_ready.emit(piece.text)
                now = time.perf_counter()
                stats.seconds = now - start
                if now - last > 0.2:
                    last = now
                    self.stats_updated.emit(stats)
        except ContextFullError as exc:
            self._session = None
            self.failed.emit("context", str(exc), job.user_text)
            return
        except (MemoryError, RuntimeError) as exc:
            self._session = None
            if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
                self.failed.emit("oom", f"The device ran out of memory during the reply ({exc}).", job.user_text)
            else:
                self.failed.emit("error", f"The reply failed: {exc}", job.user_text)
            return
        except SpecMemoError as exc:
            self._session = None
            self.failed.emit("error", str(exc), job.user_text)
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
