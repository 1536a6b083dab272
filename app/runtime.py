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

from specmemo_core.planning.device import DeviceInfo
from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.planner import Budget, Plan

from .planning import PlanInputs, StepTiming, cached_timing, make_plan, store_timing, timing_key
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

    def fewest_tokens(self, text: str) -> int:
        """A cheap lower bound of ``text``'s tokens, from its length (refuses a huge message before counting)."""
        ...


@dataclass(frozen=True)
class EngineBackend:
    """A ``specmemo_core.runtime.engine.Engine`` seen through the ChatBackend interface."""

    engine: Any
    heads_dir: Path | None = None  # where calibrated trees are read from

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
        """The same weights and heads with another tree (None: plain decoding; without
        heads only a lookup chain alone, ``lookup-N``, can speculate)."""
        from specmemo_core.runtime.engine import resolve_tree
        from specmemo_core.runtime.tree import is_lookup_only

        if tree is None or (self.engine.heads is None and not is_lookup_only(tree)):
            return replace(self, engine=replace(self.engine, tree=None))
        if self.engine.tree is not None and self.engine.tree.name == tree:
            return self
        chosen = resolve_tree(tree, self.heads_dir)
        chosen.check_heads(self.engine.heads.num_heads if self.engine.heads is not None else None)
        return replace(self, engine=replace(self.engine, tree=chosen))


@dataclass(frozen=True)
class Runtime:
    """A loaded model with its device, planner inputs and the plan in force."""

    backend: Any  # ChatBackend
    device: DeviceInfo
    inputs: PlanInputs
    plan: Plan
    settings: ChatSettings

    @property
    def speculative(self) -> bool:
        return self.settings.speculate and self.tree is not None

    @property
    def tree(self) -> str | None:
        return self.settings.tree or self.plan.tree

    @property
    def capacity(self) -> int:
        return max(self.plan.kv_tokens, 256)

    def replanned(self, settings: ChatSettings) -> "Runtime":
        """Apply new settings that need no reload: a new plan, and the tree it picks."""
        new_plan = make_plan(self.inputs, settings)
        if not new_plan.fits:
            raise SpecMemoError("these settings do not fit the device: " + "; ".join(new_plan.suggestions))
        return self.with_plan(new_plan, settings)

    def with_plan(self, plan: Plan, settings: ChatSettings) -> "Runtime":
        """``plan`` (made for ``settings``) in force, with the backend switched to the tree it picks."""
        applied = replace(self, plan=plan, settings=settings)
        if not hasattr(self.backend, "with_tree"):
            return applied
        return replace(applied, backend=self.backend.with_tree(applied.tree if applied.speculative else None))


def memory_in_use(device: DeviceInfo) -> int:
    """Bytes this process holds where the model runs: the GPU allocator's, else resident memory."""
    if device.kind in ("cuda", "rocm"):
        import torch

        return int(torch.cuda.memory_allocated(device.torch_device))
    return int(psutil.Process(os.getpid()).memory_info().rss)


def load_runtime(settings: ChatSettings, data_folder: Path, progress: Progress,
                 cancel: threading.Event | None = None, device: DeviceInfo | None = None) -> Runtime:
    """Probe the device, load the model and heads, time a step (cached), plan, apply the plan.

    Raises the core's SpecMemoError subclasses (ModelFileError, HeadsError, FetchError, …)
    unchanged so the window can offer the right way forward, or LoadCancelled.
    """
    import torch

    from specmemo_core.runtime.engine import Engine
    from specmemo_core.planning.memory import HeadsShape, ModelShape
    from specmemo_core.planning.plan_check import time_forward
    from specmemo_core.planning.planner import tree_options
    from specmemo_core.tools.train.calibrate import load_calibration

    def report(stage: str, fraction: float) -> None:
        if cancel is not None and cancel.is_set():
            raise LoadCancelled()
        progress(stage, fraction)

    if device is None:
        from specmemo_core.planning.device import probe

        report("probing the device", 0.0)
        device = probe().best()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(settings.precision or "", torch.float32)
    engine = Engine.load(settings.model, heads=settings.heads if settings.speculate else "none", tree=None,
                         dtype=dtype, device=device.torch_device, progress=report, precision=settings.precision)
    shape = ModelShape.from_spec(engine.model.spec, engine.identity.name)
    heads_shape = HeadsShape.from_spec(engine.heads.spec) if engine.heads is not None else None
    folder = engine.heads_folder
    record = load_calibration(folder) if folder is not None else None
    trees = tree_options(record)
    key = timing_key(engine.identity.fingerprint, device.name, torch.get_num_threads(), settings.precision)
    timing = cached_timing(data_folder, key)
    if timing is None:
        report("timing the device (once)", 0.0)
        timing = StepTiming.from_step_time(time_forward(engine.model, engine.heads))
        store_timing(data_folder, key, timing)
    report("planning", 1.0)
    budget = Budget(device.kind, device.total_bytes, device.free_bytes, device.name)
    inputs = PlanInputs(budget, shape, heads_shape, tuple(trees), timing)
    plan = make_plan(inputs, settings)
    if not plan.fits:
        raise SpecMemoError("the model does not fit this device: " + "; ".join(plan.suggestions))
    return Runtime(EngineBackend(engine, folder), device, inputs, plan, settings).with_plan(plan, settings)
