""""Serve on localhost": the window's loaded model through the OpenAI API on 127.0.0.1.

The server shares what the window already loaded: the engine (weights, heads, the plan's
tree) is not loaded again, and while it serves, the window's own chat is decoded by the
server's scheduler too (``ServedBackend``: ``serving.session.ScheduledSession``), so the
chat and the served requests share one decoder, one KV cache of the plan's size and one
decoding thread, taking turns in its queue. HTTP runs on uvicorn's thread; starting and
stopping run on one background thread of this object's, so the GUI never waits on
either. ``update`` is called whenever the runtime or the settings change;
``serving(url)`` and ``failed(message)`` say what happened.

NOTE: the window plans memory for one conversation, so its server has one slot of the
batched decoder (``runtime.batch.BatchDecoder``): a long served request holds the window's
reply in the queue until it ends (and the other way round). ``specmemo serve --slots N``
plans for N and decodes them side by side.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, Signal

from specmemo_core.errors import SpecMemoError

from .runtime import ChatBackend, EngineBackend, Messages, Runtime, Session
from .settings import ChatSettings


def served_key(runtime: Runtime | None, settings: ChatSettings) -> tuple | None:
    """What the running server must match (None: no server): the engine, its tree, the
    context, the port and the reply defaults."""
    if not settings.serve_on_localhost or runtime is None or not isinstance(runtime.backend, EngineBackend):
        return None
    return (id(runtime.backend.engine), runtime.tree if runtime.speculative else None, runtime.capacity,
            settings.serve_port, settings.max_reply_tokens, settings.temperature, settings.system_prompt)


@dataclass(frozen=True)
class ServedBackend:
    """The window's backend while it serves: its sessions are decoded by the server's scheduler."""

    backend: EngineBackend
    served: Any  # specmemo_core.serving.served.ServedModel

    @property
    def name(self) -> str:
        return self.backend.name

    def new_session(self, capacity: int, system_prompt: str | None, speculate: bool) -> Session:
        """``capacity`` and ``speculate`` are the server's already (its key holds the runtime's)."""
        from specmemo_core.serving.session import ScheduledSession

        return ScheduledSession(self.served, system_prompt or None)

    def count_tokens(self, messages: Messages) -> int:
        return self.backend.count_tokens(messages)

    def fewest_tokens(self, text: str) -> int:
        return self.backend.fewest_tokens(text)

    def with_tree(self, tree: str | None) -> EngineBackend:
        return self.backend.with_tree(tree)


class LocalServing(QObject):
    """At most one local server, matching the window's runtime and settings."""

    serving = Signal(str)  # the URL it listens on; "" once it stopped
    failed = Signal(str)  # why it could not start

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmemo-serve-switch")
        self._key: tuple | None = None  # what the last update asked for
        self._server: Any = None  # specmemo_core.serving.server.LocalServer; set on the pool's thread only
        self._running: tuple[Any, tuple | None] = (None, None)  # the server and its key, swapped at once
        self.url = ""

    def backend_for(self, runtime: Runtime, settings: ChatSettings) -> ChatBackend:
        """What the window's chat should decode with: the server's scheduler while a server of
        this very runtime and settings is up, else the runtime's own backend."""
        server, key = self._running
        if server is not None and key is not None and key == served_key(runtime, settings):
            return ServedBackend(runtime.backend, server.served)
        return runtime.backend

    def update(self, runtime: Runtime | None, settings: ChatSettings) -> None:
        """Start, stop or restart the server to match; returns at once."""
        key = served_key(runtime, settings)
        if key == self._key:
            return
        self._key = key
        self._pool.submit(self._switch, key, runtime if key is not None else None, settings)

    def _switch(self, key: tuple | None, runtime: Runtime | None, settings: ChatSettings) -> None:
        """On the pool's thread: the old server stops, then the new one starts (unless a later
        update already asked for something else)."""
        if self._server is not None:
            self._running = (None, None)
            self._server.stop()
            self._server = None
            self.url = ""
            self.serving.emit("")
        if key is None or key != self._key:
            return
        from specmemo_core.serving.served import Defaults, serve_engine
        from specmemo_core.serving.server import LocalServer, ServerAddress

        defaults = Defaults(settings.max_reply_tokens, settings.temperature, settings.system_prompt or None)
        try:
            served = serve_engine(runtime.backend.engine, capacity=runtime.capacity, defaults=defaults,
                                  speculate=runtime.speculative)
            self._server = LocalServer(served, ServerAddress(port=settings.serve_port)).start()
        except (SpecMemoError, MemoryError) as exc:
            self.failed.emit(f"Could not serve on localhost: {exc}")
            return
        self._running = (self._server, key)
        self.url = self._server.url
        self.serving.emit(self.url)

    def shutdown(self) -> None:
        """Stop the server (waits for it: at quit)."""
        self._key = None
        self._pool.submit(self._switch, None, None, ChatSettings())
        self._pool.shutdown(wait=True)
