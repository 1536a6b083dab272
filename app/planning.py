"""The app's settings as planner choices (pure, no Qt): the plan itself comes from the
core's one plan entry, ``specmemo_core.planning.entry``."""

from __future__ import annotations

from specmemo_core.planning.entry import PlanInputs, make_plan as core_make_plan
from specmemo_core.planning.planner import Plan
from specmemo_core.planning.timing import StepTiming

from .settings import ChatSettings

__all__ = ["PlanInputs", "StepTiming", "make_plan", "smaller_settings"]


def make_plan(inputs: PlanInputs, settings: ChatSettings) -> Plan:
    """The plan for ``settings`` (the settings panel calls this on every slider move)."""
    return core_make_plan(inputs, settings.plan_choices())


def smaller_settings(settings: ChatSettings) -> ChatSettings:
    """After running out of memory: half the turns and all the spare memory to turns, not the tree."""
    return settings.with_(turns=max(1, settings.turns // 2), prefer=0.0)
