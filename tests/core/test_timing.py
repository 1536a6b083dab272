"""The device timing: short, reporting its fraction, cached with its date and torch
version, re-measured in a background thread when missing or stale, a prior meanwhile."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from specmemo_core.planning import timing
from specmemo_core.planning.entry import PlanChoices, make_plan, plan_inputs
from specmemo_core.planning.device import cpu_device
from specmemo_core.planning.plan_check import TimingHooks, time_forward
from specmemo_core.planning.timing import (
    MAX_AGE_DAYS, StepTiming, cached_timing, engine_timing_key, prior_timing, refresh_in_background, store_timing,
    timing_for, timing_without_waiting,
)
from specmemo_core.runtime.engine import Engine
from specmemo_core.runtime.heads import random_heads
from specmemo_core.storage.sources import ModelIdentity
from tests.tiny import tiny_config, tiny_model, tiny_tokenizer


@pytest.fixture
def engine() -> Engine:
    torch.set_num_threads(1)
    heads = random_heads(4, 64, 300, seed=2, scale=0.5, kind="hydra")
    return Engine(tiny_model(), tiny_tokenizer(), tiny_config(), ModelIdentity("tiny", "0" * 16), heads, None)


def test_time_forward_reports_a_rising_fraction_and_pauses_before_each_run(engine: Engine) -> None:
    fractions: list[float] = []
    pauses: list[int] = []
    step = time_forward(engine.model, engine.heads, big=8, context=16, repeats=2,
                        hooks=TimingHooks(lambda stage, f: fractions.append(f), lambda: pauses.append(1)))
    assert step(1, 0) > 0 and step(8, 0) >= step(1, 0) and step(1, 1) >= step(1, 0)
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and 0 < fractions[0] < 0.5
    assert len(pauses) >= len(fractions)  # one before every timed run


def test_timing_is_dated_and_goes_stale() -> None:
    fresh = StepTiming(0.1, 0.5, 32, 0.01).measured(time.time())
    assert not fresh.is_prior and not fresh.is_stale()
    assert fresh.is_stale(now=fresh.measured_at + (MAX_AGE_DAYS + 1) * 86400)
    other_torch = StepTiming(0.1, 0.5, 32, 0.01, fresh.measured_at, "1.0.0")
    assert other_torch.is_stale()
    assert StepTiming(0.1, 0.5, 32, 0.01).is_prior and StepTiming(0.1, 0.5, 32, 0.01).is_stale()


def test_cache_round_trip_and_old_entries_are_stale(tmp_path: Path) -> None:
    fresh = StepTiming(0.1, 0.5, 32, 0.01).measured(time.time())
    store_timing(tmp_path, "k", fresh)
    assert cached_timing(tmp_path, "k") == fresh
    store_timing(tmp_path, "old", StepTiming(0.3, 1.9, 32, 0.03).measured(time.time() - (MAX_AGE_DAYS + 1) * 86400))
    old = cached_timing(tmp_path, "old")
    assert old is not None and old.t1 == 0.3 and not old.is_prior and old.is_stale()
    assert cached_timing(tmp_path, "k") == fresh  # the other key stays


def test_prior_plans_a_small_tree_on_cpu_and_nothing_on_gpus(engine: Engine) -> None:
    from specmemo_core.planning.planner import TreeOption

    prior = prior_timing(540_000_000, "cpu")  # SmolLM2-135M in fp32
    assert prior is not None and prior.is_prior and prior_timing(540_000_000, "cuda") is None
    step = prior.step_time()
    small, big = TreeOption("small", 7, 3, 2.41), TreeOption("big", 72, 4, 3.69)  # the shipped heads' calibration
    assert small.expected_accepted / step(7, 3) > 1 / step(1, 0) > big.expected_accepted / step(72, 4)
    inputs = plan_inputs(engine, cpu_device(), prior)
    assert make_plan(inputs, PlanChoices()).fits


def test_no_wait_gives_the_prior_then_the_background_timing(engine: Engine, tmp_path: Path) -> None:
    first = timing_without_waiting(engine, "test-cpu", tmp_path, None)
    assert first is not None and first.is_prior
    done: list[StepTiming] = []
    fractions: list[float] = []
    thread = refresh_in_background(engine, "test-cpu", tmp_path, None, on_done=done.append,
                                   progress=lambda stage, f: fractions.append(f))
    assert thread is not None
    thread.join(timeout=120)
    assert len(done) == 1 and not done[0].is_prior and fractions[-1] == 1.0
    assert cached_timing(tmp_path, engine_timing_key(engine, "test-cpu", None)) == done[0]
    assert timing_without_waiting(engine, "test-cpu", tmp_path, None) == done[0]
    assert refresh_in_background(engine, "test-cpu", tmp_path, None, on_done=done.append) is None  # fresh
    assert timing_for(engine, "test-cpu", tmp_path, None) == done[0]  # cached: no measuring


def test_background_timing_waits_while_paused(engine: Engine, tmp_path: Path) -> None:
    """The app holds the timing while it replies: nothing is measured until it lets go."""
    quiet = threading.Event()
    fractions: list[float] = []
    done: list[StepTiming] = []
    thread = refresh_in_background(engine, "test-cpu", tmp_path, None, on_done=done.append,
                                   progress=lambda stage, f: fractions.append(f), pause=quiet.wait)
    assert thread is not None
    thread.join(timeout=0.5)
    assert thread.is_alive() and fractions == [] and done == []
    quiet.set()
    thread.join(timeout=120)
    assert len(done) == 1


def test_an_undated_timing_from_the_older_method_reads_as_missing(tmp_path: Path) -> None:
    """One such entry (taken under load, a drafted level at a quarter of a step) made the
    planner pick a lookup chain alone over the heads: it is measured again, never planned from."""
    (tmp_path / timing.TIMING_FILE).write_text(json.dumps({"old": {"t1": 0.2, "t_big": 0.82, "big": 64,
                                                                   "draft_level": 0.048}}))
    assert cached_timing(tmp_path, "old") is None


def test_a_cancelled_background_timing_stores_nothing_and_ends(engine: Engine, tmp_path: Path) -> None:
    cancel = threading.Event()
    ended = threading.Event()
    done: list[StepTiming] = []

    def progress(stage: str, fraction: float) -> None:
        cancel.set()  # called off after its first run

    thread = refresh_in_background(engine, "test-cpu", tmp_path, None, on_done=done.append, progress=progress,
                                   cancel=cancel, on_end=ended.set)
    assert thread is not None
    thread.join(timeout=120)
    assert ended.is_set() and done == []
    assert cached_timing(tmp_path, engine_timing_key(engine, "test-cpu", None)) is None


@pytest.fixture(scope="module")
def tiny_model_folder(tmp_path_factory) -> Path:
    """A tiny random-weight model saved as a Hugging Face folder, as ``Engine.load`` reads one."""
    from tests.tiny import tiny_hf_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model(seed=21).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_load_planned_without_waiting_never_measures(tiny_model_folder: Path, tmp_path: Path) -> None:
    from specmemo_core.planning.entry import load_planned

    stages: list[str] = []
    planned = load_planned(tiny_model_folder, heads="none", choices=PlanChoices(speculate=False),
                           device=cpu_device(), data_folder=tmp_path, progress=lambda stage, f: stages.append(stage),
                           wait_for_timing=False)
    assert planned.inputs.timing is not None and planned.inputs.timing.is_prior  # the prior, not a measurement
    assert not (tmp_path / timing.TIMING_FILE).exists()
    assert not any("timing" in stage for stage in stages)
    waited = load_planned(tiny_model_folder, heads="none", choices=PlanChoices(speculate=False),
                          device=cpu_device(), data_folder=tmp_path)  # the default waits: measured and cached
    assert waited.inputs.timing is not None and not waited.inputs.timing.is_prior
    assert (tmp_path / timing.TIMING_FILE).exists()


def test_another_thread_counts_timing_stands_in_until_this_one_is_measured(engine: Engine, tmp_path: Path) -> None:
    """``generate`` may run with 1 thread where the app timed 2: the app's timing, not the
    prior, plans it; the nearest count wins, and only the exact key stops a refresh."""
    key = engine_timing_key(engine, "test-cpu", None)
    fingerprint, device, threads, precision = key.split("|")
    two = StepTiming(0.05, 0.11, 32, 0.001).measured(time.time())
    eight = StepTiming(0.02, 0.09, 32, 0.002).measured(time.time())
    store_timing(tmp_path, f"{fingerprint}|{device}|{int(threads) + 1}|{precision}", two)
    store_timing(tmp_path, f"{fingerprint}|{device}|{int(threads) + 7}|{precision}", eight)
    store_timing(tmp_path, f"{fingerprint}|other-device|{threads}|{precision}", eight)
    store_timing(tmp_path, f"{fingerprint}|{device}|{threads}|int8", eight)
    assert timing.nearest_timing(tmp_path, key) == two
    assert timing_without_waiting(engine, "test-cpu", tmp_path, None) == two
    assert timing.needs_refresh(engine, "test-cpu", tmp_path, None)
    assert timing_without_waiting(engine, "elsewhere", tmp_path, None).is_prior  # no timing of that device


def test_a_timing_without_the_once_per_step_costs_reads_as_missing_and_a_new_one_round_trips(tmp_path: Path) -> None:
    """An entry timed before the cost every drafting step pays once (``heads_step``) charged
    that cost to each level: it is measured again. A new entry keeps the cost."""
    old = {"t1": 0.01, "t_big": 0.02, "big": timing.TIMING_BIG, "draft_level": 0.001, "measured_at": time.time(),
           "torch_version": torch.__version__}
    (tmp_path / timing.TIMING_FILE).write_text(json.dumps({"old": old}))
    assert cached_timing(tmp_path, "old") is None
    new = StepTiming(0.01, 0.02, timing.TIMING_BIG, 0.001, heads_step=0.004, multi_step=0.003,
                     grow_step=0.002).measured(time.time())
    store_timing(tmp_path, "new", new)
    assert cached_timing(tmp_path, "new") == new
    assert new.step_time()(2, 1) - new.step_time()(2, 0) == pytest.approx(0.001 + 0.004)
    assert new.step_time()(2, 0) - new.step_time()(1, 0) > 0.003  # the once-per-step cost past one token
    assert StepTiming.from_step_time(new.step_time()).multi_step == pytest.approx(0.003)
    assert new.step_time()(24, 4, True) - new.step_time()(24, 4) == pytest.approx(0.002)  # a grown tree's step
    assert StepTiming.from_step_time(new.step_time()).grow_step == pytest.approx(0.002)
    before = {**old, "heads_step": 0.004}  # timed before the once-per-step cost past one token: again
    (tmp_path / timing.TIMING_FILE).write_text(json.dumps({"before": before}))
    assert cached_timing(tmp_path, "before") is None
    ungrown = {**old, "heads_step": 0.004, "multi_step": 0.003}  # timed before a grown step's cost: again
    (tmp_path / timing.TIMING_FILE).write_text(json.dumps({"ungrown": ungrown}))
    assert cached_timing(tmp_path, "ungrown") is None


def test_a_gpu_step_is_timed_apart_for_each_revision_of_its_attention_kernels(engine: Engine) -> None:
    """On a GPU our step's attention is our own kernels (``runtime/chunked_attention``): a timing
    taken under other kernels must not plan the new ones. (No GPU here: the engine's key is read
    as it would be with its model on one, the only field that decides it.)"""
    from types import SimpleNamespace

    from specmemo_core.runtime import chunked_attention, step_kernels, token_layer

    cpu_key = engine_timing_key(engine, "cpu", None)
    assert "attention-" not in cpu_key and "layer-" not in cpu_key
    on_gpu = SimpleNamespace(identity=engine.identity, backend="torch",
                             model=SimpleNamespace(device=torch.device("cuda"), streamed=None, placement=None))
    gpu_key = engine_timing_key(on_gpu, "NVIDIA H200", None)
    assert gpu_key.endswith(f"|attention-{chunked_attention.revision()}|layer-{token_layer.revision()}"
                            f"|glue-{step_kernels.revision()}")
    revisions = {m.revision() for m in (chunked_attention, token_layer, step_kernels)}
    assert len(revisions) == 3 and all(len(r) == 12 for r in revisions)
