"""Continuous batching: B sequences decoded together, one verify forward per step.

``BatchDecoder`` keeps up to ``slots`` sequences, each in its own row of one
``batch_cache.BatchKVCache`` (allocated once: slots × capacity tokens). A step is
``step.py``'s one step over the rows that hold sequences: every sequence's tree is
drafted, laid out at its own positions and verified in one forward ([B, N] tokens), and
each sequence accepts and commits its own count. Sequences join between steps (their
prompt is prefilled alone, into their row) and leave between steps; a new request never
waits for the others to finish.

Interface (what a server drives)::

    dec = BatchDecoder(model, slots=8, capacity=2048, heads=heads, tree=tree)
    dec.add(seq_id, prompt_ids, max_new_tokens=256, config=GenerationConfig(...))
    while dec.active:
        for seq_id, tokens in dec.step().items():   # tokens each sequence emitted this step
            ...                                      # (the first one, from the prefill, included)
        for seq_id in dec.finished:                  # ended in that step: stop token, budget,
            ...                                      # or a full slot (dec.finish_reasons)
    dec.remove(seq_id)                               # cancel: the slot is free at once

- ``add(seq_id, prompt_ids, *, max_new_tokens, config)`` prefills the prompt now and
  raises ``BatchFullError`` (no free slot), ``PromptTooLongError`` (the prompt does not
  fit a slot) or ``BatchError`` (an id already decoding, an empty prompt).
- ``step() -> dict[seq_id, list[int]]``: every sequence decoding at the start of the step
  is a key (a finished one with its last tokens, stop token excluded). A sequence that
  ends is in ``finished`` (ids that ended in the latest step) and its slot is free.
- ``remove(seq_id) -> bool`` ends a sequence between steps (False: it was not decoding).
- ``active`` (ids decoding), ``free_slots``, ``slots``, ``capacity``.

Greedy sequences give exactly the tokens the single-sequence ``Decoder`` gives for the same
prompt, whatever the tree and whoever shares the batch (tests/core/test_batch_decoding.py).
Sampled sequences (temperature > 0) accept by Medusa's typical acceptance row by row, each
with its own generator seeded from its config; the batch then runs eagerly.

A grown tree (``dynamic-N``, ``growth.py``) grows one tree per sequence each step, from
that sequence's own heads' confidences: the step's layout then has a leading batch axis
(per-row depths, masks and retrieval rows), in the same fixed shapes.

Rows: the sequences always sit in rows 0…n-1 (one leaving moves the last one into its
row), and a step runs over the smallest batch bucket (1, 2, 4, … ``slots``) that holds
them, so its shapes are fixed per (bucket, tree, span): one CUDA graph each.
``graphs=True`` captures those greedy units on CUDA (``step.StepUnit.capture``): device
lengths, no host read inside a step; on an H200 every reply of the tiny-model tests equals
batched plain with graphs, grown trees included (tests/core/test_batch_decoding.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Sequence

import torch

from specmemo_core.errors import BatchError, BatchFullError, PromptTooLongError
from specmemo_core.runtime.batch_cache import BatchKVCache
from specmemo_core.runtime.decoding import PREFILL_CHUNK, GenerationConfig, acceptance_for, take_tokens
from specmemo_core.runtime.heads import DraftHeads
from specmemo_core.runtime.staged_prefill import StagedPrefill
from specmemo_core.runtime.model import CausalLM
from specmemo_core.runtime.step import (Acceptance, GreedyAcceptance, RowAcceptance, StepParts, StepUnit,
                                         finish_prefill, prefill)
from specmemo_core.runtime.tree import Tree, TreeBuffers, load_tree


@dataclass
class _Sequence:
    """One sequence's host-side state."""

    seq_id: Hashable
    row: int
    config: GenerationConfig
    acceptance: Acceptance
    emitted: int = 0  # tokens reported or pending
    pending: tuple[int, ...] = ()  # emitted but not yet reported (the prefill's token)
    reason: str | None = None  # why it ended ("stop", "length"); None: decoding


def buckets(slots: int) -> tuple[int, ...]:
    """Batch sizes a step runs at: powers of two below ``slots``, then ``slots``."""
    out, b = [], 1
    while b < slots:
        out.append(b)
        b *= 2
    return (*out, slots)


