"""Privacy: a chat, a plan and a restart open no network connection; history is owner-only; no telemetry.

The socket guard is the proof: it refuses (and records) every connect and DNS lookup in this
process, and every child process is recorded, since the only network path the app has is the
explicit model fetch (pip, or specmemo_core/storage/wheel_fetch.py in the frozen app).
"""

from __future__ import annotations

import ast
import json
import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from specmemo_core.storage.chatstore import ChatStore

REPO = Path(__file__).resolve().parents[2]


class NetworkGuard:
    """``allow(host, port)``: connections to that one address (a test's own local server) go
    through; every other is refused and recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts: list[str] = []
        self.children: list[str] = []
        self.allowed: tuple[str, int] | None = None

        def refuse(what: str, real):
            def blocked(*args, **kwargs):
                if self._allows(what, args):
                    return real(*args, **kwargs)
                self.attempts.append(f"{what}{args[1:] if what.startswith('socket.') else args}")
                raise OSError(f"network blocked by the privacy test ({what})")
            return blocked

        for name in ("connect", "connect_ex", "sendto"):
            monkeypatch.setattr(socket.socket, name, refuse(f"socket.{name}", getattr(socket.socket, name)))
        for name in ("create_connection", "getaddrinfo", "gethostbyname"):
            monkeypatch.setattr(socket, name, refuse(name, getattr(socket, name)))
        real_init = subprocess.Popen.__init__

        def record(popen, args, *rest, **kw):
            self.children.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
            real_init(popen, args, *rest, **kw)

        monkeypatch.setattr(subprocess.Popen, "__init__", record)

    def allow(self, host: str, port: int) -> None:
        self.allowed = (host, port)

    def _allows(self, what: str, args: tuple) -> bool:
        if self.allowed is None:
            return False
        host, port = self.allowed
        if what in ("socket.connect", "socket.connect_ex"):
            return tuple(args[1][:2]) == (host, port)
        if what == "create_connection":
            return tuple(args[0][:2]) == (host, port)
        if what == "getaddrinfo":
            return args[0] == host and args[1] in (port, str(port))
        return False

    @property
    def fetches(self) -> list[str]:
        return [c for c in self.children if " pip " in f" {c} " or "download" in c]


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> NetworkGuard:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):  # prove it without help
        monkeypatch.delenv(name, raising=False)
    return NetworkGuard(monkeypatch)


def test_the_guard_catches_connections(guard: NetworkGuard) -> None:
    """The socket guard itself works: a connection attempt is refused and recorded."""
    with pytest.raises(OSError, match="network blocked"):
        socket.create_connection(("127.0.0.1", 9), timeout=1)
    with pytest.raises(OSError, match="network blocked"):
        socket.socket().connect(("127.0.0.1", 9))
    assert len(guard.attempts) == 2


def test_chat_plan_and_restart_make_no_connection(guard: NetworkGuard, shared_data_dir: Path, tmp_path: Path,
                                                  capsys) -> None:
    """A chat turn with the real default model, a plan and a history restart: no socket, no fetch."""
    model_file = shared_data_dir / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model_file.is_file():
        pytest.skip("the default model is not cached here (run tests -m integration once with network)")
    from specmemo_core import cli
    from specmemo_core.runtime.decoding import GenerationConfig
    from specmemo_core.runtime.engine import Engine

    engine = Engine.load("default", heads="auto", tree="calibrated-6+lookup-3")
    session = engine.new_session(capacity=256)
    reply = "".join(p.text for p in session.send("Hello! Who are you?", GenerationConfig(max_new_tokens=4)))
    assert reply.strip()

    assert cli.main(["plan", "--vram", "8GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["fits"] is True

    store = ChatStore(tmp_path / "history.sqlite3")
    conv = store.create("private")
    store.add_message(conv.id, "user", "Hello! Who are you?")
    store.add_message(conv.id, "assistant", reply)
    store.close()
    again = ChatStore(tmp_path / "history.sqlite3")
    assert [m.content for m in again.messages(conv.id)] == ["Hello! Who are you?", reply]
    again.close()

    assert guard.attempts == []
    assert guard.fetches == [], guard.children  # the model fetch (pip) was not needed, so not run


def test_serve_listens_on_this_computer_only_and_connects_nowhere(guard: NetworkGuard) -> None:
    """``specmemo serve`` binds 127.0.0.1 unless told otherwise; starting it and answering a chat
    request through the openai client opens no connection but the client's own to it."""
    import openai

    from specmemo_core.cli.main import build_parser
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.serving.served import serve_engine
    from specmemo_core.serving.server import DEFAULT_HOST, LocalServer, ServerAddress
    from specmemo_core.storage.sources import ModelIdentity
    from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

    assert build_parser().parse_args(["serve"]).host == "127.0.0.1" == DEFAULT_HOST == ServerAddress().host
    engine = Engine(tiny_model(), tiny_tokenizer(), tiny_config(), ModelIdentity("tiny", "0" * 16), None, None)
    server = LocalServer(serve_engine(engine, capacity=256), ServerAddress(port=0)).start()
    try:
        assert server.server.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"
        guard.allow("127.0.0.1", server.port)
        client = openai.OpenAI(base_url=server.url, api_key="any", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3)
        assert reply.usage.completion_tokens >= 1
    finally:
        server.stop()
    assert guard.attempts == [] and guard.fetches == []  # (the openai client runs `uname -p` for its headers)


