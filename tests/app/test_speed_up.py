"""Model ▸ Speed up this model…: the trainer thread and the dialog on a real tiny job (the core's own
speed-up functions, a tiny random-weight model), the busy rule, and the window around them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.heads_training import HeadsTrainer, SpeedUpEstimate, chat_stays_usable, job_for_runtime, with_prompts
from app.main_window import BUSY_TRAINING, SPEED_UP
from app.runtime import load_runtime
from app.settings import ChatSettings
from app.speed_up_dialog import TIMING, SpeedUpDialog, memory_text
from specmemo_core.planning.device import cpu_device
from specmemo_core.storage.trained_heads import finished
from specmemo_core.tools.train.speed_up import base_model_for, speed_up_job
from specmemo_core.tools.train.trainer import TrainConfig
from tests.tiny import save_tiny_model_folder

from .test_main_window import wait_reply

GIB = 2**30


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    return save_tiny_model_folder(tmp_path / "tiny-model", layers=2)


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"turns": [f"Hello number {i}, how are you?"]}) for i in range(8)))
    return path


@pytest.fixture
def tiny_job(model_folder: Path, prompts: Path, folder: Path):
    """The app's default job for the tiny model, shrunk to seconds (6 replies of 16 tokens, 20 steps)."""
    _, name, fingerprint = base_model_for(str(model_folder), "cpu")
    job = speed_up_job(str(model_folder), name=name, fingerprint=fingerprint, device="cpu", data_folder=folder)
    return replace(job, config=replace(job.config, train_prompts=6, heldout_prompts=3, max_new_tokens=16, gen_batch=4,
                                       prompts_file=str(prompts), heldout_file=str(prompts),
                                       train=TrainConfig(steps=20, batch_size=64, checkpoint_every=5)))


@pytest.fixture
def trainer():
    made = HeadsTrainer()
    yield made
    made.shutdown()


def make_dialog(qtbot, job, trainer, free_bytes=lambda: 64 * GIB) -> SpeedUpDialog:
    dialog = SpeedUpDialog(job, trainer, model_name="tiny-model", free_bytes=free_bytes)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def stop_once_at(trainer: HeadsTrainer, stage: str, fraction: float) -> list[tuple[str, float]]:
    """Cancel from the training thread itself when ``stage`` reaches ``fraction`` (as a user's Cancel
    would, but at a known point of a run that lasts a fraction of a second); returns the reports."""
    seen: list[tuple[str, float]] = []
    done = []

    def report(name: str, f: float) -> None:
        seen.append((name, f))
        if name == stage and f >= fraction and not done:
            done.append(f)
            trainer.cancel()

    trainer.worker.progress.connect(report, Qt.ConnectionType.DirectConnection)
    return seen


def test_the_busy_rule():
    assert chat_stays_usable(2 * GIB, 3 * GIB)
    assert chat_stays_usable(3 * GIB, 3 * GIB)
    assert not chat_stays_usable(3 * GIB + 1, 3 * GIB)


def test_trainer_estimates_then_trains_with_growing_progress(qtbot, tiny_job, trainer):
    with qtbot.waitSignal(trainer.estimated, timeout=60000) as got:
        trainer.estimate(tiny_job)
    result = got.args[0]
    assert isinstance(result, SpeedUpEstimate) and result.job == tiny_job
    assert result.estimate.total_s > 0 and set(result.estimate.stages) == {"replies", "hidden states", "training",
                                                                           "calibration"}
    weights = sum(p.numel() * 4 for p in base_model_for(tiny_job.config.model, "cpu")[0].parameters())
    assert result.weights_bytes == weights  # fp32 on the CPU
    assert result.memory_bytes == result.estimate.features_bytes + weights
    assert not trainer.busy
    reports = []
    trainer.progress.connect(lambda stage, fraction: reports.append((stage, fraction)))
    with qtbot.waitSignal(trainer.finished, timeout=60000) as done:
        trainer.train(tiny_job)
    card = done.args[0]
    assert card["kind"] == "hydra" and card["model_fingerprint"] in tiny_job.out.name
    assert finished(tiny_job.out) and not tiny_job.started
    training = [f for stage, f in reports if stage == "training heads"]
    assert len(training) >= 10 and training == sorted(training) and training[-1] == 1.0


def test_dialog_times_then_trains_and_offers_reload(qtbot, tiny_job, trainer):
    dialog = make_dialog(qtbot, tiny_job, trainer)
    assert dialog.state == "timing" and dialog.message.text() == TIMING and dialog.bar.isVisible()
    assert not dialog.start_button.isEnabled() and "tiny-model" in dialog.heading.text()
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    assert dialog.message.text().startswith("Training takes about ") and "calibration" in dialog.message.text()
    assert "Resume" not in dialog.message.text() and dialog.start_button.text() == "Start"
    assert "free now" in dialog.memory.text() and "keeps answering" in dialog.memory.text()
    assert "prompts.jsonl" in dialog.prompts.text()
    values = []
    dialog.bar.valueChanged.connect(values.append)
    started = []
    dialog.training_started.connect(started.append)
    qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    assert started == [True] and dialog.state == "training" and dialog.cancel_button.text() == "Cancel"
    qtbot.waitUntil(lambda: dialog.state == "done", timeout=60000)
    assert str(tiny_job.out) in dialog.message.text() and dialog.reload_button.isVisible()
    assert not dialog.start_button.isVisible() and finished(tiny_job.out)
    assert max(values) == 100 and len(set(values)) > 3
    with qtbot.waitSignal(dialog.reload_requested, timeout=1000):
        qtbot.mouseClick(dialog.reload_button, Qt.MouseButton.LeftButton)