class BatchDecoder:
    """Up to ``slots`` sequences over one model, optional heads and one tree (module doc)."""

    def __init__(self, model: CausalLM, *, slots: int, capacity: int, heads: DraftHeads | None = None,
                 tree: Tree | None = None, graphs: bool = False, staged_prefill: bool | None = None) -> None:
        """``staged_prefill``: prefill joining prompts of up to ``PREFILL_CHUNK`` tokens through
        ``staged_prefill.StagedPrefill`` (None: where steps replay CUDA graphs, so prompts do
        too); longer prompts, and False, prefill eagerly into their row."""
        if tree is not None:
            if not tree.drafts:
                heads = None  # a lookup chain alone: the heads would draft nothing
            tree.check_heads(heads)
        self.model, self.tree, self.graphs = model, tree, graphs
        self.speculative = tree is not None and tree.speculates(heads)
        self.heads = heads if self.speculative else None
        nodes = tree.num_nodes if self.speculative else 1
        if slots < 1 or capacity <= nodes:
            raise BatchError(f"a batch needs at least one slot and more than {nodes} tokens of capacity per slot "
                             f"(the tree's scratch), got {slots} slots of {capacity}")
        s, device = model.spec, model.device
        self.cache = model.layer_cache(lambda layers, at: BatchKVCache(
            layers, s.num_kv_heads, s.head_dim, capacity, rows=slots, dtype=model.dtype, device=at))
        self.context = self.heads.context if self.heads is not None else None
        m = self.context.mspec if self.context is not None else None
        self.context_cache = (BatchKVCache(1, m.num_kv_heads, m.head_dim, capacity, rows=slots, dtype=model.dtype,
                                           device=device) if m is not None else None)
        self.roots = torch.zeros(slots, dtype=torch.long, device=device)  # [slots]
        self.states = torch.zeros(slots, s.hidden_size, dtype=model.dtype, device=device)  # [slots, D]
        self._buffers = tree.buffers.to(device) if self.speculative else None
        self._single = load_tree("single").buffers.to(device)
        self._parts = {b: self._rows(0, b) for b in buckets(slots)}  # made once: fixed addresses
        self._units: dict[tuple[int, int, int], StepUnit] = {}  # greedy units by (bucket, nodes, span)
        # CUDA graphs: one memory pool and one capture stream for every unit (as StaticDecoder)
        cuda = graphs and device.type == "cuda" and model.one_device  # split over two devices: eager
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self._capture_stream = torch.cuda.Stream(device) if cuda else None
        staged = (cuda if staged_prefill is None else staged_prefill) and model.one_device
        self._staged = (StagedPrefill(model, self.heads, max_tokens=min(PREFILL_CHUNK, capacity), graphs=cuda,
                                      pool=self._pool, stream=self._capture_stream) if staged else None)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._order: list[Hashable] = []  # ids by row
        self.finished: set[Hashable] = set()
        self.finish_reasons: dict[Hashable, str] = {}

    # -- what the server reads ----------------------------------------------------
    @property
    def slots(self) -> int:
        return self.cache.rows

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def active(self) -> list[Hashable]:
        return list(self._order)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self._order)

    # -- join and leave --------------------------------------------------------------
    def add(self, seq_id: Hashable, prompt_ids: Sequence[int], *, max_new_tokens: int,
            config: GenerationConfig = GenerationConfig()) -> None:
        """Prefill ``prompt_ids`` into a free slot; its first token comes with the next ``step()``."""
        self._check_new(seq_id, prompt_ids)
        config = replace(config, max_new_tokens=max_new_tokens)
        row = len(self._order)
        seq = _Sequence(seq_id, row, config, acceptance_for(config))
        for cache in self._caches():
            cache.open_row(row)
        try:
            with torch.inference_mode():
                if self._staged is not None and self._staged.fits(len(prompt_ids)):
                    hidden = self._staged(list(prompt_ids), cache=self.cache, context_cache=self.context_cache,
                                          row=row, state=self.states)  # [1, 1, D]
                else:
                    hidden = prefill(self._rows(row, row + 1), list(prompt_ids), chunk=PREFILL_CHUNK)
                root = seq.acceptance.first(self.model, hidden[0])
                self.roots[row] = root
                finish_prefill(self._rows(row, row + 1))
        except BaseException:
            for cache in self._caches():
                cache.close_row(row)
            raise
        self._seqs[seq_id] = seq
        self._order.append(seq_id)
        kept, stop = take_tokens([root], config, 0)
        seq.pending, seq.emitted = tuple(kept), len(kept)
        if stop or seq.emitted >= config.max_new_tokens:
            seq.reason = "stop" if stop else "length"

    def _check_new(self, seq_id: Hashable, prompt_ids: Sequence[int]) -> None:
        if seq_id in self._seqs:
            raise BatchError(f"sequence {seq_id!r} is already decoding; give each request its own id, or remove "
                             "it first")
        if not prompt_ids:
            raise BatchError(f"sequence {seq_id!r} has an empty prompt: send at least one token")
        if not self.free_slots:
            raise BatchFullError(f"all {self.slots} batch slots are taken; wait for a sequence to finish (or remove "
                                 "one), or make the batch decoder with more slots")
        if len(prompt_ids) + 1 > self.capacity:
            raise PromptTooLongError(f"the prompt of sequence {seq_id!r} has {len(prompt_ids)} tokens but a batch "
                                     f"slot holds {self.capacity}; shorten the prompt or make the batch decoder "
                                     "with a larger capacity per slot")

    def remove(self, seq_id: Hashable) -> bool:
        """End ``seq_id`` now and free its slot; False if it was not decoding (finished
        already, or never added), so a server may call it on any disconnect."""
        if seq_id not in self._seqs:
            return False
        self._leave(seq_id)
        return True

    def _leave(self, seq_id: Hashable) -> None:
        """Free the sequence's row; the last row's sequence moves into it (rows stay 0…n-1)."""
        seq = self._seqs.pop(seq_id)
        last = len(self._order) - 1
        moved = self._order[last]
        self._order[seq.row] = moved
        self._order.pop()
        if moved != seq_id:
            for cache in self._caches():
                cache.move_row(last, seq.row)
            self.roots[seq.row] = self.roots[last]
            self.states[seq.row] = self.states[last]
            self._seqs[moved].row = seq.row
        else:
            for cache in self._caches():
                cache.close_row(last)

    # -- a step -------------------------------------------------------------------------
    def step(self) -> dict[Hashable, list[int]]:
        """One verify forward over every decoding sequence: the tokens each emitted."""
        self.finished, self.finish_reasons = set(), {}
        out = {seq.seq_id: list(seq.pending) for seq in self._seqs.values()}
        for seq in self._seqs.values():
            seq.pending = ()
            if seq.reason is None and self.cache.row_length(seq.row) + 1 > self.capacity:
                seq.reason = "length"  # its slot is full: the reply ends here
        running = [seq for seq in self._seqs.values() if seq.reason is None]
        if running:
            rows = self._run_unit(running)
            for seq in running:
                kept, stop = take_tokens(rows[seq.row], seq.config, seq.emitted)
                out[seq.seq_id] += kept
                seq.emitted += len(kept)
                if stop or seq.emitted >= seq.config.max_new_tokens:
                    seq.reason = "stop" if stop else "length"
        for seq in [s for s in self._seqs.values() if s.reason is not None]:
            self.finished.add(seq.seq_id)
            self.finish_reasons[seq.seq_id] = seq.reason
            self._leave(seq.seq_id)
        return out

    def _run_unit(self, running: list[_Sequence]) -> list[list[int]]:
        """Run the step over the bucket that holds every row; each row's emitted tokens.
        Rows of sequences that ended (still in place) are masked off first."""
        for seq in self._seqs.values():
            if seq.reason is not None:
                for cache in self._caches():
                    cache.close_row(seq.row)
        bucket = next(b for b in buckets(self.slots) if b >= len(self._order))
        parts = self._parts[bucket]
        buffers = self._next_buffers(parts.cache)
        span = parts.cache.span_for(buffers.depths.shape[0])
        rules = [GreedyAcceptance()] * bucket
        for seq in running:
            rules[seq.row] = seq.acceptance
        if all(rule.graph_safe for rule in rules):
            unit = self._greedy_unit(bucket, buffers, span)
        else:
            unit = StepUnit(parts, buffers, RowAcceptance(tuple(rules)), span=span)
        return unit()

    def _next_buffers(self, cache: BatchKVCache) -> TreeBuffers:
        """The tree, or the 1-node tree when a sequence's slot has no room for the tree."""
        if self.speculative and cache.free_slots() >= self.tree.num_nodes:
            return self._buffers
        return self._single

    def _greedy_unit(self, bucket: int, buffers: TreeBuffers, span: int) -> StepUnit:
        key = (bucket, buffers.depths.shape[0], span)
        if key not in self._units:
            unit = StepUnit(self._parts[bucket], buffers, GreedyAcceptance(), span=span)
            if self._capture_stream is not None:
                unit.capture(pool=self._pool, stream=self._capture_stream)
            self._units[key] = unit
        return self._units[key]

    # -- parts over rows ------------------------------------------------------------------
    def _caches(self) -> list[BatchKVCache]:
        return [c for c in (self.cache, self.context_cache) if c is not None]

    def _rows(self, start: int, stop: int) -> StepParts:
        """The step's parts over rows ``start:stop`` (views: they share every tensor)."""
        ctx = self.context_cache.rows_view(start, stop) if self.context_cache is not None else None
        return StepParts(self.model, self.cache.rows_view(start, stop), self.heads, self.context, ctx,
                         root=self.roots[start:stop], state=self.states[start:stop])
