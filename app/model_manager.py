"""Loading a model off the GUI thread, with stage progress, Cancel and classified failures."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from specmemo_core.errors import FetchError, HeadsError, ModelFileError, SpecMemoError, TreeError

from .runtime import LoadCancelled, Runtime, load_runtime
from .settings import ChatSettings

Loader = Callable[..., Runtime]  # load_runtime's signature; tests inject their own


def failure_kind(exc: BaseException) -> str:
    """Which way forward the window offers: see MainWindow._on_load_failed."""
    if isinstance(exc, LoadCancelled):
        return "cancelled"
    if isinstance(exc, HeadsError):
        return "heads"
    if isinstance(exc, ModelFileError):
        return "model_file"
    if isinstance(exc, FetchError):
        return "fetch"
    if isinstance(exc, TreeError):
        return "tree"
    return "error"


class _LoadWorker(QObject):
    progress = Signal(str, float)
    loaded = Signal(object)  # Runtime
    failed = Signal(str, str, object)  # kind, message, the settings that failed

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
        except SpecMemoError as exc:
            self.failed.emit(failure_kind(exc), str(exc), settings)
            return
        except (OSError, RuntimeError, ValueError, MemoryError) as exc:  # torch/transformers on odd files
            self.failed.emit("error", f"Loading failed: {exc}", settings)
            return
        self.loaded.emit(runtime)


class ModelManager(QObject):
    """Owns the loader thread. ``load(settings)`` returns at once; results come as signals."""

    progress = Signal(str, float)
    loaded = Signal(object)
    failed = Signal(str, str, object)
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

    def _done_failed(self, kind: str, message: str, settings: ChatSettings) -> None:
        self.busy = False
        self.failed.emit(kind, message, settings)

    def shutdown(self) -> None:
        self.cancel()
        self.thread.quit()
        self.thread.wait()
