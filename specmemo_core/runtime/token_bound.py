"""The fewest tokens a text can become, from its length alone: a huge message is refused before tokenizing.

Tokenizing a 1 MB message takes seconds, and the context window code may count it once per turn it tries
to drop; none of that is needed to know it cannot fit. No token covers more characters than the longest
string in the tokenizer's vocabulary (byte-level pieces spell one character per byte, and a character is at
least one byte), so a text of n characters needs at least ceil(n / longest) tokens.
"""

from __future__ import annotations

from typing import Any


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest string of ``tokenizer``'s vocabulary (at least 1).
    NOTE: a tokenizer whose normalizer deletes characters (none of the supported chat models' does) could
    need fewer tokens than this bound says; the bound is only used to refuse texts far beyond the context."""
    return max(1, max((len(piece) for piece in tokenizer.get_vocab()), default=1))


def fewest_tokens(text: str, longest: int) -> int:
    """A lower bound of ``text``'s token count when no token is longer than ``longest`` characters."""
    return -(-len(text) // max(1, longest))
