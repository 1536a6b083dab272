"""Model ▸ Speed up this model…: time the training on this device, train draft heads, reload.

The dialog drives a ``HeadsTrainer`` (heads_training.py) and shows its outcome: first the
device is timed ("Timing this device…"), then the estimate, whether an earlier run resumes,
and the memory the training needs against the RAM free now. Start (or Resume) trains with a
progress bar per stage; Cancel stops it (what is done is kept: Resume continues there, also
next time); when it is done the dialog says where the heads are and offers Reload now.
It is modeless: the chat stays in reach while heads train. Closing it while training only
hides it (the status bar keeps the progress; the menu command shows it again).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QComboBox, QDialog, QFileDialog, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout, QWidget,
)

from specmemo_core.tools.train.speed_up import SHIPPED_PROMPTS, SpeedUpJob, TrainingCancelled

from .dialogs import describe
from .heads_training import (QUICK_PROMPTS, QUICK_STEPS, HeadsTrainer, SpeedUpEstimate, chat_stays_usable,
                             free_memory, with_prompts, with_size)
from .memory_chart import gib

TIMING = "Timing this device…"
SIZES = ("Full: like the shipped heads", f"Quick: {QUICK_PROMPTS:,} replies, {QUICK_STEPS:,} steps (heads accept less)")


def device_text(device: str) -> str:
    return "the GPU" if device.startswith("cuda") else "the CPU"


def memory_text(result: SpeedUpEstimate, free_bytes: int) -> str:
    """The training's memory against the free RAM, and what that means for the chat meanwhile."""
    usable = chat_stays_usable(result.memory_bytes, free_bytes)
    then = ("the chat keeps answering while the heads train." if usable else
            "the chat pauses while the heads train: Send waits until training ends or is cancelled.")
    return (f"Training needs about {gib(result.memory_bytes)} of memory (hidden states "
            f"{gib(result.estimate.features_bytes)}, model weights {gib(result.weights_bytes)}); "
            f"{gib(free_bytes)} is free now, so {then}")