def test_history_is_owner_only(data_dir: Path) -> None:
    """History folder 0o700, database and its -wal/-shm 0o600, even with a permissive umask (0o000)."""
    old = os.umask(0)
    try:
        store = ChatStore()  # the default place: the data folder
        conv = store.create("secret")
        store.add_message(conv.id, "user", "my secret")
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
        for name in ("history.sqlite3", "history.sqlite3-wal", "history.sqlite3-shm"):
            assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600, name
        store.close()
        (data_dir / "history.sqlite3").chmod(0o644)  # e.g. restored from a backup by another tool
        ChatStore().close()
        assert stat.S_IMODE((data_dir / "history.sqlite3").stat().st_mode) == 0o600  # tightened on open
    finally:
        os.umask(old)


NETWORK_MODULES = {"socket", "ssl", "http", "urllib.request", "urllib3", "requests", "httpx", "aiohttp",
                   "websocket", "websockets", "grpc", "huggingface_hub", "smtplib", "ftplib"}
TELEMETRY_MODULES = {"sentry_sdk", "posthog", "mixpanel", "analytics", "segment", "amplitude", "opentelemetry",
                     "datadog", "ddtrace", "bugsnag", "rollbar", "wandb", "mlflow", "statsd", "prometheus_client",
                     "newrelic", "honeybadger", "logfire"}
FETCH_MODULES = {"specmemo_core/storage/wheel_fetch.py"}  # the explicit model fetch of the frozen app
SERVER_MODULES = {"specmemo_core/serving/api.py", "specmemo_core/serving/server.py"}  # listens (specmemo serve)
LISTEN_MODULES = {"starlette", "uvicorn"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _matches(name: str, modules: set[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def test_no_telemetry_and_network_code_only_in_the_model_fetch() -> None:
    """No telemetry/analytics library is imported anywhere; network modules only in the model fetch,
    and the web server's only in the server's two modules (which listen, never connect)."""
    files = sorted((REPO / "specmemo_core").rglob("*.py")) + sorted((REPO / "app").rglob("*.py"))
    assert len(files) > 30
    telemetry, network = {}, {}
    for f in files:
        rel = str(f.relative_to(REPO))
        names = _imports(f)
        if hit := {n for n in names if _matches(n, TELEMETRY_MODULES)}:
            telemetry[rel] = hit
        if (hit := {n for n in names if _matches(n, NETWORK_MODULES)}) and rel not in FETCH_MODULES:
            network[rel] = hit
        if (hit := {n for n in names if _matches(n, LISTEN_MODULES)}) and rel not in SERVER_MODULES:
            network[rel] = hit
    assert telemetry == {}
    assert network == {}
