"""The loaded model as the chat needs it: a backend the worker drives, plus the planner's view.

No Qt here: ``load_runtime`` runs in the model manager's thread (and in ``--self-test``),
reporting stages through a ``progress(stage, fraction)`` callback like ``Engine.load``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import psutil

from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.device import DeviceInfo
from specmemo_core.planning.entry import PlanDoesNotFitError, split_of_plan
from specmemo_core.planning.planner import Plan
from specmemo_core.planning.timing import StepTiming

from .planning import PlanInputs, make_plan
from .settings import ChatSettings

Progress = Callable[[str, float], None]
Messages = list[dict[str, str]]


class LoadCancelled(SpecMemoError):
    """The user cancelled loading; the previous model (if any) stays."""

    def __init__(self) -> None:
        super().__init__("loading was cancelled; the previous model stays in use")


class Session(Protocol):
    """What the worker needs of a chat session (``specmemo_core.runtime.chat.ChatSession`` is one)."""

    messages: Messages

    def send(self, user_text: str, config: Any, cancel: threading.Event | None = None) -> Iterator[Any]: ...


class ChatBackend(Protocol):
    """What the worker needs of an engine: sessions, and token counts for the context window."""

    name: str

    def new_session(self, capacity: int, system_prompt: str | None, speculate: bool) -> Session: ...

    def count_tokens(self, messages: Messages) -> int: ...

    def with_tree(self, tree: str | None) -> "ChatBackend": ...

    def fewest_tokens(self, text: str) -> int:
        """A cheap lower bound of ``text``'s tokens, from its length (refuses a huge message before counting)."""
        ...


@dataclass(frozen=True)
class EngineBackend:
    """A ``specmemo_core.runtime.engine.Engine`` seen through the ChatBackend interface."""

    engine: Any

    @property
    def name(self) -> str:
        return self.engine.identity.name

    @property
    def tree_name(self) -> str | None:
        return self.engine.tree.name if self.engine.speculative else None

    def new_session(self, capacity: int, system_prompt: str | None, speculate: bool) -> Session:
        return self.engine.new_session(capacity, system_prompt or None, speculate)

    def count_tokens(self, messages: Messages) -> int:
        from specmemo_core.runtime.chat import encode_conversation

        return len(encode_conversation(self.engine.tokenizer, messages))

    def fewest_tokens(self, text: str) -> int:
        from specmemo_core.runtime.token_bound import fewest_tokens, longest_token_chars

        return fewest_tokens(text, longest_token_chars(self.engine.tokenizer))

    def with_tree(self, tree: str | None) -> "EngineBackend":
        """The same weights and heads with the plan's tree (None: plain decoding)."""
        return replace(self, engine=self.engine.with_tree(tree))


@dataclass(frozen=True)
class Runtime:
    """A loaded model with its device, planner inputs and the plan in force."""

    backend: ChatBackend
    device: DeviceInfo
    inputs: PlanInputs
    plan: Plan
    settings: ChatSettings

    @property
    def speculative(self) -> bool:
        return self.settings.speculate and self.tree is not None

    @property
    def tree(self) -> str | None:
        return self.plan.tree

    @property
    def capacity(self) -> int:
        return max(self.plan.kv_tokens, 256)

    def needs_reload(self, settings: ChatSettings) -> bool:
        """Whether ``settings`` need the model loaded again: another model, heads or precision,
        or a plan that keeps another number of layers on the GPU (the slider trades KV cache
        against resident layers when the model streams) or splits them otherwise over GPUs."""
        if self.settings.needs_reload(settings):
            return True
        new_plan = make_plan(self.inputs, settings)
        return (new_plan.resident_layers != self.plan.resident_layers
                or split_of_plan(new_plan) != split_of_plan(self.plan))

    def replanned(self, settings: ChatSettings) -> "Runtime":
        """Apply new settings that need no reload: a new plan, and the tree it picks."""
        new_plan = make_plan(self.inputs, settings)
        if not new_plan.fits:
            raise PlanDoesNotFitError(new_plan)
        return self.with_plan(new_plan, settings)

    def with_timing(self, timing: StepTiming) -> "Runtime":
        """The plan made again from a new device timing (the background one), same settings."""
        return replace(self, inputs=replace(self.inputs, timing=timing)).replanned(self.settings)

    def with_plan(self, plan: Plan, settings: ChatSettings) -> "Runtime":
        """``plan`` (made for ``settings``) in force, with the backend switched to the tree it picks."""
        applied = replace(self, plan=plan, settings=settings)
        return replace(applied, backend=self.backend.with_tree(applied.tree if applied.speculative else None))


def memory_in_use(device: DeviceInfo) -> int:
    """Bytes this process holds where the model runs: the GPU allocator's, else resident memory."""
    if device.kind in ("cuda", "rocm"):
        import torch

        return int(torch.cuda.memory_allocated(device.torch_device))
    return int(psutil.Process(os.getpid()).memory_info().rss)


def load_runtime(settings: ChatSettings, data_folder: Path, progress: Progress,
                 cancel: threading.Event | None = None, device: DeviceInfo | None = None) -> Runtime:
    """Probe the device, load the model and heads, plan from the cached device timing (else
    the prior: never measured here, the window times the device in the background once it
    is ready), apply the plan: the core's one plan entry (``planning.entry.load_planned``).

    Raises the core's SpecMemoError subclasses (ModelFileError, HeadsError, FetchError, …)
    unchanged so the window can offer the right way forward, or LoadCancelled.
    """
    from specmemo_core.planning.entry import find_device, find_devices, load_planned

    def report(stage: str, fraction: float) -> None:
        if cancel is not None and cancel.is_set():
            raise LoadCancelled()
        progress(stage, fraction)

    devices = ()
    if device is None:
        report("probing the device", 0.0)
        devices = find_devices()  # several GPUs: the plan picks one, or splits the layers over them
        device = None if len(devices) > 1 else devices[0] if devices else find_device(None)
    planned = load_planned(settings.model, heads=settings.heads, choices=settings.plan_choices(), device=device,
                           data_folder=data_folder, progress=report, wait_for_timing=False, devices=devices)
    return Runtime(EngineBackend(planned.engine), planned.device, planned.inputs, planned.plan, settings)
