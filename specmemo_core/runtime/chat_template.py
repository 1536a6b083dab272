"""The model's chat template, rendered with a budget: a template that loops without end cannot hang the app.

transformers renders chat templates in Jinja's ``ImmutableSandboxedEnvironment`` (no file or attribute
escapes), so the normal case stays transformers' own rendering, character for character. What the sandbox
does not bound is time: nested loops (``range`` is capped at 100,000 items, but loops nest) or a template
that walks every character of every message many times. So rendering runs under a line tracer on the
template's compiled code alone (Jinja compiles templates to Python whose file is ``<template>``): every line
the template executes costs a step, every string it yields counts towards its output, and past either budget
the render stops with ``ChatTemplateError``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

import jinja2

from specmemo_core.errors import ChatTemplateError

TEMPLATE_FILE = "<template>"  # the file name Jinja gives code compiled from a string
BASE_STEPS, STEPS_PER_MESSAGE = 200_000, 2_000  # a normal template takes ~10-30 steps per message
BASE_CHARS, CHARS_PER_MESSAGE = 256 * 1024, 16 * 1024  # rendered text (message contents are placeholders here)


@dataclass(frozen=True)
class TemplateBudget:
    """How much one render may do: template lines executed and characters produced."""

    steps: int
    chars: int

    @classmethod
    def for_messages(cls, count: int) -> "TemplateBudget":
        return cls(BASE_STEPS + STEPS_PER_MESSAGE * count, BASE_CHARS + CHARS_PER_MESSAGE * count)


class _Meter:
    """The trace functions of one render; they raise ChatTemplateError once a budget is spent."""

    def __init__(self, budget: TemplateBudget) -> None:
        self.budget = budget
        self.steps = 0
        self.chars = 0

    def enter(self, frame: FrameType, event: str, arg: Any) -> Callable | None:
        return self.line if frame.f_code.co_filename == TEMPLATE_FILE else None  # only the template's own code

    def line(self, frame: FrameType, event: str, arg: Any) -> Callable:
        if event == "line":
            self.steps += 1
            if self.steps > self.budget.steps:
                raise ChatTemplateError(
                    f"the model's chat template did not finish within {self.budget.steps:,} steps: it loops without "
                    "end (or nearly). Choose another model, or replace the chat template in the model's "
                    "tokenizer_config.json.")
        elif event == "return" and isinstance(arg, str):  # a yielded or returned piece of the output
            self.chars += len(arg)
            if self.chars > self.budget.chars:
                raise ChatTemplateError(
                    f"the model's chat template produced more than {self.budget.chars:,} characters for this "
                    "conversation: it is broken. Choose another model, or replace the chat template in the "
                    "model's tokenizer_config.json.")
        return self.line


def render_chat_template(tokenizer: Any, messages: list[dict[str, str]], budget: TemplateBudget | None = None) -> str:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` within ``budget``
    (by default one that grows with the conversation). Raises ChatTemplateError if the template fails or
    overruns. NOTE: the tracer replaces a debugger's or coverage's trace function on this thread while the
    template renders (restored after); a single huge operation (a string multiplied by a billion) is one step."""
    meter = _Meter(budget or TemplateBudget.for_messages(len(messages)))
    previous = sys.gettrace()
    sys.settrace(meter.enter)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the model's chat template failed ({exc}). Choose another model, or replace the "
                                "chat template in the model's tokenizer_config.json.") from exc
    finally:
        sys.settrace(previous)
