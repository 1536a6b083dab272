""""Serve on localhost": the window's loaded model through the OpenAI API on 127.0.0.1.

The server shares the engine the window already loaded (weights, heads, the plan's tree):
nothing is loaded twice. Its requests are decoded on the core scheduler's one thread
(``specmemo_core.serving``), with a KV cache of the plan's size of its own, and its HTTP on
uvicorn's thread; starting and stopping run on one background thread of this object's, so
the GUI never waits on either. ``update`` is called whenever the runtime or the settings
change; ``serving(url)`` and ``failed(message)`` say what happened.

NOTE: a reply in the window and a served request decode at the same time on separate
threads over the same weights (each with its own KV cache), so each runs slower while the
other does; routing the window's chat through the same scheduler is the next step once
``runtime.batch.BatchDecoder`` serves several sequences at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PySide6.QtCore import QObject, Signal

from specmemo_core.errors import SpecMemoError

from .runtime import EngineBackend, Runtime
from .settings import ChatSettings


def served_key(runtime: Runtime | None, settings: ChatSettings) -> tuple | None:
    """What the running server must match (None: no server): the engine, its tree, the
    context, the port and the reply defaults."""
    if not settings.serve_on_localhost or runtime is None or not isinstance(runtime.backend, EngineBackend):
        return None
    return (id(runtime.backend.engine), runtime.tree if runtime.speculative else None, runtime.capacity,
            settings.serve_port, settings.max_reply_tokens, settings.temperature, settings.system_prompt)


class LocalServing(QObject):
    """At most one local server, matching the window's runtime and settings."""

    serving = Signal(str)  # the URL it listens on; "" once it stopped
    failed = Signal(str)  # why it could not start

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specmemo-serve-switch")
        self._key: tuple | None = None  # what the last update asked for
        self._server: Any = None  # specmemo_core.serving.server.LocalServer; touched on the pool's thread only
        self.url = ""

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
        self.url = self._server.url
        self.serving.emit(self.url)

    def shutdown(self) -> None:
        """Stop the server (waits for it: at quit)."""
        self._key = None
        self._pool.submit(self._switch, None, None, ChatSettings())
        self._pool.shutdown(wait=True)
