"""Training draft heads for the loaded model off the GUI thread: the app's "Speed up this model".

The core does the work (``specmemo_core.tools.train.speed_up``, the same job as ``specmemo
speed-up``); this module runs it in its own thread and hands the outcome back as signals:
``estimated`` (a ``SpeedUpEstimate``), ``progress(stage, fraction)``, ``finished`` (the heads'
card) and ``failed`` (the exception itself: ``TrainingCancelled`` when the user stopped it,
the core's SpecMemoError subclasses, or whatever a broken file made torch raise). The
trainer, the estimator and the base-model loader are constructor arguments, so tests pass
tiny real jobs through the real thread.

``chat_stays_usable`` is the window's rule: the chat answers while heads train only if the
training's memory fits in the RAM that is free besides.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import psutil
from PySide6.QtCore import QObject, QThread, Signal, Slot

from specmemo_core.errors import SpecMemoError
from specmemo_core.storage.datasets import load_prompt_file
from specmemo_core.tools.train.speed_up import (
    SHIPPED_PROMPTS, SpeedUpJob, TrainingCancelled, TrainingEstimate, TrainingMemory, base_model_for,
    estimate_training, preflight, speed_up_job, train_speed_up_heads,
)

from .runtime import EngineBackend, Runtime

Trainer = Callable[..., dict]  # train_speed_up_heads's signature
Estimator = Callable[..., TrainingEstimate]  # estimate_training's signature
BaseModel = Callable[..., tuple[Any, str, str]]  # base_model_for's signature
Preflight = Callable[..., TrainingMemory]  # preflight's signature: raises TrainingDoesNotFitError


@dataclass(frozen=True)
class SpeedUpEstimate:
    """What the dialog shows before training: the job, its timed estimate, and its memory as
    ``preflight`` counted it from the model's header."""

    job: SpeedUpJob
    estimate: TrainingEstimate
    memory: TrainingMemory

    @property
    def weights_bytes(self) -> int:
        """The base model's weights as the trainer holds them (fp32 on a CPU, bf16 on a GPU)."""
        return self.memory.weights_bytes

    @property
    def memory_bytes(self) -> int:
        """Host memory the training needs, roughly: its hidden states plus the model's weights."""
        return self.estimate.features_bytes + self.weights_bytes


def chat_stays_usable(training_bytes: int, free_bytes: int) -> bool:
    """Whether the chat may keep answering while heads train: the training's memory fits in
    what is free now (the chat's own model is already counted as used)."""
    return training_bytes <= free_bytes


def free_memory() -> int:
    """RAM available now (not merely unused), as the planner counts it."""
    return int(psutil.virtual_memory().available)


def job_for_runtime(runtime: Runtime, data_folder: Path) -> SpeedUpJob:
    """The default job for the loaded model: its source (``settings.model``) on its device kind
    ("cuda" trains on the GPU, anything else on the CPU), stored under ``data_folder``."""
    if not isinstance(runtime.backend, EngineBackend):
        raise SpecMemoError("heads can be trained only for a model the app loaded itself; load a model "
                            "from the Model menu first")
    identity = runtime.backend.engine.identity
    device = "cuda" if runtime.device.kind == "cuda" else "cpu"
    return speed_up_job(runtime.settings.model, name=identity.name, fingerprint=identity.fingerprint,
                        device=device, data_folder=data_folder)


QUICK_PROMPTS, QUICK_STEPS = 1000, 1000  # the quick job: an eighth of the replies, a quarter of the steps


def with_size(job: SpeedUpJob, *, quick: bool, full: SpeedUpJob) -> SpeedUpJob:
    """The same job, quick (``QUICK_PROMPTS`` replies, ``QUICK_STEPS`` steps: far shorter on a
    CPU, heads that accept less) or as long as ``full`` (the default job) says."""
    prompts, steps = ((QUICK_PROMPTS, QUICK_STEPS) if quick
                      else (full.config.train_prompts, full.config.train.steps))
    return replace(job, config=replace(job.config, train_prompts=prompts,
                                       train=replace(job.config.train, steps=steps)))


def with_prompts(job: SpeedUpJob, prompts_file: str | Path | None) -> SpeedUpJob:
    """The same job on the user's prompt file (None: the shipped prompts)."""
    return replace(job, config=replace(job.config, prompts_file=str(prompts_file or SHIPPED_PROMPTS)))


