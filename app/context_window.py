"""Which turns stay in the model's context when a conversation outgrows its KV budget (pure).

The history keeps every turn; only the model's view slides forward by whole turns
(a user message and its reply), oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from specmemo_core.errors import SpecMemoError

Messages = list[dict[str, str]]


class TooLongError(SpecMemoError):
    """The new message alone does not fit the context."""


@dataclass(frozen=True)
class Window:
    start: int  # index into the history of the first message the model sees
    dropped_turns: int  # turns newly dropped by this call
    prompt_tokens: int


def system_messages(system_prompt: str) -> Messages:
    """The system prompt as the session's first message (none when empty)."""
    return [{"role": "system", "content": system_prompt}] if system_prompt else []


def _turn_starts(history: Sequence[dict[str, str]], start: int) -> list[int]:
    """Indices after ``start`` where a user message begins: where the window may start."""
    return [i for i in range(start + 1, len(history)) if history[i]["role"] == "user"] + [len(history)]


def fit_window(history: Messages, user_text: str, system_prompt: str, start: int,
               count_tokens: Callable[[Messages], int], capacity: int, reserve: int, *, fewest: int = 0) -> Window:
    """Slide ``start`` forward until system prompt + history[start:] + the new message + ``reserve``
    (the reply and the tree's scratch slots) fit ``capacity`` tokens.

    Raises TooLongError (with a message for the user) if even the new message alone does not fit; at once,
    without counting anything, when ``fewest`` (a lower bound of the message's tokens: the core's
    ``token_bound.fewest_tokens``) already does not fit.
    """
    if fewest + reserve > capacity:
        raise TooLongError(_too_long(f"at least {fewest}", reserve, capacity))
    system = system_messages(system_prompt)
    user = [{"role": "user", "content": user_text}]
    start = min(max(start, 0), len(history))
    candidates = [start] + _turn_starts(history, start)
    dropped = 0
    for begin in candidates:
        tokens = count_tokens(system + history[begin:] + user)
        if tokens + reserve <= capacity:
            return Window(begin, dropped, tokens)
        dropped += 1 if begin < len(history) else 0
    alone = count_tokens(system + user)
    raise TooLongError(_too_long(f"about {alone}", reserve, capacity))


def _too_long(needed: str, reserve: int, capacity: int) -> str:
    return (f"This message is too long for the model's context: it needs {needed} tokens plus {reserve} for the "
            f"reply, but the context holds {capacity}. Shorten it or split it into several messages; the text is "
            "kept in the input box.")
