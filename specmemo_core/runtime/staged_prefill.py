"""Prefill a sequence joining a batch through a one-row staging cache, replayed as CUDA graphs.

Why: a batch decoder's steps replay CUDA graphs, but each joining request's prompt was
prefilled eagerly, one kernel launch at a time. On an H200 with the default model that is
~12 ms a prompt against ~2–3 ms a step, and at 8 slots the 20 MT-Bench requests spent
45% of the speculative run's time in prefills (docs/results/batch_profile_h200/), which
capped batched speculation's gain over batched plain decoding.

How: the prompt is written, padded, into a fixed buffer and run at the smallest bucket
length that holds it (16, 32, … ``max_tokens``) in a one-row cache of its own, always
from position 0 — so each bucket's forward has fixed shapes and addresses and is captured
once. Padding sits after the prompt and the mask is causal, so the prompt's own keys,
values and hidden states are those of an unpadded prefill. Its first ``n`` slots are then
copied into the sequence's row of the batch cache (and of the heads' context cache).

Without graphs (a CPU, or ``graphs=False``) the same code runs eagerly, which is how the
CPU tests check it against the plain prefill. A model split over several devices
(``split.py``) prefills eagerly into its row instead: the staging row is on one device.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from specmemo_core.runtime.batch_cache import BatchKVCache
from specmemo_core.runtime.heads import ContextLayer, DraftHeads
from specmemo_core.runtime.kv_cache import span_ladder
from specmemo_core.runtime.model import CausalLM
from specmemo_core.runtime.step import StepParts, capture_graph, padded_prefill, reads_next

MIN_BUCKET = 16


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """Prompt lengths a staged prefill runs at: 16, 32, … up to ``max_tokens`` (included)."""
    return span_ladder(max_tokens, MIN_BUCKET)


class StagedPrefill:
    """Prompts of up to ``max_tokens`` prefilled in a staging row (module doc)."""

    def __init__(self, model: CausalLM, heads: DraftHeads | None, *, max_tokens: int, graphs: bool,
                 pool=None, stream: torch.cuda.Stream | None = None) -> None:
        s, device, dtype = model.spec, model.device, model.dtype
        self.model, self.max_tokens = model, max_tokens
        self.buckets = prefill_buckets(max_tokens)
        self.cache = BatchKVCache(s.num_layers, s.num_kv_heads, s.head_dim, max_tokens, rows=1, dtype=dtype,
                                  device=device)
        context: ContextLayer | None = heads.context if heads is not None else None
        m = context.mspec if context is not None else None
        self.context_cache = (BatchKVCache(1, m.num_kv_heads, m.head_dim, max_tokens, rows=1, dtype=dtype,
                                           device=device) if m is not None else None)
        for cache in self._caches():
            cache.open_row(0)
        self.ids = torch.zeros(1, max_tokens, dtype=torch.long, device=device)  # [1, T] the padded prompt
        self.count = torch.ones(1, dtype=torch.long, device=device)  # [1] the prompt's real length
        self.parts = StepParts(model, self.cache, heads, context, self.context_cache,
                               root=torch.zeros(1, dtype=torch.long, device=device),
                               state=torch.zeros(1, s.hidden_size, dtype=dtype, device=device))
        self.graphs = graphs and device.type == "cuda"
        self._pool, self._stream = pool, stream
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, tokens: int) -> bool:
        return 0 < tokens <= self.max_tokens

    def _caches(self) -> list[BatchKVCache]:
        return [c for c in (self.cache, self.context_cache) if c is not None]

    @torch.inference_mode()
    def _run(self, t: int) -> torch.Tensor:
        """The bucket-``t`` forward from position 0: the last real token's hidden state [1, 1, D];
        its draft state is left in ``parts.state``."""
        for cache in self._caches():
            cache.length_t.zero_()
        tokens = self.ids[:, :t]  # [1, t]
        pending = reads_next(self.parts)  # then the last position waits for ``step.finish_prefill``
        following = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1) if pending else None  # [1, t] up to the last
        return padded_prefill(self.parts, tokens, following, self.count, t)

    def _forward(self, t: int) -> torch.Tensor:
        if not self.graphs:
            return self._run(t)
        if t not in self._captured:
            self._captured[t] = capture_graph(lambda: self._run(t), pool=self._pool, stream=self._stream)
        graph, out = self._captured[t]
        graph.replay()
        return out

    def __call__(self, prompt_ids: Sequence[int], *, cache: BatchKVCache, context_cache: BatchKVCache | None,
                 row: int, state: torch.Tensor) -> torch.Tensor:
        """Prefill ``prompt_ids`` into row ``row`` of ``cache`` (open and empty) and of
        ``context_cache`` (a context layer reading next tokens: all but the last position,
        which ``step.finish_prefill`` runs); the row's draft state goes to ``state[row]``. Returns the last
        prompt token's hidden state [1, 1, D] (read it before the next call: a replay
        rewrites it)."""
        n = len(prompt_ids)
        if not self.fits(n):
            raise ValueError(f"a staged prefill holds 1 to {self.max_tokens} tokens, got {n}")
        t = next(b for b in self.buckets if b >= n)
        self.ids[0, :n] = torch.tensor(prompt_ids, dtype=torch.long)
        self.count.fill_(n)
        hidden = self._forward(t)
        pending = 1 if reads_next(self.parts) else 0  # the last position waits for ``step.finish_prefill``
        for staged, target, count in ((self.cache, cache, n), (self.context_cache, context_cache, n - pending)):
            if staged is not None and target is not None:
                _copy_prefix(staged, target, row, count)
        state[row] = self.parts.state[0]
        return hidden


def _copy_prefix(staged: BatchKVCache, target: Any, row: int, n: int) -> None:
    """The staging row's first ``n`` slots into row ``row`` of ``target``, committed there.
    ``target``: a ``BatchKVCache``, or a ``split_cache.SplitCache`` of them (a model split
    into segments on one device), whose segments take consecutive layers."""
    first = 0
    for part in getattr(target, "parts", [target]):
        layers = part.k.shape[0]
        part.k[:, row, :, :n] = staged.k[first:first + layers, 0, :, :n]
        part.v[:, row, :, :n] = staged.v[first:first + layers, 0, :, :n]
        part.ids[row, :n] = staged.ids[0, :n]
        first += layers
    target.rows_view(row, row + 1).commit_prefix(n)