def replies_of(job: SpeedUpJob) -> int | None:
    """How many replies the job generates from a user's prompt file (each conversation answers up to
    ``turns`` turns, at most ``train_prompts`` conversations); None for the shipped file (all of
    ``train_prompts``). Raises the core's SpecMemoError for a file that is not MT-Bench style JSONL."""
    cfg = job.config
    if Path(cfg.prompts_file) == SHIPPED_PROMPTS:
        return None
    conversations = load_prompt_file(cfg.prompts_file)[:cfg.train_prompts]
    return sum(min(len(turns), cfg.turns) for turns in conversations)


class _TrainWorker(QObject):
    estimated = Signal(object)  # SpeedUpEstimate
    progress = Signal(str, float)
    logged = Signal(str)
    finished = Signal(object)  # the card
    failed = Signal(object)  # the exception

    def __init__(self, trainer: Trainer, estimator: Estimator, base_model: BaseModel,
                 preflight: Preflight = preflight) -> None:
        super().__init__()
        self.cancel = threading.Event()
        self.trainer, self.estimator, self.base_model = trainer, estimator, base_model
        self.preflight = preflight

    def _checked(self, stage: str, fraction: float) -> None:
        if self.cancel.is_set():
            raise TrainingCancelled()
        self.progress.emit(stage, fraction)

    @Slot(object)
    def estimate(self, job: SpeedUpJob) -> None:
        try:
            replies = replies_of(job)
            memory = self.preflight(job, replies)  # from the file's header: refuses before the weights are read
            hf, _, _ = self.base_model(job.config.model, job.device, self._checked)
            estimate = self.estimator(job, hf, prompts=replies, progress=self._checked)
            del hf  # training loads its own copy: two would double the memory
        except Exception as exc:  # noqa: BLE001 - typed by the core, or torch/transformers on an odd file
            self.failed.emit(exc)
            return
        self.estimated.emit(SpeedUpEstimate(job, estimate, memory))

    @Slot(object)
    def train(self, job: SpeedUpJob) -> None:
        try:
            card = self.trainer(job, progress=self.progress.emit, cancel=self.cancel, log=self.logged.emit)
        except Exception as exc:  # noqa: BLE001 - TrainingCancelled, the core's errors, or torch's
            self.failed.emit(exc)
            return
        self.finished.emit(card)


class HeadsTrainer(QObject):
    """Owns the training thread. ``estimate(job)`` and ``train(job)`` return at once; results come
    as signals. ``busy`` is true from a call until its outcome; ``cancel()`` stops at the next
    progress report (training keeps what is done and resumes next time)."""

    estimated = Signal(object)
    progress = Signal(str, float)
    logged = Signal(str)
    finished = Signal(object)
    failed = Signal(object)
    _estimate = Signal(object)
    _train = Signal(object)

    def __init__(self, *, trainer: Trainer = train_speed_up_heads, estimator: Estimator = estimate_training,
                 base_model: BaseModel = base_model_for, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.busy = False
        self.thread = QThread()
        self.thread.setObjectName("specmemo-heads-trainer")
        self.worker = _TrainWorker(trainer, estimator, base_model)
        self.worker.moveToThread(self.thread)
        self._estimate.connect(self.worker.estimate)
        self._train.connect(self.worker.train)
        self.worker.progress.connect(self.progress)
        self.worker.logged.connect(self.logged)
        self.worker.estimated.connect(self._on_estimated)  # bound methods: queued to this (the GUI) thread
        self.worker.finished.connect(self._on_finished)
        self.worker.failed.connect(self._on_failed)
        self.thread.start()

    def estimate(self, job: SpeedUpJob) -> None:
        self._start(self._estimate, job)

    def train(self, job: SpeedUpJob) -> None:
        self._start(self._train, job)

    def _start(self, signal: Any, job: SpeedUpJob) -> None:
        if self.busy:
            raise SpecMemoError("heads are being trained or timed already; wait for that, or cancel it")
        self.busy = True
        self.worker.cancel.clear()  # here, not in the thread: a cancel right after the call still counts
        signal.emit(job)

    def cancel(self) -> None:
        self.worker.cancel.set()

    def _on_estimated(self, result: SpeedUpEstimate) -> None:
        self.busy = False
        self.estimated.emit(result)

    def _on_finished(self, card: dict) -> None:
        self.busy = False
        self.finished.emit(card)

    def _on_failed(self, exc: Exception) -> None:
        self.busy = False
        self.failed.emit(exc)

    def shutdown(self) -> None:
        """Stop what runs (at its next progress report: training resumes next time) and end the thread."""
        self.cancel()
        self.thread.quit()
        self.thread.wait()
