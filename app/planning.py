"""Planner inputs for the loaded model and the plan for the user's settings (pure, no Qt).

The settings panel re-plans on every slider move, so everything slow (probing the device,
timing a forward) is gathered once into ``PlanInputs`` when the model loads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specmemo_core.planning.memory import HeadsShape, ModelShape
from specmemo_core.planning.planner import Budget, Plan, PlanRequest, StepTime, TreeOption, linear_step_time, plan

from .settings import ChatSettings

log = logging.getLogger(__name__)

TIMING_FILE = "step_timing.json"
TIMING_BIG = 64  # tokens of the larger timed forward


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


@dataclass(frozen=True)
class PlanInputs:
    """Everything ``plan()`` needs besides the user's request."""

    budget: Budget
    model: ModelShape
    heads: HeadsShape | None
    trees: Sequence[TreeOption]
    timing: StepTiming | None = None


def request_for(settings: ChatSettings, turns: int | None = None) -> PlanRequest:
    return PlanRequest(turns=turns or settings.turns, prefer=settings.prefer, precision=settings.precision,
                       reply_tokens=settings.max_reply_tokens, sampling=settings.temperature > 0)


def make_plan(inputs: PlanInputs, settings: ChatSettings) -> Plan:
    """The plan for ``settings``; with speculation off the heads and trees are left out of it."""
    heads = inputs.heads if settings.speculate else None
    trees = inputs.trees if settings.speculate else ()
    step_time = inputs.timing.step_time() if inputs.timing else None
    return plan(inputs.budget, inputs.model, heads, request_for(settings), trees, step_time)


def smaller_settings(settings: ChatSettings) -> ChatSettings:
    """After running out of memory: half the turns and all the spare memory to turns, not the tree."""
    return settings.with_(turns=max(1, settings.turns // 2), prefer=0.0)


def timing_key(fingerprint: str, device_name: str, threads: int, precision: str | None) -> str:
    return f"{fingerprint}|{device_name}|{threads}|{precision or 'fp32'}"


def cached_timing(folder: Path, key: str) -> StepTiming | None:
    try:
        data = json.loads((folder / TIMING_FILE).read_text(encoding="utf-8"))[key]
        return StepTiming(float(data["t1"]), float(data["t_big"]), int(data["big"]), float(data["draft_level"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_timing(folder: Path, key: str, timing: StepTiming) -> None:
    """Remember the timing so later starts skip it (a few seconds on a small CPU)."""
    path = folder / TIMING_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        data[key] = timing.__dict__
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except (OSError, ValueError) as exc:  # only costs a re-timing next start
        log.warning("could not save step timing to %s (%s)", path, exc)
