"""Loading a model off the GUI thread, with stage progress, Cancel and typed failures.

A failure reaches the window as the exception itself (LoadCancelled, HeadsError, ModelFileError,
FetchError, or anything a broken model file made torch or transformers raise); the window
matches it by type and offers a way forward. ``busy`` is false again after every outcome."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from .runtime import Runtime, load_runtime
from .settings import ChatSettings

Loader = Callable[..., Runtime]  # load_runtime's signature; tests inject their own


class _LoadWorker(QObject):
    progress = Signal(str, float)
    loaded = Signal(object)  # Runtime
    failed = Signal(object, object)  # the exception, the settings that failed

    def __init__(self, data_folder: Path, loader: Loader) -> None:
        super().__init__()
        self.cancel = threading.Event()
        self.data_folder = data_folder
        self.loader = loader

    @Slot(object)
    def load(self, settings: ChatSettings) -> None:
        self.cancel.clear()
        try:
            runtime = self.loader(settings, self.data_folder, self.progress.emit, self.cancel)
        except Exception as exc:  # noqa: BLE001 - typed by the core, or torch/transformers on an odd file
            self.failed.emit(exc, settings)
            return
        self.loaded.emit(runtime)


class ModelManager(QObject):
    """Owns the loader thread. ``load(settings)`` returns at once; results come as signals."""

    progress = Signal(str, float)
    loaded = Signal(object)
    failed = Signal(object, object)  # the exception, the settings that failed
    _load = Signal(object)

    def __init__(self, data_folder: Path, loader: Loader = load_runtime, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.busy = False
        self.thread = QThread()
        self.thread.setObjectName("specmemo-model-loader")
        self._worker = _LoadWorker(data_folder, loader)
        self._worker.moveToThread(self.thread)
        self._load.connect(self._worker.load)
        self._worker.progress.connect(self.progress)
        self._worker.loaded.connect(self._done_ok)
        self._worker.failed.connect(self._done_failed)
        self.thread.start()

    def load(self, settings: ChatSettings) -> None:
        self.busy = True
        self._load.emit(settings)

    def cancel(self) -> None:
        """Stop at the next progress report (a download in pip's hands finishes its current file)."""
        self._worker.cancel.set()

    def _done_ok(self, runtime: Runtime) -> None:
        self.busy = False
        self.loaded.emit(runtime)

    def _done_failed(self, exc: Exception, settings: ChatSettings) -> None:
        self.busy = False
        self.failed.emit(exc, settings)

    def shutdown(self) -> None:
        self.cancel()
        self.thread.quit()
        self.thread.wait()