def test_cancel_keeps_the_work_and_resume_finishes(qtbot, tiny_job, trainer):
    dialog = make_dialog(qtbot, tiny_job, trainer)
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    reports = stop_once_at(trainer, "training heads", 0.5)
    ended = []
    dialog.training_ended.connect(ended.append)
    dialog.start()
    qtbot.waitUntil(lambda: dialog.state == "stopped", timeout=60000)
    assert dialog.message.text().startswith("Stopped. What was done is kept") and "failed" not in ended[0]
    assert dialog.message.styleSheet() == ""  # a note, not an error
    assert tiny_job.started and not finished(tiny_job.out) and (tiny_job.out / "distill.safetensors").exists()
    assert dialog.start_button.text() == "Resume" and dialog.start_button.isEnabled()
    stopped_at = max(f for stage, f in reports if stage == "training heads")
    assert stopped_at < 1.0
    reports.clear()
    qtbot.mouseClick(dialog.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.state == "done", timeout=60000)
    assert finished(tiny_job.out) and len(ended) == 2
    training = [f for stage, f in reports if stage == "training heads"]
    assert training[0] > 0.05 and training[-1] == 1.0  # from the checkpoint, not from step 1
    before_training = [stage for stage, _ in reports[:reports.index(("training heads", training[0]))]]
    assert not any(stage.startswith("generating replies") for stage in before_training)  # the replies are kept


def test_a_bad_prompt_file_is_shown_with_the_cores_message(qtbot, tiny_job, trainer, tmp_path):
    dialog = make_dialog(qtbot, tiny_job, trainer)
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no turns here"}) + "\n")
    dialog.use_prompts(bad)
    qtbot.waitUntil(lambda: dialog.state == "failed", timeout=60000)
    assert dialog.message.text().startswith("Timing this device failed: ") and '"turns"' in dialog.message.text()
    assert not dialog.start_button.isEnabled() and dialog.prompts_button.isEnabled()
    assert with_prompts(tiny_job, None).config.prompts_file != tiny_job.config.prompts_file


def test_memory_text_says_when_the_chat_waits(qtbot, tiny_job, trainer):
    dialog = make_dialog(qtbot, tiny_job, trainer)
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    assert "keeps answering" in memory_text(dialog.result, dialog.result.memory_bytes)
    assert "Send waits" in memory_text(dialog.result, dialog.result.memory_bytes - 1)


def test_window_trains_heads_for_its_model_and_reloads_with_them(qtbot, make_window, folder, model_folder, tiny_job):
    def loader(settings, _folder, progress, cancel):
        return load_runtime(settings, folder, progress, cancel, cpu_device())

    window = make_window(loader=loader, settings=ChatSettings(model=str(model_folder), max_reply_tokens=8))
    assert not window.actions[SPEED_UP].isEnabled()  # no model yet
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=60000)
    assert window.actions[SPEED_UP].isEnabled() and window.runtime.backend.engine.heads is None
    default = job_for_runtime(window.runtime, folder)
    assert (default.config.model, default.device, default.out) == (str(model_folder), "cpu", tiny_job.out)
    dialog = window.open_speed_up(tiny_job, model_name="tiny-model", free_bytes=lambda: 0)
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    assert "Send waits" in dialog.memory.text()
    dialog.start()
    assert window.training_heads == "blocking" and "busy: training heads" in window.status.training.text()
    window.input.setPlainText("hello")
    window.send()
    assert window.hint.text() == BUSY_TRAINING and not window.generating and window.input.toPlainText() == "hello"
    qtbot.waitUntil(lambda: dialog.state == "done", timeout=60000)
    assert window.training_heads is None and not window.status.training.isVisible()
    window.send()  # the chat answers again
    wait_reply(qtbot, window)
    assert window.history[-1][1] == "assistant"
    old = window.runtime
    qtbot.mouseClick(dialog.reload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.runtime is not old and not window.models.busy, timeout=60000)
    assert window.runtime.backend.engine.heads_folder == tiny_job.out


def test_the_action_explains_for_a_model_it_cannot_train(qtbot, make_window):
    from .scripted import fake_runtime
    from .test_main_window import Answers

    window = make_window(fake_runtime())
    window.dialogs = Answers()
    window.actions[SPEED_UP].trigger()
    assert window.dialogs.told and "loaded itself" in window.dialogs.told[0][1]


def test_the_quick_job_trains_less_and_is_timed_again(qtbot, tiny_job, trainer):
    from app.heads_training import QUICK_PROMPTS, QUICK_STEPS

    dialog = make_dialog(qtbot, tiny_job, trainer)
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    full = dialog.result.estimate
    dialog.size.setCurrentIndex(1)
    assert dialog.state == "timing"
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    cfg = dialog.job.config
    assert (cfg.train_prompts, cfg.train.steps) == (QUICK_PROMPTS, QUICK_STEPS)
    quick = dialog.result.estimate
    assert quick.stages["training"] == pytest.approx(QUICK_STEPS * quick.step_times["train_step_s"])
    assert full.stages["training"] == pytest.approx(tiny_job.config.train.steps * full.step_times["train_step_s"])
    dialog.size.setCurrentIndex(0)  # back to the full job, prompt file kept
    qtbot.waitUntil(lambda: dialog.state == "ready", timeout=60000)
    assert dialog.job.config == tiny_job.config
