"""The device's step timing as numbers, cached per (model, device, threads, precision).

The planner's step-time model (``planner.linear_step_time``) comes from timing whole decoding
steps: plain, chains of 1 and 3 levels and a ``big``-node tree (``plan_check.time_forward``).
It is measured once and kept in the data folder with the time it was taken and the torch
version; every entry point reads the same cache.

Two ways to get a timing:

- ``timing_for`` waits: the cached timing (even a stale one), else one measured now. For
  the command line (``specmemo plan``, ``bench``), where a number is wanted at once.
- ``timing_without_waiting`` never measures: the cached timing, else a conservative prior
  (``prior_timing``). The app, ``chat`` and ``generate`` plan from it so nothing waits on it;
  ``refresh_in_background`` then measures in a thread when the timing is missing or stale
  (older than ``MAX_AGE_DAYS``, another torch version) and hands the new one to a callback,
  with which the app re-plans silently.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.planner import StepTime, linear_step_time

log = logging.getLogger(__name__)

TIMING_FILE = "step_timing.json"
TIMING_BIG = 32  # nodes of the larger timed tree (plan_check.time_forward's default)
MAX_AGE_DAYS = 14.0

Progress = Callable[[str, float], None]


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@dataclass(frozen=True)
class StepTiming:
    """The timing as numbers (so it can be cached): see planner.linear_step_time.

    ``measured_at`` is the Unix time of the measurement; None marks a prior (nothing was
    measured on this device yet), whose absolute speed is only a guess."""

    t1: float
    t_big: float
    big: int
    draft_level: float
    measured_at: float | None = None
    torch_version: str = ""
    heads_step: float = 0.0  # once per step that drafts with heads (planner.linear_step_time)
    multi_step: float = 0.0  # once per step of more than one token (planner.linear_step_time)
    grow_step: float = 0.0  # once per step on a tree grown each step (planner.linear_step_time)

    @property
    def is_prior(self) -> bool:
        return self.measured_at is None

    def step_time(self) -> StepTime:
        return linear_step_time(self.t1, self.t_big, self.big, self.draft_level, self.heads_step,
                                multi_step=self.multi_step, grow_step=self.grow_step)

    def is_stale(self, now: float | None = None) -> bool:
        """A prior, older than MAX_AGE_DAYS, or taken under another torch version."""
        if self.measured_at is None or self.torch_version != _torch_version():
            return True
        return (now if now is not None else time.time()) - self.measured_at > MAX_AGE_DAYS * 86400

    @classmethod
    def from_step_time(cls, step_time: StepTime, big: int = TIMING_BIG) -> "StepTiming":
        """Read the numbers back out of plan_check.time_forward's linear model (a prior
        until ``measured`` stamps it)."""
        t1 = step_time(1, 0)
        level = step_time(1, 2) - step_time(1, 1)
        slope = (step_time(big, 0) - step_time(2, 0)) / max(big - 2, 1)
        return cls(t1, step_time(big, 0), big, level, heads_step=step_time(1, 1) - t1 - level,
                   multi_step=step_time(2, 0) - t1 - slope, grow_step=step_time(2, 1, True) - step_time(2, 1))

    def measured(self, at: float) -> "StepTiming":
        return replace(self, measured_at=at, torch_version=_torch_version())


def timing_key(fingerprint: str, device_name: str, threads: int, precision: str | None) -> str:
    return f"{fingerprint}|{device_name}|{threads}|{precision or 'fp32'}"


def engine_timing_key(engine: Any, device_name: str, precision: str | None) -> str:
    """The key of ``engine`` (an ``Engine``) on ``device_name`` with this process's threads;
    an engine that streams layers (``runtime/offload.py``) is timed apart for each number of
    resident layers: its steps wait on the link; a split one (``runtime/split.py``) for each split;
    one on llama.cpp's forward (``runtime/ggml_step.py``) apart from ours, one on the native
    forward for each build of it (``runtime/native``: a changed kernel is timed again), and
    ours on a GPU for each revision of its kernels (``runtime/chunked_attention``, ``runtime/token_layer``,
    ``runtime/step_kernels``)."""
    import torch

    key = timing_key(engine.identity.fingerprint, device_name, torch.get_num_threads(), precision)
    if getattr(engine, "backend", "torch") != "torch":  # another engine's forward (ggml_step.py): timed apart
        key = f"{key}|{engine.backend}"
        build = getattr(engine.model, "build", None)  # the native forward's build (its source and CPU)
        key = f"{key}-{build}" if build else key
    elif engine.model.device.type == "cuda":  # our GPU step: timed again when its kernels change
        from specmemo_core.runtime import chunked_attention, step_kernels, token_layer

        key = (f"{key}|attention-{chunked_attention.revision()}|layer-{token_layer.revision()}"
               f"|glue-{step_kernels.revision()}")
    streamed, placement = engine.model.streamed, engine.model.placement
    if placement is not None:  # a split model (runtime/split.py): its steps cross the borders
        key = f"{key}|split-" + "-".join(f"{d}:{n}" for d, n in zip(placement.split.devices, placement.split.layers))
    return key if streamed is None else f"{key}|resident-{len(engine.model.model.layers)}"


def cached_timing(folder: Path, key: str) -> StepTiming | None:
    """The stored timing, or None.

    An entry written before timings were dated (no ``measured_at``) reads as missing: it
    came from an older method (64-token forwards, a level cost that was not a real
    speculative step) whose numbers do not compare. One such entry on this machine,
    taken under load, charged a drafted level a quarter of a whole step, and the planner
    chose a lookup chain alone (1.0 tokens/step on a new question) over the heads. So does
    one without ``heads_step``: its level cost holds what every drafting step pays once; and
    one without ``multi_step``: its node cost holds what every step past one token pays once;
    and one without ``grow_step``: it charged a grown tree as a fixed one, so on an H200 the
    planner took ``dynamic-16+lookup-8`` at a predicted 1,748 tokens/s that ran 1,302, below
    plain decoding's 1,330 (its steps took 2.2 ms, not the 1.8 predicted:
    ``docs/results/tree_rows_h200/``)."""
    try:
        data = json.loads((folder / TIMING_FILE).read_text(encoding="utf-8"))[key]
        if (not data.get("measured_at") or int(data["big"]) != TIMING_BIG or "heads_step" not in data
                or "multi_step" not in data or "grow_step" not in data):
            return None
        return StepTiming(float(data["t1"]), float(data["t_big"]), int(data["big"]), float(data["draft_level"]),
                          float(data["measured_at"]), str(data.get("torch_version", "")),
                          float(data["heads_step"]), float(data["multi_step"]), float(data["grow_step"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def nearest_timing(folder: Path, key: str) -> StepTiming | None:
    """The timing of ``key``, else the one taken on the same model, device and precision with
    the nearest thread count (fewer threads first on a tie), else None.

    Why: the thread count follows how busy the cores are, so ``chat`` or ``generate`` may
    run with another count than the app's start-up timing; that timing still gives the
    shape the tree choice depends on (a node's and a level's cost against a plain step)
    far better than the prior. Only an exact key counts as measured for ``needs_refresh``."""
    exact = cached_timing(folder, key)
    if exact is not None:
        return exact
    try:
        fingerprint, device, threads, precision = key.split("|", 3)
        keys = json.loads((folder / TIMING_FILE).read_text(encoding="utf-8")).keys()
    except (OSError, ValueError, AttributeError):
        return None
    candidates = []
    for other in keys:
        parts = other.split("|", 3)
        if len(parts) == 4 and parts[:2] == [fingerprint, device] and parts[3] == precision and parts[2].isdigit():
            candidates.append((abs(int(parts[2]) - int(threads)), int(parts[2]), other))
    for _distance, _threads, other in sorted(candidates):
        found = cached_timing(folder, other)
        if found is not None:
            return found
    return None


def store_timing(folder: Path, key: str, timing: StepTiming) -> None:
    """Remember the timing so later starts skip it."""
    path = folder / TIMING_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        data[key] = asdict(timing)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")  # a background refresh may write too
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except (OSError, ValueError) as exc:  # only costs a re-timing next start
        log.warning("could not save step timing to %s (%s)", path, exc)


def prior_timing(weight_bytes: int, device_kind: str) -> StepTiming | None:
    """A conservative guess before anything is measured, so the first plan is a small tree.

    On a CPU a plain step streams the weights once (taken at 8 GB/s: a slow laptop), each
    extra tree node adds 8 % of that and each drafted level 10 %: dearer than this 2-core
    machine measured unloaded (6.4 % per node, 7.7 % per level), so the planner keeps to
    small trees (for SmolLM2 with its shipped heads calibrated-4+lookup-3, 7 nodes, which
    the unloaded measurement picks too). Elsewhere (GPUs) None: the planner chooses by
    memory until the background timing is in.
    """
    if device_kind != "cpu":
        return None
    t1 = max(weight_bytes / 8e9, 1e-3)
    return StepTiming(t1, t1 * (1.0 + 0.08 * (TIMING_BIG - 1)), TIMING_BIG, 0.10 * t1)


def measure_timing(model: Any, heads: Any, progress: Progress | None = None,
                   pause: Callable[[], None] | None = None) -> StepTiming:
    """Time this device now (``plan_check.time_forward``), dated."""
    from specmemo_core.planning.plan_check import TimingHooks, time_forward

    step_time = time_forward(model, heads, big=TIMING_BIG, hooks=TimingHooks(progress, pause))
    return StepTiming.from_step_time(step_time, TIMING_BIG).measured(time.time())


def timing_for(engine: Any, device_name: str, folder: Path | None, precision: str | None,
               progress: Progress | None = None) -> StepTiming:
    """The cached timing of this engine on this device (even a stale one), else measured now and cached."""
    key = engine_timing_key(engine, device_name, precision)
    cached = cached_timing(folder, key) if folder is not None else None
    if cached is not None:
        return cached
    timing = measure_timing(engine.model, engine.heads, progress)
    if folder is not None:
        store_timing(folder, key, timing)
    return timing


def timing_without_waiting(engine: Any, device_name: str, folder: Path | None,
                           precision: str | None) -> StepTiming | None:
    """The cached timing (even a stale one; another thread count's: ``nearest_timing``), else
    ``prior_timing``: never measures."""
    from specmemo_core.runtime.quantize import held_bytes

    cached = nearest_timing(folder, engine_timing_key(engine, device_name, precision)) if folder is not None else None
    return cached if cached is not None else prior_timing(held_bytes(engine.model), engine.model.device.type)


def needs_refresh(engine: Any, device_name: str, folder: Path | None, precision: str | None) -> bool:
    cached = cached_timing(folder, engine_timing_key(engine, device_name, precision)) if folder is not None else None
    return cached is None or cached.is_stale()


class TimingCancelled(SpecMemoError):
    """The background timing was called off (the window closed, or another model loaded)."""

    def __init__(self) -> None:
        super().__init__("the device timing was cancelled")


def refresh_in_background(engine: Any, device_name: str, folder: Path | None, precision: str | None, *,
                          on_done: Callable[[StepTiming], None], progress: Progress | None = None,
                          pause: Callable[[], None] | None = None, cancel: threading.Event | None = None,
                          on_end: Callable[[], None] | None = None) -> threading.Thread | None:
    """Measure in a daemon thread when the cached timing is missing or stale; store it and
    call ``on_done(timing)`` from that thread. None when the cached timing is fresh.

    ``pause`` is called before each timed run and may block: the app blocks it while a
    reply is generated, so the timing never slows a reply (and is not slowed by one).
    ``progress(stage, fraction)`` reports the fraction done. Setting ``cancel`` stops the
    timing before its next run (nothing is stored, ``on_done`` is not called).
    ``on_end()`` is called from the thread last, whatever the outcome."""
    if not needs_refresh(engine, device_name, folder, precision):
        return None
    key = engine_timing_key(engine, device_name, precision)

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise TimingCancelled()

    def paused() -> None:
        check()
        if pause is not None:
            pause()
        check()

    def reported(stage: str, fraction: float) -> None:
        check()
        if progress is not None:
            progress(stage, fraction)

    def run() -> None:
        try:
            timing = measure_timing(engine.model, engine.heads, reported, paused)
            check()
            if folder is not None:
                store_timing(folder, key, timing)
            on_done(timing)
        except TimingCancelled:
            log.info("the background device timing was cancelled")
        except Exception:  # a failed timing costs only the plan's accuracy; log it, keep the prior
            log.exception("the background device timing failed")
        finally:
            if on_end is not None:
                on_end()

    thread = threading.Thread(target=run, name="specmemo-device-timing", daemon=True)
    thread.start()
    return thread
