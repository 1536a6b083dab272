"""Model loading through the model manager's thread: progress, failures and their ways forward."""

from __future__ import annotations

from specmemo_core.errors import FetchError, HeadsError, ModelFileError

from app.runtime import LoadCancelled
from app.settings import ChatSettings

from .scripted import fake_runtime
from .test_main_window import Answers, type_and_send, wait_reply


class StubLoader:
    """Fails with ``errors`` in turn, then loads the scripted runtime; records what it was asked."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls: list[ChatSettings] = []

    def __call__(self, settings, folder, progress, cancel):
        self.calls.append(settings)
        progress("loading weights", 0.5)
        if self.errors:
            raise self.errors.pop(0)
        return fake_runtime(settings=settings)


def test_loads_with_progress_then_chats(qtbot, make_window):
    loader = StubLoader()
    window = make_window(loader=loader, settings=ChatSettings(max_reply_tokens=32))
    stages = []
    window.models.progress.connect(lambda stage, fraction: stages.append(stage))
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    assert "loading weights" in stages and "Test CPU" in window.status.device.text()
    assert "scripted-model" in window.status.plan.text()
    type_and_send(qtbot, window, "hi")
    wait_reply(qtbot, window)
    assert window.history[-1][1] == "assistant"


def test_message_before_the_model_is_kept(qtbot, make_window):
    window = make_window(loader=StubLoader())
    type_and_send(qtbot, window, "too early")
    assert "not loaded yet" in window.hint.text() and window.input.toPlainText() == "too early"


def test_heads_for_another_model_offers_running_without(qtbot, make_window):
    loader = StubLoader(HeadsError("these heads were made for another model"))
    window = make_window(loader=loader, settings=ChatSettings(heads="/somewhere/heads"))
    window.dialogs = Answers("Run without heads")
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    (title, text, choices), = window.dialogs.asked
    assert "another model" in text and "Run without heads" in choices
    assert loader.calls[-1].heads == "none" and not window.runtime.speculative


def test_missing_model_offers_the_default_and_bad_file_keeps_the_previous(qtbot, make_window):
    loader = StubLoader(ModelFileError("/x/model.gguf", "file not found", "check the path"))
    window = make_window(loader=loader, settings=ChatSettings(model="/x/model.gguf"))
    window.dialogs = Answers("Use the default model")
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    assert loader.calls[-1].model == "default"
    before = window.runtime
    loader.errors.append(ModelFileError("/x/notes.gguf", "not a GGUF file", "point SpecMemo at a real .gguf"))
    window.dialogs = Answers("Cancel")
    window.apply_settings(window.settings.with_(model="/x/notes.gguf"))
    qtbot.waitUntil(lambda: bool(window.dialogs.asked), timeout=10000)
    assert "not a GGUF file" in window.dialogs.asked[0][1] and "previous model stays" in window.dialogs.asked[0][1]
    assert window.runtime is before and window.settings.model == "default"


def test_download_failure_offers_retry_and_cancel_is_quiet(qtbot, make_window):
    loader = StubLoader(FetchError("pip could not download"), LoadCancelled())
    window = make_window(loader=loader)
    window.dialogs = Answers("Retry")
    window.start()
    qtbot.waitUntil(lambda: len(loader.calls) == 2 and not window.models.busy, timeout=10000)
    assert window.dialogs.asked[0][0] == "Download failed"
    assert window.runtime is None and "cancelled" in window.hint.text()


def test_cancel_in_the_progress_dialog_stops_a_download(qtbot, make_window):
    def downloading(settings, folder, progress, cancel):
        import time

        from app.runtime import LoadCancelled

        for i in range(1000):
            if cancel.is_set():
                raise LoadCancelled()
            progress("downloading", i / 1000)
            time.sleep(0.01)
        raise AssertionError("the download was not cancelled")

    window = make_window(loader=downloading)
    window.start()
    qtbot.waitUntil(lambda: window._progress is not None and window._progress.value() > 0, timeout=10000)
    assert window._progress.maximum() == 100
    assert window._progress.labelText() == "downloading"
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QPushButton

    qtbot.mouseClick(window._progress.findChild(QPushButton), Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.models.busy, timeout=10000)
    assert window.runtime is None and "cancelled" in window.hint.text() and window._progress is None
