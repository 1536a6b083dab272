"""Running the API: uvicorn on the address asked for (127.0.0.1 unless told otherwise), the
scheduler's decoding thread started with it and stopped after it.

``serve_blocking`` is the command line's (uvicorn on the calling thread: Ctrl-C ends it
cleanly); ``LocalServer`` runs it on a thread of its own, for the app and the tests.
Nothing here opens an outgoing connection: the server only listens.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from specmemo_core.errors import ServeError
from specmemo_core.serving.api import ApiOptions, build_app
from specmemo_core.serving.served import ServedModel

DEFAULT_HOST = "127.0.0.1"  # this computer only: another host must be asked for (--host)
DEFAULT_PORT = 8000
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServerAddress:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: a free port, chosen when it starts

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ServeError(f"--port must be from 0 to 65535, got {self.port}")


def url_of(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


def _uvicorn_server(served: ServedModel, address: ServerAddress, options: ApiOptions):
    import uvicorn

    config = uvicorn.Config(build_app(served, options), host=address.host, port=address.port, log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    return uvicorn.Server(config)


def _bound_port(server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


def _cannot_listen(address: ServerAddress) -> ServeError:
    return ServeError(f"cannot listen on {address.host}:{address.port}: the port is in use or the address is not "
                      "this computer's; choose another with --port (or --host)")


def serve_blocking(served: ServedModel, address: ServerAddress, options: ApiOptions,
                   on_ready: Callable[[str], None] | None = None) -> None:
    """Serve until Ctrl-C (or SIGTERM). ``on_ready(url)`` is called once it listens."""
    server = _uvicorn_server(served, address, options)
    served.scheduler.start()
    watcher = threading.Thread(target=_announce, args=(server, address, on_ready), daemon=True)
    watcher.start()
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits when it cannot bind
        raise _cannot_listen(address) from exc
    finally:
        served.scheduler.stop()
    if not server.started:
        raise _cannot_listen(address)


def _announce(server, address: ServerAddress, on_ready: Callable[[str], None] | None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started and not server.should_exit and time.monotonic() < deadline:
        time.sleep(0.05)
    if server.started and on_ready is not None:
        on_ready(url_of(address.host, _bound_port(server)))


class LocalServer:
    """The API on a thread of its own: ``start()`` returns once it listens (``url``), ``stop()``
    ends it and the scheduler's thread. The event loop and the decoding are off the caller's thread."""

    def __init__(self, served: ServedModel, address: ServerAddress = ServerAddress(),
                 options: ApiOptions = ApiOptions()) -> None:
        self.served = served
        self.address = address
        self.server = _uvicorn_server(served, address, options)
        self.thread = threading.Thread(target=self._run, name="specmemo-serve-http", daemon=True)
        self.port = 0

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # cannot bind: start() reports it
            logging.getLogger("specmemo.serve").warning("cannot listen on %s:%s", self.address.host,
                                                         self.address.port)

    @property
    def url(self) -> str:
        return url_of(self.address.host, self.port)

    def start(self) -> "LocalServer":
        self.served.scheduler.start()
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise _cannot_listen(self.address)
            time.sleep(0.02)
        self.port = _bound_port(self.server)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Open replies end first (with an error event), so no stream holds the shutdown."""
        self.served.scheduler.stop()
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
