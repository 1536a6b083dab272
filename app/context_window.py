"""The context window of a chat (``specmemo_core.runtime.context_window``), worded for the window."""

from __future__ import annotations

from specmemo_core.runtime import context_window as _core
from specmemo_core.runtime.context_window import Messages, Window, system_messages

__all__ = ["Messages", "TooLongError", "Window", "fit_window", "system_messages"]


class TooLongError(_core.TooLongError):
    """The core's refusal, saying where the unsent text stays in the app."""

    def __str__(self) -> str:
        return super().__str__().rstrip(".") + "; the text is kept in the input box."


def fit_window(history: Messages, user_text: str, system_prompt: str, *, start: int, count_tokens, capacity: int,
               reserve: int, fewest: int = 0) -> Window:
    try:
        return _core.fit_window(history, user_text, system_prompt, start=start, count_tokens=count_tokens,
                                capacity=capacity, reserve=reserve, fewest=fewest)
    except _core.TooLongError as exc:
        raise TooLongError(exc.needed, exc.reserve, exc.capacity, bound=exc.bound) from None