class SpeedUpDialog(QDialog):
    """``state``: "timing", "ready", "training", "stopped", "done" or "failed"."""

    training_started = Signal(bool)  # whether the chat stays usable meanwhile
    training_ended = Signal(str)  # what became of it, for the window's hint
    reload_requested = Signal()

    def __init__(self, job: SpeedUpJob, trainer: HeadsTrainer, *, model_name: str,
                 free_bytes: Callable[[], int] = free_memory, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Speed up this model")
        self.setModal(False)
        self.job, self.trainer, self.model_name, self.free_bytes = job, trainer, model_name, free_bytes
        self.full_job = job  # what "Full" goes back to
        self.result: SpeedUpEstimate | None = None
        self.state = ""
        self._build()
        trainer.estimated.connect(self._on_estimated)
        trainer.progress.connect(self._on_progress)
        trainer.finished.connect(self._on_finished)
        trainer.failed.connect(self._on_failed)
        self.estimate()

    def _build(self) -> None:
        self.heading = QLabel()
        self.heading.setWordWrap(True)
        about = QLabel("Draft heads let the model propose several tokens per step, so replies come faster. "
                       "They are trained once on this computer, on the model's own replies, and used from "
                       "then on.")
        about.setWordWrap(True)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.memory = QLabel()
        self.memory.setWordWrap(True)
        self.stage = QLabel()
        self.bar = QProgressBar()
        self.bar.setRange(0, 100)
        self.prompts = QLabel()
        self.prompts.setWordWrap(True)
        self.prompts_button = QPushButton("Use my own prompts…")
        self.prompts_button.setToolTip('A JSONL file, one conversation a line: {"turns": ["a question", ...]}')
        self.prompts_button.clicked.connect(self.choose_prompts)
        self.size = QComboBox()
        self.size.addItems(SIZES)
        self.size.setToolTip("Quick trains on fewer replies and steps: much shorter on a CPU, "
                             "heads that guess less often")
        self.size.currentIndexChanged.connect(lambda index: self.use_size(quick=index == 1))
        size_row = QHBoxLayout()
        size_row.addWidget(QLabel("Length:"))
        size_row.addWidget(self.size, 1)
        prompts_row = QHBoxLayout()
        prompts_row.addWidget(self.prompts, 1)
        prompts_row.addWidget(self.prompts_button)
        self.reload_button = QPushButton("Reload now")
        self.reload_button.clicked.connect(self._reload)
        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("primary")
        self.start_button.clicked.connect(self.start)
        self.cancel_button = QPushButton("Close")
        self.cancel_button.clicked.connect(self.cancel_or_close)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for button in (self.reload_button, self.start_button, self.cancel_button):
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        for widget in (self.heading, about, self.message, self.memory, self.stage, self.bar):
            layout.addWidget(widget)
        layout.addLayout(size_row)
        layout.addLayout(prompts_row)
        layout.addLayout(buttons)
        self.setMinimumWidth(600)

    # -- states ----------------------------------------------------------------
    def _show(self, state: str, message: str, *, tone: str = "") -> None:
        self.state = state
        self.message.setText(message)
        self.message.setStyleSheet("font-weight: 600" if tone == "warning" else "")
        busy = state in ("timing", "training")
        self.bar.setVisible(busy)
        self.stage.setVisible(busy)
        self.prompts_button.setEnabled(not busy and state != "done")
        self.size.setEnabled(not busy and state != "done")
        self.start_button.setVisible(state != "done")
        self.start_button.setEnabled(state in ("ready", "stopped") or (state == "failed" and self.result is not None))
        self.start_button.setText("Resume" if self.job.started else "Start")
        self.reload_button.setVisible(state == "done")
        self.cancel_button.setText("Cancel" if busy else "Close")
        prompts = self.job.config.prompts_file
        self.prompts.setText("Prompts: the shipped ShareGPT conversations" if Path(prompts) == SHIPPED_PROMPTS
                             else f"Prompts: {Path(prompts).name}")
        where = self.result.estimate.device_name if self.result else device_text(self.job.device)
        self.heading.setText(f"Train draft heads for <b>{html.escape(self.model_name)}</b> on {html.escape(where)}.")

    def estimate(self) -> None:
        """Time the job on this device (the trainer's thread); the estimate follows as a signal."""
        self.result = None
        self.memory.setText("")
        self.stage.setText(TIMING)
        self.bar.setValue(0)
        self._show("timing", TIMING)
        self.trainer.estimate(self.job)

    def _on_estimated(self, result: SpeedUpEstimate) -> None:
        if self.state != "timing":
            return
        self.result = result
        resumes = (" An earlier run stopped half-way: Resume continues where it stopped."
                   if self.job.started else "")
        self._show("ready", f"Training takes {result.estimate.describe()}.{resumes}")
        self.memory.setText(memory_text(result, self.free_bytes()))

    def start(self) -> None:
        """Train (or resume) the job; the chat stays usable if its memory fits beside the training."""
        if self.result is None or self.trainer.busy:
            return
        usable = chat_stays_usable(self.result.memory_bytes, self.free_bytes())
        self.stage.setText("starting")
        self.bar.setValue(0)
        self._show("training", "Training the heads… You can close this window: training goes on, and the "
                               "status bar shows how far it is.")
        self.training_started.emit(usable)
        self.trainer.train(self.job)

    def _on_progress(self, stage: str, fraction: float) -> None:
        if self.state not in ("timing", "training"):
            return
        percent = round(100 * min(max(fraction, 0.0), 1.0))
        self.bar.setValue(percent)
        self.stage.setText(f"{stage} · {percent}%" if self.state == "training" else f"{TIMING} {stage}")

    def _on_finished(self, card: dict) -> None:
        if self.state != "training":
            return
        self._show("done", f"The heads are trained and stored in {self.job.out}. Reload the model to use them: "
                           "the planner then picks its tree from their calibration.")
        self.training_ended.emit(f"Draft heads for {self.model_name} are ready; reload the model to use them.")
        self.reload_button.setDefault(True)
        self.show()  # it may have been hidden while training

    def _on_failed(self, exc: Exception) -> None:
        training = self.state == "training"
        if self.state not in ("timing", "training"):
            return
        if isinstance(exc, TrainingCancelled):
            text = ("Stopped. What was done is kept: Resume continues where it stopped, now or next time."
                    if training else "Timing was stopped.")
            self._show("stopped" if self.result is not None else "failed", text)
        else:
            verb = "Training the heads" if training else "Timing this device"
            self._show("failed", f"{verb} failed: {describe(exc)}", tone="warning")
        if training:
            self.training_ended.emit(self.message.text())

    # -- buttons ---------------------------------------------------------------
    def choose_prompts(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Prompts to train on", "",
                                              "JSONL (*.jsonl *.jsonl.gz);;All files (*)")
        if path:
            self.use_prompts(path)

    def use_prompts(self, path: str | Path | None) -> None:
        """Train on ``path`` (MT-Bench style JSONL; None: the shipped prompts), timed again."""
        if self.trainer.busy:
            return
        self.job = with_prompts(self.job, path)
        self.estimate()

    def use_size(self, *, quick: bool) -> None:
        """Train the quick or the full job (the prompt file stays), timed again."""
        if self.trainer.busy:
            return
        self.job = with_size(self.job, quick=quick, full=self.full_job)
        self.estimate()

    def cancel_or_close(self) -> None:
        if self.state in ("timing", "training"):
            self.trainer.cancel()
            self.message.setText("Stopping at the next step…")
        else:
            self.close()

    def _reload(self) -> None:
        self.reload_requested.emit()
        self.close()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        if self.state == "training":
            self.hide()  # training goes on; the menu command shows this window again
            event.ignore()
            return
        if self.state == "timing":
            self.trainer.cancel()
        super().closeEvent(event)
