"""Text that can be tokenized and saved: lone surrogates become U+FFFD.

Python decodes undecodable bytes (a non-UTF-8 terminal, ``surrogateescape``) to lone
surrogates; UTF-8 cannot encode them, so the tokenizer and SQLite would both refuse the text.
"""

from __future__ import annotations


def encodable(text: str) -> str:
    """``text`` unchanged when it is valid Unicode, else with each lone surrogate replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)
