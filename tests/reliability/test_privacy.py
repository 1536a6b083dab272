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
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.attempts: list[str] = []
        self.children: list[str] = []

        def refuse(what: str):
            def blocked(*args, **kwargs):
                self.attempts.append(f"{what}{args[1:] if what.startswith('socket.') else args}")
                raise OSError(f"network blocked by the privacy test ({what})")
            return blocked

        for name in ("connect", "connect_ex", "sendto"):
            monkeypatch.setattr(socket.socket, name, refuse(f"socket.{name}"))
        for name in ("create_connection", "getaddrinfo", "gethostbyname"):
            monkeypatch.setattr(socket, name, refuse(name))
        real_init = subprocess.Popen.__init__

        def record(popen, args, *rest, **kw):
            self.children.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
            real_init(popen, args, *rest, **kw)

        monkeypatch.setattr(subprocess.Popen, "__init__", record)

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
    """No telemetry/analytics library is imported anywhere; network modules only in the model fetch."""
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
    assert telemetry == {}
    assert network == {}
