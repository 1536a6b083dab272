"""The status bar: device and free memory, CPU threads, the turns the plan holds, live speed, memory in use,
the background device timing while it runs, draft heads training.

(The model, precision, tree and context are on the header's chip.)"""

from __future__ import annotations

import torch
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QLabel, QStatusBar, QWidget

from specmemo_core.planning.device import DeviceInfo

from .memory_chart import gib
from .plan_text import turns_text
from .runtime import Runtime
from .worker import ReplyStats


def _separator() -> QFrame:
    line = QFrame()
    line.setFrameShape(QFrame.Shape.VLine)
    line.setFrameShadow(QFrame.Shadow.Sunken)
    return line


class ChatStatusBar(QStatusBar):
    """Permanent fields, each after a separator; a field with no text yet is hidden with its separator."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.device = QLabel("probing the device…")
        self.threads = QLabel("")
        self.plan = QLabel("no model loaded")
        self.speed = QLabel("")
        self.memory = QLabel("")
        self.timing = QLabel("")
        self.serving = QLabel("")
        self.training = QLabel("")
        self.serving.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)  # the URL can be copied
        self._separators: dict[QLabel, QFrame] = {}
        for i, label in enumerate((self.device, self.threads, self.plan, self.speed, self.memory, self.timing,
                                   self.serving, self.training)):
            if i:
                self._separators[label] = _separator()
                self.addPermanentWidget(self._separators[label])
            self.addPermanentWidget(label)
        self._set(self.threads, "")
        self._set(self.speed, "")
        self._set(self.memory, "")
        self._set(self.timing, "")
        self._set(self.serving, "")
        self._set(self.training, "")

    def _set(self, label: QLabel, text: str) -> None:
        label.setText(text)
        label.setVisible(bool(text))
        if label in self._separators:
            self._separators[label].setVisible(bool(text))

    def show_device(self, device: DeviceInfo) -> None:
        self._set(self.device, f"{device.name} · {gib(device.free_bytes)} free of {gib(device.total_bytes)}")
        self._set(self.threads, f"{torch.get_num_threads()} CPU threads")

    def show_runtime(self, runtime: Runtime) -> None:
        self.show_device(runtime.device)
        p = runtime.plan
        self._set(self.plan, turns_text(p, runtime.settings.turns, runtime.inputs.model.max_context))
        self.plan.setToolTip("\n".join(p.notes))

    def show_no_model(self) -> None:
        self._set(self.device, "no device in use")
        self._set(self.plan, "no model loaded")
        self._set(self.speed, "")
        self._set(self.memory, "")

    def show_speed(self, stats: ReplyStats) -> None:
        accepted = f" · {stats.mean_accepted:.2f} tokens/step" if stats.steps else ""
        self._set(self.speed, f"{stats.tokens_per_s:.1f} tokens/s{accepted}")

    def show_memory(self, in_use: int) -> None:
        self._set(self.memory, f"{gib(in_use)} in use")

    def show_timing(self, fraction: float | None) -> None:
        """The background device timing's progress; None: not running."""
        self._set(self.timing, "" if fraction is None else f"timing the device … {round(100 * fraction)}%")

    def show_serving(self, url: str) -> None:
        """The local server's URL while it serves ("" : not serving)."""
        self._set(self.serving, f"serving {url}" if url else "")
        self.serving.setToolTip("OpenAI API on this computer: base_url=" + url if url else "")

    def show_training(self, text: str) -> None:
        """Draft heads training in the background ("busy: …" while the chat waits for it; "": none)."""
        self._set(self.training, text)
