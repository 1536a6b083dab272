"""One reply's statistics, collected from the decoder's steps while the text streams."""

from __future__ import annotations

import threading
import time
from typing import Callable

from specmemo_core.runtime.chat import ChatSession
from specmemo_core.runtime.decoding import GenerationConfig, ReplyStats


def stream_reply(session: ChatSession, text: str, config: GenerationConfig,
                 on_text: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> ReplyStats:
    """Send one message and collect statistics from the decoder's steps."""
    stats = ReplyStats()
    start = time.perf_counter()
    for piece in session.send(text, config, cancel):
        stats.add(piece.step, piece.text, time.perf_counter() - start)
        if piece.text and on_text:
            on_text(piece.text)
    stats.seconds = time.perf_counter() - start
    return stats


def status_line(stats: ReplyStats) -> str:
    return f"[{stats.tokens} tokens, {stats.tokens_per_s:.1f} tok/s, {stats.mean_accepted:.2f} tokens/step]"
