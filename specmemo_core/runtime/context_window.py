"""Which turns stay in the model's context when a conversation outgrows its KV budget (pure).

The history keeps every turn; only the model's view slides forward by whole turns
(a user message and its reply), oldest first. The app's chat worker and the terminal
chat (``specmemo chat``) both slide with ``fit_window``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from specmemo_core.errors import SpecMemoError

Messages = list[dict[str, str]]
CONTEXT_MARGIN = 16  # tokens kept free besides the reply: re-encoded replies may split a little differently


class TooLongError(SpecMemoError):
    """The new message alone does not fit the context."""

    def __init__(self, needed: int, reserve: int, capacity: int, *, bound: str = "about") -> None:
        self.needed, self.reserve, self.capacity, self.bound = needed, reserve, capacity, bound
        super().__init__(
            f"This message is too long for the model's context: it needs {bound} {needed} tokens plus "
            f"{reserve} for the reply, but the context holds {capacity}. Shorten it or split it into "
            f"several messages.")


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


def fit_window(history: Messages, user_text: str, system_prompt: str, *, start: int,
               count_tokens: Callable[[Messages], int], capacity: int, reserve: int, fewest: int = 0) -> Window:
    """Slide ``start`` forward until system prompt + history[start:] + the new message + ``reserve``
    (the reply and the tree's scratch slots) fit ``capacity`` tokens.

    Raises TooLongError (with a message for the user) if even the new message alone does not fit; at once,
    without counting anything, when ``fewest`` (a lower bound of the message's tokens:
    ``token_bound.fewest_tokens``) already does not fit.
    """
    if fewest + reserve > capacity:
        raise TooLongError(fewest, reserve, capacity, bound="at least")
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
    raise TooLongError(count_tokens(system + user), reserve, capacity)


def turns_before(history: Messages, start: int) -> int:
    """Turns (user messages) of ``history`` before ``start``: those outside the model's context."""
    return sum(1 for m in history[:start] if m["role"] == "user")
