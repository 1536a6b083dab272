"""Timing the device in the background once the window is ready, handed back to the GUI thread.

The model is planned from the cached device timing or the prior (``runtime.load_runtime``
never measures), so neither the window nor the first reply waits on a timing. When that
timing is missing, stale or a prior, ``DeviceTimer.start`` measures in a daemon thread
(``planning.timing.refresh_in_background``): paused while a reply streams, so the timing
neither slows a reply nor is slowed by one, and called off when the window closes or
another model loads. Results come back as signals, queued to the GUI thread; the window
re-plans with them. One timing runs at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal, SignalInstance

from specmemo_core.planning.timing import refresh_in_background

from .runtime import EngineBackend, Runtime

QUIET_POLL_S = 0.2  # how often a paused timing looks for a cancel


def _emit(signal: SignalInstance, *args: Any) -> None:
    """Emit from the timing thread; after the window is gone there is no one to tell."""
    try:
        signal.emit(*args)
    except RuntimeError:  # the QObject was deleted (the window closed mid-run)
        pass


class DeviceTimer(QObject):
    """Owns the background timing. ``start(runtime)`` returns at once; results come as signals."""

    progress = Signal(float)  # the fraction of the timing done
    measured = Signal(object, object)  # the StepTiming, the model it timed (runtime.backend.engine.model)
    ended = Signal()  # after every timing, whatever its outcome

    def __init__(self, data_folder: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.data_folder = data_folder
        self._quiet = threading.Event()  # set while no reply streams
        self._quiet.set()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._next: Runtime | None = None  # to time once the running timing has stopped
        self.ended.connect(self._on_ended)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, runtime: Runtime) -> bool:
        """Time ``runtime``'s device when its cached timing is missing or stale (its plan then
        came from the prior or an old timing). False when there is nothing to time: the timing
        is fresh, or the backend is not a real engine. A timing already running for an earlier
        model is called off and this one starts when it has stopped."""
        if not isinstance(runtime.backend, EngineBackend):
            return False
        if self.running:
            self._cancel.set()
            self._next = runtime
            return True
        engine = runtime.backend.engine
        cancel = self._cancel = threading.Event()
        self._thread = refresh_in_background(
            engine, runtime.device.name, self.data_folder, runtime.settings.precision,
            on_done=lambda timing: _emit(self.measured, timing, engine.model),
            progress=lambda _stage, fraction: _emit(self.progress, fraction),
            pause=lambda: self._wait_quiet(cancel), cancel=cancel, on_end=lambda: _emit(self.ended))
        return self._thread is not None

    def replying(self, busy: bool) -> None:
        """While a reply streams the timing waits before its next run."""
        if busy:
            self._quiet.clear()
        else:
            self._quiet.set()

    def _wait_quiet(self, cancel: threading.Event) -> None:
        while not self._quiet.wait(QUIET_POLL_S) and not cancel.is_set():
            pass

    def _on_ended(self) -> None:
        self._thread = None
        waiting, self._next = self._next, None
        if waiting is not None:
            self.start(waiting)

    def shutdown(self, wait_s: float = 5.0) -> None:
        """Call the timing off and wait (at most ``wait_s``) for its current run to end."""
        self._next = None
        self._cancel.set()
        self._quiet.set()
        thread = self._thread
        if thread is not None:
            thread.join(wait_s)
