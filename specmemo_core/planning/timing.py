"""The device's start-up timing as numbers, cached per (model, device, threads, precision).

The planner's step-time model (``planner.linear_step_time``) comes from timing a forward
of 1 and of ``big`` tokens and the cost of a drafted level (``plan_check.time_forward``).
That takes seconds to minutes on a small CPU, so it is measured once and kept in the
data folder; every entry point (app, ``specmemo chat``/``generate``/``plan``/``bench``)
reads the same cache through ``timing_for``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from specmemo_core.planning.planner import StepTime, linear_step_time

log = logging.getLogger(__name__)

TIMING_FILE = "step_timing.json"
TIMING_BIG = 64  # tokens of the larger timed forward

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class StepTiming:
    """The start-up timing as numbers (so it can be cached): see planner.linear_step_time."""

    t1: float
    t_big: float
    big: int
    draft_level: float

    def step_time(self) -> StepTime:
        return linear_step_time(self.t1, self.t_big, self.big, self.draft_level)

    @classmethod
    def from_step_time(cls, step_time: StepTime, big: int = TIMING_BIG) -> "StepTiming":
        """Read the numbers back out of plan_check.time_forward's linear model."""
        t1 = step_time(1, 0)
        return cls(t1, step_time(big, 0), big, step_time(1, 1) - t1)


def timing_key(fingerprint: str, device_name: str, threads: int, precision: str | None) -> str:
    return f"{fingerprint}|{device_name}|{threads}|{precision or 'fp32'}"


def cached_timing(folder: Path, key: str) -> StepTiming | None:
    try:
        data = json.loads((folder / TIMING_FILE).read_text(encoding="utf-8"))[key]
        return StepTiming(float(data["t1"]), float(data["t_big"]), int(data["big"]), float(data["draft_level"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_timing(folder: Path, key: str, timing: StepTiming) -> None:
    """Remember the timing so later starts skip it."""
    path = folder / TIMING_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        data[key] = asdict(timing)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except (OSError, ValueError) as exc:  # only costs a re-timing next start
        log.warning("could not save step timing to %s (%s)", path, exc)


def measure_timing(model: Any, heads: Any) -> StepTiming:
    """Time this device now (``plan_check.time_forward``)."""
    from specmemo_core.planning.plan_check import time_forward

    return StepTiming.from_step_time(time_forward(model, heads))


def timing_for(engine: Any, device_name: str, folder: Path | None, precision: str | None,
               progress: Progress | None = None) -> StepTiming:
    """The cached timing of this engine on this device, else measured now and cached."""
    import torch

    key = timing_key(engine.identity.fingerprint, device_name, torch.get_num_threads(), precision)
    cached = cached_timing(folder, key) if folder is not None else None
    if cached is not None:
        return cached
    if progress is not None:
        progress("timing the device (once)", 0.0)
    timing = measure_timing(engine.model, engine.heads)
    if folder is not None:
        store_timing(folder, key, timing)
    return timing
