""""Serve on localhost": the settings switch, and the window serving its loaded tiny engine
through the OpenAI API without loading it again and without blocking the GUI."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import openai
import pytest

from app.runtime import EngineBackend, Runtime
from app.serving import ServedBackend
from app.settings import ChatSettings
from app.settings_panel import SettingsDialog
from specmemo_core.planning.device import cpu_device
from specmemo_core.planning.entry import make_plan, plan_inputs
from specmemo_core.planning.timing import StepTiming, engine_timing_key, store_timing, timing_without_waiting
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.heads import random_heads
from specmemo_core.storage.sources import ModelIdentity
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer

from .scripted import fake_inputs

DEVICE = cpu_device()


def test_the_switch_is_off_by_default_and_shows_the_url_when_on(qtbot) -> None:
    assert ChatSettings().serve_on_localhost is False
    dialog = SettingsDialog(ChatSettings(), fake_inputs())
    qtbot.addWidget(dialog)
    assert not dialog.serve.isChecked() and dialog.serve_url.text() == "off"
    dialog.serve.setChecked(True)
    dialog.serve_port.setValue(8123)
    assert dialog.serve_url.text() == "http://127.0.0.1:8123/v1"
    chosen = dialog.settings()
    assert chosen.serve_on_localhost and chosen.serve_port == 8123


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engine() -> Engine:
    heads = random_heads(4, 64, 300, seed=2, scale=0.5)
    return Engine(tiny_model(), tiny_tokenizer(), tiny_config(), ModelIdentity("tiny", "0" * 16), heads, None)


def tiny_loader(engine: Engine, folder: Path):
    store_timing(folder, engine_timing_key(engine, DEVICE.name, None), StepTiming(0.01, 0.05, 32, 0.001).measured(
        time.time()))  # fresh: the window does not time the device

    def load(settings: ChatSettings, data_folder: Path, progress, cancel=None) -> Runtime:
        inputs = plan_inputs(engine, DEVICE, timing_without_waiting(engine, DEVICE.name, data_folder, None))
        plan = make_plan(inputs, settings.plan_choices())
        return Runtime(EngineBackend(engine.with_tree(plan.tree)), DEVICE, inputs, plan, settings)

    return load


def test_the_window_serves_its_loaded_engine_and_stops_when_switched_off(qtbot, make_window, folder: Path,
                                                                         engine: Engine) -> None:
    port = free_port()
    settings = ChatSettings(model="tiny", serve_on_localhost=True, serve_port=port, max_reply_tokens=6)
    window = make_window(loader=tiny_loader(engine, folder), settings=settings)
    window.start()
    url = f"http://127.0.0.1:{port}/v1"
    qtbot.waitUntil(lambda: window.status.serving.text() == f"serving {url}", timeout=60_000)
    served = window.serving._server.served
    assert served.scheduler.decoder.model is engine.model  # the window's weights, not a second copy
    assert served.tree == window.runtime.tree
    client = openai.OpenAI(base_url=url, api_key="any", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}])
    assert reply.usage.completion_tokens <= 6  # the app's reply length is the served default

    # the window's own chat now takes turns on the server's scheduler: one decoder, one KV cache
    qtbot.waitUntil(lambda: isinstance(window.chat.worker._backend, ServedBackend), timeout=10_000)
    submitted = next(served.scheduler._ids)
    window.input.setPlainText("Hello")
    window.send()
    qtbot.waitUntil(lambda: not window.generating, timeout=30_000)
    assert next(served.scheduler._ids) == submitted + 2  # the window's reply was one more request
    assert window.history[-1][1] == "assistant"
    assert window.history[-1][2] == reply.choices[0].message.content  # greedy: the same reply to "Hello"

    window.apply_settings(window.settings.with_(serve_on_localhost=False))
    qtbot.waitUntil(lambda: window.status.serving.isHidden(), timeout=30_000)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
