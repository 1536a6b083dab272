"""The decoder the scheduler drives: a few sequences decoded together, one step at a time.

Vocabulary: a *sequence* is one request's prompt and reply, named by the scheduler's
``seq_id``; a *slot* is room for one sequence in the decoder (its KV cache); a *step*
is one forward that gives every active sequence zero or more new tokens. A sequence is
*finished* when the decoder has ended it (a stop token, or ``max_new_tokens``); the
scheduler then ``remove``s it, as it does a sequence it ends itself (a stop string, a
client that left).

``SlotDecoder`` is the seam: the batched ``runtime/batch.py`` ``BatchDecoder`` is meant
to be one; until it lands, ``InterimSingleSlotDecoder`` is one with a single slot over
the existing ``runtime.decoding.Decoder``.

Swapping in ``BatchDecoder``: build it in ``serving.served.serve_engine`` instead of the
interim one (``ServeLimits.context_tokens`` stays what one sequence may hold, prompt plus
reply) and add it to ``SLOT_DECODERS`` in ``tests/core/test_serving.py``. What the
scheduler relies on: ``add`` is called only while ``free_slots`` > 0, and may raise a
``SpecMemoError`` to refuse one sequence alone; ``step`` leaves stop tokens out, gives a
sequence at most its ``max_new_tokens`` in all (the scheduler cuts anyway), may leave out
a sequence that made no token; ``finished(seq_id)`` turns True in the step that ends it;
``remove`` is called exactly once for every sequence added, finished or not.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

from specmemo_core.runtime.decoding import Decoder, GenerationConfig, Step


class SlotDecoder(Protocol):
    """What the scheduler needs of a decoder (``runtime.batch.BatchDecoder``'s interface)."""

    @property
    def free_slots(self) -> int:
        """Sequences that ``add`` may still take now."""
        ...

    def add(self, seq_id: int, prompt_ids: Sequence[int], *, max_new_tokens: int,
            config: GenerationConfig) -> None:
        """Start a sequence; its prompt is read during the next ``step``s."""
        ...

    def step(self) -> dict[int, list[int]]:
        """One step of every active sequence: the tokens each emitted (stop tokens left out)."""
        ...

    def remove(self, seq_id: int) -> None:
        """Forget a sequence (finished or not) and free its slot."""
        ...

    def finished(self, seq_id: int) -> bool:
        """True once the decoder has ended ``seq_id`` (a stop token or ``max_new_tokens``)."""
        ...


class InterimSingleSlotDecoder:
    """NOTE: interim B=1 ``SlotDecoder`` until ``runtime.batch.BatchDecoder`` lands: one
    slot over one ``Decoder`` (its KV cache allocated once, by the caller), so requests
    are decoded one after another and the others wait in the scheduler's queue. The
    decoder keeps the previous sequence's KV cache: a request that repeats the previous
    one's opening (a chat client re-sending the conversation) does not read it again."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder
        self.seq_id: int | None = None
        self._steps: Iterator[Step] | None = None
        self._done = False
        self._max_new = 0
        self._emitted = 0

    @property
    def free_slots(self) -> int:
        return 0 if self.seq_id is not None else 1

    def add(self, seq_id: int, prompt_ids: Sequence[int], *, max_new_tokens: int,
            config: GenerationConfig) -> None:
        if self.seq_id is not None:
            raise RuntimeError(f"the single slot is taken by sequence {self.seq_id}")  # a scheduler bug
        if max_new_tokens != config.max_new_tokens:
            config = GenerationConfig(**{**config.__dict__, "max_new_tokens": max_new_tokens})
        self.seq_id, self._max_new, self._emitted, self._done = seq_id, max_new_tokens, 0, False
        self._steps = self.decoder.generate(list(prompt_ids), config)

    def step(self) -> dict[int, list[int]]:
        if self.seq_id is None or self._done:
            return {}
        try:
            step = next(self._steps)
        except StopIteration:
            self._done = True
            return {self.seq_id: []}
        except BaseException:
            self.decoder.reset()  # the cache may be half-written: the next sequence starts clean
            raise
        self._emitted += len(step.token_ids)
        # the decoder cuts a step at a stop token (fewer tokens than it accepted) and at the budget
        self._done = len(step.token_ids) < step.accepted or self._emitted >= self._max_new
        return {self.seq_id: list(step.token_ids)}

    def remove(self, seq_id: int) -> None:
        if seq_id != self.seq_id:
            return
        if self._steps is not None:
            self._steps.close()
        self.seq_id, self._steps, self._done = None, None, False

    def finished(self, seq_id: int) -> bool:
        return seq_id == self.seq_id and self._done
