"""Issue 16 item 1: the app, ``specmemo plan``, ``specmemo generate`` and ``specmemo bench``'s
plan method make the same plan for the same inputs (the core's one plan entry, ``planning.entry``),
and with no flags they speculate."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from specmemo_core.planning.device import cpu_device
from specmemo_core.storage.data_folder import data_dir

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_data_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder of its own (its own device timing) holding the default model, fetched once per machine."""
    from specmemo_core.storage.sources import ensure_default_model

    shared = os.environ.get("SPECMEMO_TEST_DATA_DIR") or os.path.join(tempfile.gettempdir(), "specmemo-test-data")
    monkeypatch.setenv("SPECMEMO_DATA_DIR", shared)
    model = ensure_default_model()
    folder = tmp_path / "data"
    (folder / "models").mkdir(parents=True)
    for path in (model, model.with_name(model.name + ".verified")):
        shutil.copy2(path, folder / "models" / path.name)
    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(folder))
    return folder


def _cli(folder: Path, *args: str) -> dict:
    env = {**os.environ, "SPECMEMO_DATA_DIR": str(folder)}
    done = subprocess.run([sys.executable, "-m", "specmemo_core.cli", *args, "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the device timing is per thread count: the same inputs here as in the CLI runs
    yield
    torch.set_num_threads(before)


def test_every_entry_point_plans_the_same_tree(own_data_folder: Path, one_thread: None) -> None:
    from app.runtime import load_runtime
    from app.settings import ChatSettings
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.tools.bench import planner_choice

    # `plan` times the device (once) and caches it: every entry point then plans with that timing
    planned = _cli(own_data_folder, "plan", "--precision", "fp32", "--threads", "1")
    generated = _cli(own_data_folder, "generate", "--prompt", "Explain photosynthesis in two sentences.",
                     "--max-new-tokens", "8", "--dtype", "fp32", "--device", "cpu", "--threads", "1")
    runtime = load_runtime(ChatSettings(precision="fp32"), own_data_folder, lambda stage, fraction: None,
                           device=cpu_device())
    engine = Engine.load("default", precision="fp32")
    bench = planner_choice(engine, "fp32", 256, data_folder=data_dir())

    trees = {"plan": planned["tree"], "generate": generated["tree"], "app": runtime.plan.tree, "bench": bench.tree}
    assert len(set(trees.values())) == 1, trees
    assert trees["app"] is not None and generated["steps"] >= 1  # with no flags every entry point speculates
    assert planned["kv_tokens"] == runtime.plan.kv_tokens == bench.kv_tokens
