"""The decoding loop: prefill, then one step after another (``step.py``: propose →
verify on the tree → accept → commit), until a stop token or the token budget.

Greedy speculative output equals plain greedy output whatever the heads propose: every
emitted token is an argmax of the base model given exactly the tokens before it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Sequence

import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.heads import ContextLayer, DraftHeads
from specmemo_core.runtime.kv_cache import KVCache
from specmemo_core.runtime.model import CausalLM
from specmemo_core.runtime.step import (Acceptance, GreedyAcceptance, Launched, StepParts, StepUnit,
                                         TypicalAcceptance, finish_prefill, prefill)
from specmemo_core.runtime.tree import Tree, TreeBuffers, load_tree

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory on long prompts


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    # Medusa's typical acceptance (temperature > 0): accept a draft token whose
    # probability exceeds min(epsilon, delta * exp(-entropy)).
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    top_p: float = 1.0  # sampling only: the nucleus each distribution is cut to

    def __post_init__(self) -> None:
        if not self.max_new_tokens >= 1:
            raise SpecMemoError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise SpecMemoError(f"temperature must be a number ≥ 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpecMemoError(f"top_p must be above 0 and at most 1, got {self.top_p}")


@dataclass(frozen=True)
class Step:
    """What one forward produced: the new tokens and how long the forward took."""

    token_ids: tuple[int, ...]
    accepted: int  # tokens the verification accepted (drafts + bonus), before any stop or budget cut
    forward_s: float
    tree_nodes: int
    prefill: bool = False
    ended: bool = False  # a stop token among them ended the reply (it is not in token_ids)

    @property
    def reply_tokens(self) -> int:
        """What this step gave the reply: the tokens kept and the stop token that ended it.
        ``accepted`` also counts what a long accepted run brought past a stop token or the
        token budget, which no reply gets: a reply's last step can add up to a chain's length
        to a mean of it (`dynamic-48+lookup-64`, 20 MT-Bench replies of 128 tokens: 4.50 a step
        accepted, 3.91 kept)."""
        return len(self.token_ids) + self.ended



@dataclass
class ReplyStats:
    """Running totals over one reply's steps: what the command line prints (and its
    ``--json``) and what the app shows and stores with a reply. Fed by ``add``."""

    text: str = ""
    tokens: int = 0  # tokens emitted (the first one, after the prefill, included)
    seconds: float = 0.0  # since the message was sent
    prefill_s: float = 0.0  # reading the prompt, up to the first token
    steps: int = 0  # verify steps after the prefill
    drafted: int = 0  # tokens those steps gave the reply (``Step.reply_tokens``)
    step_times: list[float] = field(default_factory=list)  # each verify step's forward_s
    stopped: bool = False  # cancelled before the reply ended
    context_turns_dropped: int = 0  # turns of this conversation outside the model's context

    def add(self, step: Step, text: str, elapsed_s: float) -> None:
        """Count ``step``, which made ``text`` final, ``elapsed_s`` after the message was sent."""
        self.tokens += len(step.token_ids)
        self.text += text
        self.seconds = elapsed_s
        if step.prefill:
            self.prefill_s = elapsed_s
        elif step.accepted:
            self.steps += 1
            self.drafted += step.reply_tokens
            self.step_times.append(step.forward_s)

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: tokens after the first over the time after the prefill."""
        decoding = self.seconds - self.prefill_s
        return (self.tokens - 1) / decoding if self.steps and decoding > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, object]:
        """The totals without the text and step times (rounded), as the chat store keeps them."""
        out = asdict(self)
        del out["text"], out["step_times"]
        out.update(seconds=round(self.seconds, 4), prefill_s=round(self.prefill_s, 4),
                   tokens_per_s=round(self.tokens_per_s, 3), mean_accepted=round(self.mean_accepted, 3))
        return out


