"""The window plans from the prior, times the device in the background once it is ready,
and re-plans with the timing (a tiny random-weight engine; no mocks)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from app.runtime import EngineBackend, Runtime
from app.settings import ChatSettings
from specmemo_core.planning.device import cpu_device
from specmemo_core.planning.entry import make_plan, plan_inputs
from specmemo_core.planning.timing import (
    StepTiming, cached_timing, engine_timing_key, store_timing, timing_without_waiting,
)
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.heads import random_heads
from specmemo_core.storage.sources import ModelIdentity
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

DEVICE = cpu_device()


@pytest.fixture
def engine() -> Engine:
    heads = random_heads(4, 64, 300, seed=2, scale=0.5, kind="hydra")
    return Engine(tiny_model(), tiny_tokenizer(), tiny_config(), ModelIdentity("tiny", "0" * 16), heads, None)


def tiny_loader(engine: Engine, loads: list[int] | None = None):
    """A loader as ``load_runtime`` is one: planned from the cached timing or the prior, never measuring."""

    def load(settings: ChatSettings, data_folder: Path, progress, cancel: threading.Event | None = None) -> Runtime:
        inputs = plan_inputs(engine, DEVICE, timing_without_waiting(engine, DEVICE.name, data_folder, None))
        plan = make_plan(inputs, settings.plan_choices())
        if loads is not None:
            loads.append(1)
        return Runtime(EngineBackend(engine.with_tree(plan.tree)), DEVICE, inputs, plan, settings)

    return load


def test_a_prior_plan_is_timed_in_the_background_and_replanned(qtbot, make_window, folder: Path,
                                                               engine: Engine) -> None:
    fractions: list[float] = []
    labels: list[str] = []
    window = make_window(loader=tiny_loader(engine), settings=ChatSettings(model="tiny"))
    window.timer.progress.connect(fractions.append)
    window.timer.progress.connect(lambda _f: labels.append(window.status.timing.text()))
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=60_000)
    assert window.runtime.inputs.timing.is_prior  # the window was ready before any timing
    qtbot.waitUntil(lambda: not window.runtime.inputs.timing.is_prior, timeout=120_000)
    measured = window.runtime.inputs.timing
    assert measured == cached_timing(folder, engine_timing_key(engine, DEVICE.name, None))
    assert window.runtime.plan == make_plan(window.runtime.inputs, window.runtime.settings.plan_choices())
    assert fractions and fractions[-1] == 1.0 and fractions == sorted(fractions)
    assert any(label.startswith("timing the device … ") and label.endswith("%") for label in labels)
    qtbot.waitUntil(lambda: not window.timer.running, timeout=10_000)
    assert window.status.timing.isHidden()


def test_a_fresh_cached_timing_is_not_measured_again(qtbot, make_window, folder: Path, engine: Engine) -> None:
    fresh = StepTiming(0.01, 0.05, 32, 0.001).measured(time.time())
    store_timing(folder, engine_timing_key(engine, DEVICE.name, None), fresh)
    loads: list[int] = []
    window = make_window(loader=tiny_loader(engine, loads), settings=ChatSettings(model="tiny"))
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=60_000)
    assert loads == [1] and window.runtime.inputs.timing == fresh
    assert not window.timer.running and window.status.timing.isHidden()


def test_a_timing_that_comes_during_a_reply_waits_for_its_end(qtbot, make_window, folder: Path,
                                                              engine: Engine) -> None:
    """The timing pauses while a reply streams; its re-plan is applied after the reply."""
    window = make_window(loader=tiny_loader(engine), settings=ChatSettings(model="tiny", max_reply_tokens=8))
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None, timeout=60_000)
    window.timer.replying(True)  # as while a reply streams: the timing waits before its next run
    window.generating = True
    time.sleep(1.0)
    assert window.runtime.inputs.timing.is_prior
    window.timer.replying(False)
    qtbot.waitUntil(lambda: window._timed is not None, timeout=120_000)  # in, and held while "generating"
    assert window.runtime.inputs.timing.is_prior
    window.generating = False
    window._after_reply()
    assert not window.runtime.inputs.timing.is_prior


def test_closing_the_window_calls_the_timing_off(qtbot, make_window, folder: Path, engine: Engine) -> None:
    window = make_window(loader=tiny_loader(engine), settings=ChatSettings(model="tiny"))
    window.timer.replying(True)  # held before its first run
    window.start()
    qtbot.waitUntil(lambda: window.runtime is not None and window.timer.running, timeout=60_000)
    thread = window.timer._thread
    window.close()
    assert thread is not None and not thread.is_alive()
    assert cached_timing(folder, engine_timing_key(engine, DEVICE.name, None)) is None

