"""App tests run offscreen with a scripted engine; the real default model where marked."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from specmemo_core.storage.chatstore import ChatStore  # noqa: E402

from .scripted import fake_runtime  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread():
    """NOTE: one torch thread for these tests (restored after each): on the 2-core test machine another
    process holds a core, and two contending threads run the model about 5x slower than one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An isolated data folder (settings, timing cache, history) for one test."""
    path = tmp_path / "data"
    path.mkdir()
    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(path))
    return path


class NoQuestions:
    """The window's dialogs where a test expects none (a test that expects some sets ``Answers``):
    a question or notice would open a modal box that nobody closes, and the suite would stop there;
    this fails the test with its text instead."""

    def ask(self, title, text, choices):
        raise AssertionError(f"unexpected question {title!r}: {text} {choices}")

    def tell(self, title, text):
        raise AssertionError(f"unexpected notice {title!r}: {text}")

    def inform(self, title, text):
        raise AssertionError(f"unexpected notice {title!r}: {text}")


@pytest.fixture
def make_window(qtbot, folder: Path):
    """make_window(runtime=fake, loader=None) → a shown MainWindow on ``folder``/history.sqlite3."""
    from app.main_window import MainWindow
    from app.settings import ChatSettings

    windows = []

    def make(runtime=None, loader=None, settings: ChatSettings | None = None, start: bool = True):
        store = ChatStore(folder / "history.sqlite3")
        settings = settings or (runtime.settings if runtime else ChatSettings())
        kwargs = {"loader": loader} if loader is not None else {}
        window = MainWindow(store, settings, folder, **kwargs)
        window.dialogs = NoQuestions()
        qtbot.addWidget(window)
        window.show()
        if start and runtime is not None:
            window.start(fake_runtime() if runtime == "fake" else runtime)
        windows.append((window, store))
        return window

    yield make
    for window, store in windows:
        window.close()
        store.close()
