"""Model loading through the model manager's thread: progress, failures and their ways forward."""

from __future__ import annotations

from PySide6.QtCore import Qt

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
    assert window.chip.text().startswith("scripted-model · ") and "turns fit" in window.status.plan.text()
    type_and_send(qtbot, window, "hi")
    wait_reply(qtbot, window)
    assert window.history[-1][1] == "assistant"


def test_message_before_the_model_is_kept(qtbot, make_window):
    import threading

    release = threading.Event()

    def slow(settings, folder, progress, cancel):
        progress("loading weights", 0.5)
        release.wait(10)
        return fake_runtime(settings=settings)

    window = make_window(loader=slow)
    window.start()
    qtbot.waitUntil(lambda: window.welcome.state == "loading" and "loading weights" in window.welcome.loading.text(),
                    timeout=10000)
    type_and_send(qtbot, window, "too early")
    assert "not loaded yet" in window.hint.text() and window.input.toPlainText() == "too early"
    release.set()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    assert window.welcome.state == "ready"
    type_and_send(qtbot, window, "now")
    wait_reply(qtbot, window)
    assert window.history[-1][1] == "assistant"


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
    assert window.welcome.state == "ready" and window.chip.text().startswith("scripted-model")


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


def test_a_loader_that_breaks_never_leaves_the_window_busy(qtbot, make_window):
    """Issue 18.5: a loader raising TypeError/KeyError/ZeroDivisionError (a broken config) reaches the
    window as a dialog with ways forward; Retry loads; Cancel leaves a window that says no model is loaded."""
    loader = StubLoader(ZeroDivisionError("division by zero"), KeyError("num_attention_heads"))
    window = make_window(loader=loader)
    window.dialogs = Answers("Retry", "Cancel")
    window.start()
    qtbot.waitUntil(lambda: len(window.dialogs.asked) == 2 and not window.models.busy, timeout=10000)
    (title, text, choices) = window.dialogs.asked[0]
    assert title == "Could not load the model" and "ZeroDivisionError: division by zero" in text
    assert choices == ["Retry", "Use the default model", "Choose another…", "Cancel"]
    assert len(loader.calls) == 2  # Retry loaded again, and that failed too
    assert "KeyError" in window.dialogs.asked[1][1]
    assert window.runtime is None and window.welcome.state == "no_model" and "No model is loaded" in window.hint.text()
    qtbot.mouseClick(window.welcome.load_default_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    assert loader.calls[-1].model == "default" and window.welcome.state == "ready"


def test_a_missing_model_file_is_no_dead_end(qtbot, make_window, folder):
    """Issue 16.4: ``--model /nope/model.gguf`` with the real loader; Cancel in the dialog leaves a window
    that says no model is loaded everywhere, Send says how to load one, and the empty state's button loads."""
    from app.runtime import load_runtime

    window = make_window(settings=ChatSettings(model="/nope/model.gguf"), loader=load_runtime)
    window.dialogs = Answers("Cancel")
    window.start()
    qtbot.waitUntil(lambda: bool(window.dialogs.asked) and not window.models.busy, timeout=60000)
    (title, text, choices), = window.dialogs.asked
    assert title == "Model missing or damaged" and "/nope/model.gguf" in text
    assert choices == ["Use the default model", "Choose another…", "Cancel"]
    assert window.runtime is None and window._progress is None
    assert window.welcome.state == "no_model" and window.pages.currentWidget() is window.welcome
    assert "/nope/model.gguf could not be loaded" in window.welcome.reason.text()
    assert "probing" not in window.hint.text() and "No model is loaded" in window.hint.text()
    assert window.status.plan.text() == "no model loaded" and "probing" not in window.status.device.text()
    assert window.chip.text() == "No model loaded"
    type_and_send(qtbot, window, "hello?")
    assert "No model is loaded" in window.hint.text() and "Model menu" in window.hint.text()
    assert "wait" not in window.hint.text() and "finishes" not in window.hint.text()
    assert window.input.toPlainText() == "hello?" and not window.generating
    assert window.welcome.load_default_button.isVisible() and window.welcome.choose_file_button.isVisible()
    assert not window.load_model_file(str(folder / "notes.txt"))  # a path that is no model: said, nothing loads
    assert "does not exist" in window.hint.text() and not window.models.busy
    window.models._worker.loader = StubLoader()  # the rest without the real model: the buttons' wiring
    qtbot.mouseClick(window.welcome.load_default_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=10000)
    assert window.settings.model == "default" and window.chip.text().startswith("scripted-model")
    type_and_send(qtbot, window, "hello?")
    wait_reply(qtbot, window)
    assert window.history[-1][1] == "assistant"