def take_tokens(tokens: Sequence[int], config: GenerationConfig, emitted: int) -> tuple[list[int], bool]:
    """The tokens of a step a reply keeps, ``emitted`` tokens into it: up to the first stop
    token (not kept) or the token budget; and whether a stop token ended the reply."""
    out: list[int] = []
    for tok in tokens:
        if emitted + len(out) >= config.max_new_tokens:
            break
        if tok in config.stop_token_ids:
            return out, True
        out.append(tok)
    return out, False


def acceptance_for(config: GenerationConfig) -> Acceptance:
    """Greedy at temperature 0, else typical acceptance sampling from ``config.seed``."""
    if config.temperature == 0.0:
        return GreedyAcceptance()
    return TypicalAcceptance(config.temperature, config.typical_epsilon, config.typical_delta,
                             torch.Generator(device="cpu").manual_seed(config.seed), top_p=config.top_p)


@dataclass
class Decoder:
    """One conversation's decoding state over a model, optional heads and a tree.

    ``history`` mirrors the token ids whose KV sits in ``cache`` (``len == cache.length``),
    so a new turn re-uses every cached token it shares with the previous one.
    """

    model: CausalLM
    cache: KVCache
    heads: DraftHeads | None = None
    tree: Tree | None = None
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tree is not None:
            if not self.tree.drafts:
                self.heads = None  # a lookup chain alone (or a 1-node tree): the heads would draft nothing
            self.tree.check_heads(self.heads)
        device = self.model.device
        self._buffers = self.tree.buffers.to(device) if self.speculative else None
        self._single = load_tree("single").buffers.to(device)  # the plain step's 1-node tree
        # The heads' context layer (if any) keeps its own one-layer cache in lock-step
        # with ``cache``: allocated here, once, at the same capacity.
        context = self.heads.context if self.speculative and self.heads is not None else None
        self.parts = StepParts(
            self.model, self.cache, self.heads if self.speculative else None, context,
            self._new_context_cache(context) if context is not None else None,
            root=torch.zeros((), dtype=torch.long, device=device),
            state=torch.zeros(self.model.spec.hidden_size, dtype=self.model.dtype, device=device),
        )
        # a step started ahead and not read (``generate``): undone by the generator that started
        # it when its reply ends, or, if that generator was dropped unfinished, by the next call
        self._ahead: Launched | None = None

    def _new_context_cache(self, context: ContextLayer) -> KVCache:
        return context.new_cache(self.cache.capacity, self.model.dtype, self.model.device)

    @property
    def speculative(self) -> bool:
        """A tree to verify: heads' nodes (given heads) and/or a lookup chain."""
        return self.tree is not None and self.tree.speculates(self.heads)

    @property
    def context_cache(self) -> KVCache | None:
        return self.parts.context_cache

    def reset(self) -> None:
        self.cache.reset()
        if self.context_cache is not None:
            self.context_cache.reset()
        self.history.clear()

    # -- prefill ---------------------------------------------------------------
    def _reuse_prefix(self, prompt_ids: Sequence[int]) -> list[int]:
        """Truncate the cache to the longest prefix shared with ``prompt_ids``; return the rest."""
        common = 0
        for a, b in zip(self.history, prompt_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt_ids) - 1)  # at least one token must run
        if self.context_cache is not None:  # a prefill cut before its pending position ran (``step.prefill``)
            common = min(common, self.context_cache.length)
        self.cache.truncate(common)
        if self.context_cache is not None:
            self.context_cache.truncate(common)
        del self.history[common:]
        return list(prompt_ids[common:])

    @torch.inference_mode()
    def _prefill(self, new_ids: list[int]) -> torch.Tensor:
        """Run the new prompt tokens chunk by chunk (``step.prefill``); return the last one's
        hidden state [1, D], and leave its draft state in ``parts.state``."""
        try:
            return self._prefill_chunks(new_ids)
        finally:  # what the caches hold, even if a chunk failed
            self.history.extend(new_ids[: self.cache.length - len(self.history)])

    def _prefill_chunks(self, new_ids: list[int]) -> torch.Tensor:
        """The prefill itself (``step.prefill``); a static decoder may pad chunks to fixed shapes."""
        return prefill(self.parts, new_ids, chunk=PREFILL_CHUNK)

    # -- generation ------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int], config: GenerationConfig, cancel: threading.Event | None = None
    ) -> Iterator[Step]:
        """Yield Steps until a stop token, ``max_new_tokens`` or ``cancel`` is set.

        ``prompt_ids``: the whole conversation so far, chat template applied. Tokens it
        shares with the cache are not run again.
        """
        if not prompt_ids:
            raise SpecMemoError("the prompt is empty: type a message first")
        self._drop_ahead()  # left by a reply whose stream was dropped unfinished
        acceptance = acceptance_for(config)
        new_ids = self._reuse_prefix(prompt_ids)
        t0 = time.perf_counter()
        with torch.inference_mode():
            root = acceptance.first(self.model, self._prefill(new_ids))
            self.parts.root.fill_(root)
            finish_prefill(self.parts)
        emitted = 1
        stop = root in config.stop_token_ids
        yield Step((root,) if not stop else (), 1, time.perf_counter() - t0, len(new_ids), prefill=True, ended=stop)
        ahead = self._overlaps(acceptance)
        next_step: tuple[StepUnit, Launched] | None = None
        try:
            while not stop and emitted < config.max_new_tokens:
                if cancel is not None and cancel.is_set():
                    return
                if next_step is None:
                    t0 = time.perf_counter()
                    next_step = self._launch(acceptance, ahead=0)
                (unit, launched), next_step = next_step, None
                if ahead and emitted + 1 < config.max_new_tokens:  # this step may not end the reply:
                    next_step = self._launch(acceptance, ahead=unit.nodes)  # the next one runs meanwhile
                self._ahead = next_step[1] if next_step is not None else None
                tokens = launched.read()
                now = time.perf_counter()
                dt, t0 = now - t0, now  # since the last result
                self.history.append(root)  # the root's KV is committed now, and the accepted drafts'
                self.history.extend(tokens[:-1])
                root = tokens[-1]
                out, stop = take_tokens(tokens, config, emitted)
                emitted += len(out)
                yield Step(tuple(out), len(tokens), dt, unit.nodes, ended=stop)
        finally:  # a step started for a reply that has ended: its commits undone
            if next_step is not None and self._ahead is next_step[1]:
                self._drop_ahead()

    def _drop_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.discard()

    def _overlaps(self, acceptance: Acceptance) -> bool:
        """Whether each step starts before the last one is read (``StaticDecoder``); a cache
        whose length lives on the host cannot run ahead of it."""
        return False

    def _launch(self, acceptance: Acceptance, *, ahead: int) -> tuple[StepUnit, Launched] | None:
        """Start the next step, ``ahead`` tokens (which a step in flight may commit) after the
        cache's host length; None where it might not fit then (with none in flight: the
        unit's ``ContextFullError``)."""
        if ahead and self.cache.free_slots() < ahead + 1:
            return None
        unit = self._unit(acceptance, ahead=ahead)
        return None if unit is None else (unit, unit.launch(ahead=ahead))

    def _next_buffers(self, ahead: int = 0) -> TreeBuffers:
        """The tree of the next step (``ahead``: as in ``_launch``): the decoder's, or the
        1-node tree (a plain step) when it does not speculate or its tree no longer fits the cache."""
        if self.speculative and self.cache.free_slots() >= ahead + self.tree.num_nodes:
            return self._buffers
        return self._single

    def _unit(self, acceptance: Acceptance, *, ahead: int = 0) -> StepUnit | None:
        """The step unit of the next step (here made for it: eager units cost nothing; None
        only where one would have to be captured while a step is in flight: ``StaticDecoder``)."""
        return StepUnit(self.parts, self._next_buffers(ahead), acceptance)
