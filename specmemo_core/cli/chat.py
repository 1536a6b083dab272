"""``specmemo chat``: a multi-turn chat in the terminal that goes on past a full context.

When the conversation outgrows the KV cache, its oldest turns slide out of the model's
view (``runtime.context_window.fit_window``, the app's rule) and the chat says so. Lines
starting with ``/`` are commands: /new, /stats, /help, /quit.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from specmemo_core.cli.common import add_model_args, generation_config
from specmemo_core.cli.replies import ReplyStats, status_line, stream_reply
from specmemo_core.errors import ContextFullError, SpecMemoError
from specmemo_core.runtime.chat import ChatSession
from specmemo_core.runtime.context_window import (CONTEXT_MARGIN, Messages, TooLongError, fit_window,
                                                  system_messages, turns_before)
from specmemo_core.runtime.decoding import GenerationConfig

HELP = """commands:
  /new    start a new chat (the model forgets this one)
  /stats  this chat's turns, tokens, speed and context
  /help   this list
  /quit   leave (so do Ctrl-D; Ctrl-C stops a reply)"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="multi-turn chat in the terminal (/help lists its commands)")
    add_model_args(p)
    p.set_defaults(run=run)


@dataclass
class ChatTotals:
    """What /stats reports: the replies of this chat so far."""

    replies: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0

    def add(self, stats: ReplyStats) -> None:
        self.replies += 1
        self.tokens += stats.tokens
        self.seconds += stats.seconds
        self.steps += stats.steps
        self.drafted += stats.drafted


@dataclass
class TerminalChat:
    """One terminal conversation: the whole history, and a session holding its context window."""

    open_session: Callable[[], ChatSession]  # a fresh session: the system prompt and an empty KV cache
    count_tokens: Callable[[Messages], int]
    capacity: int  # committed tokens the session's KV cache holds
    config: GenerationConfig
    system_prompt: str = ""
    describe: str = ""  # the model, tree, precision and threads, for /stats
    history: Messages = field(default_factory=list)
    start: int = 0  # first history message inside the model's context
    session: ChatSession | None = None
    totals: ChatTotals = field(default_factory=ChatTotals)

    def reset(self) -> None:
        self.history, self.start, self.session, self.totals = [], 0, None, ChatTotals()

    def window_session(self, text: str) -> tuple[ChatSession, int]:
        """The session whose messages are the context window for ``text``, and how many turns
        left the context just now. Raises TooLongError when ``text`` alone does not fit."""
        reserve = self.config.max_new_tokens + CONTEXT_MARGIN
        window = fit_window(self.history, text, self.system_prompt, start=self.start,
                            count_tokens=self.count_tokens, capacity=self.capacity, reserve=reserve)
        left = turns_before(self.history, window.start) - turns_before(self.history, self.start)
        self.start = window.start
        wanted = system_messages(self.system_prompt) + self.history[self.start:]
        if self.session is None or self.session.messages != wanted:
            self.session = None  # free the old KV cache before allocating the new one
            self.session = self.open_session()
            self.session.messages.extend(dict(m) for m in self.history[self.start:])
        return self.session, left

    def reply(self, session: ChatSession, text: str, on_text: Callable[[str], None],
              cancel: threading.Event) -> ReplyStats:
        """Stream the reply to ``text`` on ``session`` (from ``window_session``); the turn joins
        the history even when stopped part way, as far as it got."""
        before = len(session.messages)
        try:
            stats = stream_reply(session, text, self.config, on_text, cancel)
        except (ContextFullError, KeyboardInterrupt):
            self.session = None  # rebuilt from the history next time
            raise
        finally:
            if len(session.messages) == before + 2:  # the message and its reply (or its beginning)
                self.history += [dict(m) for m in session.messages[-2:]]
        self.totals.add(stats)
        return stats

    def stats_text(self) -> str:
        t = self.totals
        in_context = turns_before(self.history, len(self.history)) - turns_before(self.history, self.start)
        speed = t.tokens / t.seconds if t.seconds > 0 else 0.0
        accepted = t.drafted / t.steps if t.steps else 0.0
        return (f"{self.describe}\n{t.replies} replies, {t.tokens} tokens, {speed:.1f} tok/s, "
                f"{accepted:.2f} tokens/step\n{in_context} of {turns_before(self.history, len(self.history))} "
                f"turns in the model's context of {self.capacity} tokens")


def _command(chat: TerminalChat, line: str) -> bool:
    """Run a /command; False when the chat should end."""
    word = line.strip().split()[0].lower()
    if word in ("/quit", "/exit"):
        return False
    if word == "/new":
        chat.reset()
        print("[new chat]", file=sys.stderr)
    elif word == "/stats":
        print(chat.stats_text(), file=sys.stderr)
    elif word == "/help":
        print(HELP, file=sys.stderr)
    else:
        print(f"unknown command {word}; /help lists them", file=sys.stderr)
    return True


def _turn(chat: TerminalChat, text: str) -> None:
    cancel = threading.Event()
    try:
        session, left = chat.window_session(text)
        if left:
            print(f"[{left} earlier turn{'s' if left > 1 else ''} left the model's context]", file=sys.stderr)
        print("bot> ", end="", flush=True)
        stats = chat.reply(session, text, lambda s: print(s, end="", flush=True), cancel)
    except KeyboardInterrupt:
        cancel.set()
        print("\n[stopped]", file=sys.stderr)
        return
    except TooLongError as exc:
        print(f"error: {exc} The message was not sent.", file=sys.stderr)
        return
    except SpecMemoError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return
    print(f"\n{status_line(stats)}", file=sys.stderr)


def chat_loop(chat: TerminalChat) -> int:
    """Read lines until /quit or end of input; each other non-empty line is a message."""
    while True:
        try:
            line = input("\nyou> ")
        except EOFError:
            return 0
        if not line.strip():
            continue
        if line.lstrip().startswith("/"):
            if not _command(chat, line):
                return 0
            continue
        _turn(chat, line)


def run(args: argparse.Namespace) -> int:
    from specmemo_core.cli.loading import load_for_chat

    config = generation_config(args)
    loaded = load_for_chat(args)
    chat = TerminalChat(loaded.open_session, loaded.count_tokens, loaded.capacity, config,
                        system_prompt=args.system or "", describe=loaded.describe)
    print(f"SpecMemo chat: {loaded.describe}. /help lists commands; /quit or Ctrl-D leaves, Ctrl-C stops a reply.",
          file=sys.stderr)
    return chat_loop(chat)
