"""A scripted engine with the real session interface (``send`` yields TextPiece), for fast GUI tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from specmemo_core.runtime.chat import TextPiece
from specmemo_core.runtime.decoding import GenerationConfig, Step
from specmemo_core.planning.device import DeviceInfo
from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.memory import KNOWN_SHAPES, HeadsShape
from specmemo_core.planning.planner import Budget, specmemo_prior_options

from app.planning import PlanInputs, StepTiming, make_plan
from app.runtime import Runtime
from app.settings import ChatSettings

GIB = 2**30


def default_reply(user_text: str) -> list[str]:
    """Pieces of the reply to ``user_text``: numbered words, so their order can be checked."""
    return [f"w{i} " for i in range(12)] + [f"[{user_text[:20]}]"]


@dataclass
class ScriptedSession:
    capacity: int
    system_prompt: str | None
    script: Callable[[str], list[str]]
    delay: float
    fail: BaseException | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.system_prompt:
            self.messages.append({"role": "system", "content": self.system_prompt})

    def send(self, user_text: str, config: GenerationConfig | None = None,
             cancel: threading.Event | None = None) -> Iterator[TextPiece]:
        if not user_text.strip():
            raise SpecMemoError("the message is empty: type something first")
        config = config or GenerationConfig()
        self.messages.append({"role": "user", "content": user_text})
        reply = ""
        try:
            for i, text in enumerate(self.script(user_text)[: config.max_new_tokens]):
                if cancel is not None and cancel.is_set():
                    return
                time.sleep(self.delay)
                if self.fail is not None and i == 3:
                    raise self.fail
                reply += text
                yield TextPiece(text, Step((i,), 2 if i else 1, self.delay, 4, prefill=i == 0))
        finally:
            self.messages.append({"role": "assistant", "content": reply})


@dataclass
class ScriptedBackend:
    """``count_tokens``: a token per 4 characters plus 4 per message (enough to test the window)."""

    name: str = "scripted-model"
    script: Callable[[str], list[str]] = default_reply
    delay: float = 0.01
    fail_next: BaseException | None = None
    sessions: list[ScriptedSession] = field(default_factory=list)

    def new_session(self, capacity: int, system_prompt: str | None, speculate: bool) -> ScriptedSession:
        fail, self.fail_next = self.fail_next, None
        session = ScriptedSession(capacity, system_prompt, self.script, self.delay, fail)
        self.sessions.append(session)
        return session

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return sum(len(m["content"]) // 4 + 4 for m in messages)

    def with_tree(self, tree: str | None) -> "ScriptedBackend":
        return self  # the script replies the same whatever the tree

    def fewest_tokens(self, text: str) -> int:
        return len(text) // 4


def fake_device(free: int = 8 * GIB) -> DeviceInfo:
    return DeviceInfo("cpu", 0, "Test CPU", 16 * GIB, free, "", "cpu")


def fake_inputs(free: int = 8 * GIB) -> PlanInputs:
    return PlanInputs(Budget("cpu", 16 * GIB, free, "Test CPU"), KNOWN_SHAPES["smollm2-135m"],
                      HeadsShape("hydra", 4, 1), tuple(specmemo_prior_options()),
                      StepTiming(0.02, 0.03, 64, 0.001))


def fake_runtime(backend: ScriptedBackend | None = None, settings: ChatSettings | None = None,
                 capacity_bytes: int = 8 * GIB) -> Runtime:
    settings = settings or ChatSettings(max_reply_tokens=64)
    inputs = fake_inputs(capacity_bytes)
    return Runtime(backend or ScriptedBackend(), fake_device(capacity_bytes), inputs, make_plan(inputs, settings),
                   settings)
