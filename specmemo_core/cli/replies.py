"""One reply's statistics, collected from the decoder's steps while the text streams."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from specmemo_core.runtime.chat import ChatSession
from specmemo_core.runtime.decoding import GenerationConfig


@dataclass
class ReplyStats:
    """Totals over one reply, for --json and the status line."""

    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # verify steps after the prefill
    drafted: int = 0  # tokens those steps emitted before stop cuts
    text: str = ""
    step_times: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"text": self.text, "new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "mean_accepted": round(self.mean_accepted, 4),
                "steps": self.steps}


def stream_reply(session: ChatSession, text: str, config: GenerationConfig,
                 on_text: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> ReplyStats:
    """Send one message and collect statistics from the decoder's steps."""
    stats = ReplyStats()
    start = time.perf_counter()
    for piece in session.send(text, config, cancel):
        step = piece.step
        stats.new_tokens += len(step.token_ids)
        if step.accepted and not step.prefill:
            stats.steps += 1
            stats.drafted += step.accepted
            stats.step_times.append(step.forward_s)
        if piece.text and on_text:
            on_text(piece.text)
        stats.text += piece.text
    stats.seconds = time.perf_counter() - start
    return stats


def status_line(stats: ReplyStats) -> str:
    return f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, {stats.mean_accepted:.2f} tokens/step]"
