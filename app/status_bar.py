"""The status bar: device and free memory, the plan in force, live speed, memory in use."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QStatusBar, QWidget

from specmemo_core.planning.device import DeviceInfo

from .memory_chart import gib
from .runtime import Runtime
from .worker import ReplyStats


class ChatStatusBar(QStatusBar):
    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.device = QLabel("probing the device…")
        self.plan = QLabel("no model loaded")
        self.speed = QLabel("")
        self.memory = QLabel("")
        for label in (self.device, self.plan, self.speed, self.memory):
            self.addPermanentWidget(label)

    def show_device(self, device: DeviceInfo) -> None:
        self.device.setText(f"{device.name} · {gib(device.free_bytes)} free of {gib(device.total_bytes)}")

    def show_runtime(self, runtime: Runtime) -> None:
        self.show_device(runtime.device)
        p = runtime.plan
        mode = f"tree {runtime.tree}" if runtime.speculative else "plain"
        self.plan.setText(f"{runtime.backend.name} · {p.precision} · {mode} · {runtime.capacity} tokens "
                          f"({p.turns} turns)")

    def show_speed(self, stats: ReplyStats) -> None:
        accepted = f" · {stats.mean_accepted:.2f} tokens/step" if stats.steps else ""
        self.speed.setText(f"{stats.tokens_per_s:.1f} tokens/s{accepted}")

    def show_memory(self, in_use: int) -> None:
        self.memory.setText(f"{gib(in_use)} in use")
