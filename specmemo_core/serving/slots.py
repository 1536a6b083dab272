"""The decoder the scheduler drives: a few sequences decoded together, one step at a time.

Vocabulary: a *sequence* is one request's prompt and reply, named by the scheduler's
``seq_id``; a *slot* is room for one sequence in the decoder (its KV cache); a *step*
is one forward that gives every active sequence zero or more new tokens. A sequence is
*finished* when the decoder has ended it (a stop token, or ``max_new_tokens``); the
scheduler then ``remove``s it, as it does a sequence it ends itself (a stop string, a
client that left).

``runtime.batch.BatchDecoder`` is the one implementation (``serving.served.serve_engine``
builds it); ``SlotDecoder`` is what the scheduler relies on: ``add`` is called only while
``free_slots`` > 0, and may raise a ``SpecMemoError`` to refuse one sequence alone;
``step`` leaves stop tokens out, gives a sequence at most its ``max_new_tokens`` in all
(the scheduler cuts anyway), may leave out a sequence that made no token; ``finished``
holds the ids the latest step ended; ``remove`` is called exactly once for every
sequence added, finished or not (a no-op for one the decoder already ended).
"""

from __future__ import annotations

from typing import Collection, Hashable, Protocol, Sequence

from specmemo_core.runtime.decoding import GenerationConfig


class SlotDecoder(Protocol):
    """What the scheduler needs of a decoder (``runtime.batch.BatchDecoder``'s interface)."""

    finished: Collection[Hashable]  # the ids the latest ``step`` ended (a stop token or ``max_new_tokens``)

    @property
    def free_slots(self) -> int:
        """Sequences that ``add`` may still take now."""
        ...

    def add(self, seq_id: Hashable, prompt_ids: Sequence[int], *, max_new_tokens: int,
            config: GenerationConfig) -> None:
        """Start a sequence."""
        ...

    def step(self) -> dict[Hashable, list[int]]:
        """One step of every active sequence: the tokens each emitted (stop tokens left out)."""
        ...

    def remove(self, seq_id: Hashable) -> bool:
        """Forget a sequence (finished or not) and free its slot."""
        ...
