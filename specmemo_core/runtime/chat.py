"""Multi-turn chat over a Decoder: chat template, safe tokenization, streamed text.

The GUI and the command line talk to the engine only through ``ChatSession.send``, a
generator of ``TextPiece`` that can be cancelled between steps.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from specmemo_core.runtime.chat_template import render_chat_template
from specmemo_core.runtime.decoding import Decoder, GenerationConfig, Step
from specmemo_core.runtime.token_bound import fewest_tokens, longest_token_chars
from specmemo_core.errors import ContextFullError, OutOfMemoryError, SpecMemoError
from specmemo_core.text import encodable

_PLACEHOLDER = "\x00SPECMEMO{}\x00"
FLUSH = Step(token_ids=(), accepted=0, forward_s=0.0, tree_nodes=0)


@dataclass(frozen=True)
class TextPiece:
    """Text that became final during one step, with that step's statistics.

    ``send`` yields exactly one piece per decoder step (its text may be empty while a
    character or a possible stop string is incomplete), then possibly one ``FLUSH``
    piece with the held-back tail.
    """

    text: str
    step: Step


def end_of_turn_ids(tokenizer: Any, config: Any | None = None) -> frozenset[int]:
    """Token ids that end an assistant turn: the tokenizer's EOS and the model's EOS list."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def encode_conversation(
    tokenizer: Any, messages: list[dict[str, str]], known_ids: dict[int, list[int]] | None = None
) -> list[int]:
    """Apply the chat template and tokenize, keeping user text *plain*.

    A message that contains the template's own markers (e.g. ``<|im_start|>system``)
    must reach the model as ordinary text, never as special tokens. So the template is
    rendered with placeholders, its own parts are tokenized with special tokens
    recognised, and each message's content with special tokens split into plain text.
    ``known_ids[i]`` gives message i's tokens as the model generated them: re-encoding
    a reply's text can split it differently, which would cost a needless re-prefill.
    """
    if tokenizer.chat_template is None:
        raise SpecMemoError("this model's tokenizer has no chat template; use a chat/instruct model")
    placeholders = [{"role": m["role"], "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
    text = render_chat_template(tokenizer, placeholders)  # bounded: a looping template cannot hang
    ids: list[int] = []
    rest = text
    for i, message in enumerate(messages):
        marker = _PLACEHOLDER.format(i)
        before, found, rest = rest.partition(marker)
        if not found:
            raise SpecMemoError("the chat template dropped a message; this model's template is not supported")
        ids += tokenizer(before, add_special_tokens=False).input_ids
        if known_ids and i in known_ids:
            ids += known_ids[i]
        else:
            ids += tokenizer(message["content"], add_special_tokens=False, split_special_tokens=True).input_ids
    ids += tokenizer(rest, add_special_tokens=False).input_ids
    return ids


class TextStream:
    """Turns token steps into text pieces: never splits a UTF-8 character, cuts at stop strings."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.sent = 0  # characters already given out
        self.stopped = False
        self._hold = max((len(s) for s in self.stop_strings), default=1) - 1

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token_ids: tuple[int, ...], final: bool = False) -> str:
        self.ids.extend(token_ids)
        text = self.text
        for stop in self.stop_strings:
            cut = text.find(stop)
            if cut != -1:
                self.stopped = True
                text = text[:cut]
                final = True
        if not final:
            if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                text = text.rstrip("\ufffd")
            text = text[: max(self.sent, len(text) - self._hold)]
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece


def _too_long(needed: str, capacity: int) -> str:
    return (f"This message is too long for the conversation's context: with it the prompt needs {needed} tokens "
            f"plus the reply, but the context holds {capacity}. Shorten it, or start a new chat; the conversation "
            "so far is unchanged.")


class Transcript:
    """A conversation's messages as the chat template reads them, kept the same way by every
    session (``ChatSession`` here, ``serving.session.ScheduledSession`` on a server's
    scheduler): the system prompt first, each user message as plain text, each reply as
    far as it got and, where re-encoding its text would split it otherwise, the ids the
    model wrote (``reply_ids``, so the next prompt repeats them and no re-prefill is needed).
    The sessions declare ``system_prompt``, ``messages`` and ``reply_ids``."""

    system_prompt: str | None
    messages: list[dict[str, str]]
    reply_ids: dict[int, list[int]]

    def __post_init__(self) -> None:
        if self.system_prompt:
            self.messages.append({"role": "system", "content": self.system_prompt})

    def _add_user(self, user_text: str) -> None:
        if not user_text or not user_text.strip():
            raise SpecMemoError("the message is empty: type something first")
        self.messages.append({"role": "user", "content": encodable(user_text)})

    def _add_reply(self, tokenizer: Any, reply: str, ids: Sequence[int] | None) -> None:
        """Append the reply; keep ``ids`` (None: not the whole reply) when they decode to it."""
        self.messages.append({"role": "assistant", "content": reply})
        if ids is not None and tokenizer.decode(ids, skip_special_tokens=True) == reply:
            self.reply_ids[len(self.messages) - 1] = list(ids)


@dataclass
class ChatSession(Transcript):
    """One conversation: its messages and its decoder (whose KV cache spans the turns)."""

    decoder: Decoder
    tokenizer: Any
    stop_token_ids: frozenset[int]
    system_prompt: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    reply_ids: dict[int, list[int]] = field(default_factory=dict)  # message index → generated ids

    def send(
        self, user_text: str, config: GenerationConfig | None = None, cancel: threading.Event | None = None
    ) -> Iterator[TextPiece]:
        """Add the user's message and stream the reply. The reply (complete, or as far as
        it got when cancelled) is appended to ``messages`` when the generator ends."""
        config = config or GenerationConfig()
        config = GenerationConfig(**{**config.__dict__, "stop_token_ids": config.stop_token_ids | self.stop_token_ids})
        capacity = self.decoder.cache.capacity
        if user_text and len(user_text) >= capacity:  # only then can the text alone outgrow the context: bound it before tokenizing
            fewest = fewest_tokens(user_text, longest_token_chars(self.tokenizer))
            if fewest >= capacity:
                raise ContextFullError(_too_long(f"at least {fewest}", capacity))
        self._add_user(user_text)
        prompt = encode_conversation(self.tokenizer, self.messages, self.reply_ids)
        if len(prompt) >= capacity:  # refused before the cache is touched: the conversation stays usable
            self.messages.pop()
            raise ContextFullError(_too_long(str(len(prompt)), capacity))
        stream = TextStream(self.tokenizer, config.stop_strings)
        reply = ""
        try:
            steps = self.decoder.generate(prompt, config, cancel)
            for step in steps:
                piece = stream.push(step.token_ids)
                reply += piece
                yield TextPiece(piece, step)
                if stream.stopped:
                    steps.close()
                    break
            if not stream.stopped:
                tail = stream.push((), final=True)
                if tail:
                    reply += tail
                    yield TextPiece(tail, FLUSH)
        except (torch.OutOfMemoryError, MemoryError) as exc:  # the one place a reply's OOM becomes typed
            raise OutOfMemoryError(
                f"The device ran out of memory during the reply ({exc}). The conversation is kept: re-plan "
                "with a smaller context or tree (Settings), then answer it again."
            ) from exc
        finally:
            self._add_reply(self.tokenizer, reply, None if stream.stopped else stream.ids)
