"""Shared test setup: the integration marker and isolated data folders."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: uses the real default model and data fetched from PyPI once per machine")
    config.addinivalue_line("markers", "full: long checks (minutes); run only with -m full")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Long checks run only when asked for (python -m pytest -m full)."""
    if "full" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="long check; run with -m full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh SPECMEMO_DATA_DIR per test: no test sees another's downloads or caches."""
    folder = tmp_path / "specmemo-data"
    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(folder))
    return folder


@pytest.fixture(scope="session")
def shared_data_root() -> Path:
    """One data folder kept across sessions, so real downloads happen once."""
    folder = os.environ.get("SPECMEMO_TEST_DATA_DIR") or os.path.join(tempfile.gettempdir(), "specmemo-test-data")
    return Path(folder)


@pytest.fixture
def shared_data_dir(shared_data_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(shared_data_root))
    return shared_data_root
