"""What a base-model forward run outside torch on the CPU (llama.cpp's, ``ggml_step.py``, or
our native one, ``native/lm.py``) shows our one decoding step (``step.py``): the surface of
``model.CausalLM`` that the step and the heads read.

Such a forward scores the rows it is asked for itself (its own LM head, in the same pass
over the weights) and keeps their logits and greedy picks (``LastRows``). ``logits`` and
``greedy_picks`` give those back for rows equal to them; other rows (a head's drafts) are
scored by our own LM head over the file's embedding (int8 rows)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.cpu_linear import Int8RowLinear
from specmemo_core.runtime.kv_cache import KVCache
from specmemo_core.runtime.model import ModelSpec, rope_inverse_frequencies, rope_tables, step_tables


@dataclass
class LastRows:
    """The rows the last forward gave."""

    rows: torch.Tensor | None = None  # their hidden states [N, D]
    given: torch.Tensor | None = None  # the tensor the forward returned them in
    logits: list[np.ndarray] = field(default_factory=list)  # the forward's logits of them: N arrays [V]
    picks: torch.Tensor | None = None  # their argmax [N]

    def keep(self, out: torch.Tensor, logits: list[np.ndarray], picks: torch.Tensor) -> torch.Tensor:
        """Remember a forward's rows ``out`` [N, D] (a copy: the caller may change what it
        was given) with their logits and picks; ``out`` back."""
        self.logits, self.picks = logits, picks
        self.rows, self.given = out.clone(), out
        return out


class HostCache(KVCache):
    """A cache whose keys and values the engine outside torch holds: our cache's host
    bookkeeping (length, the token ids the lookup chain reads), and the layout of a forward
    such an engine reads (``prepare``); the engine's own cache extends it with its cells."""

    def __init__(self, capacity: int) -> None:
        super().__init__(0, 1, 1, capacity)  # no tensors of KVCache's own

    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [T] and the mask among the new tokens alone, [T, T]: the engine lets each
        see the whole committed context, so the context's columns (``KVCache.prepare``'s first
        ``length``) are not built."""
        t = offsets.shape[0]
        mask = torch.ones(t, t, dtype=torch.bool).tril_() if ancestors is None else ancestors
        return self.length + offsets, mask


class HostForwardLM(nn.Module):
    """The base model as a CPU engine outside torch runs it: ``forward`` (hidden states, in a
    subclass), ``greedy_picks``, ``logits``, ``new_cache`` (a subclass's), ``rope``,
    ``draft_embedding`` and ``lm_head`` for the heads. Its own parameters are the embedding
    and that LM head; the engine holds the rest."""

    device = torch.device("cpu")
    dtype = torch.float32
    capturable = False
    one_device = True
    streamed = None  # every layer is the engine's, none streamed (offload.py) or split (split.py)
    placement = None
    engine_name = "this backend"

    def __init__(self, config: Any, embedding: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.eval()
        self.spec = ModelSpec.from_config(config)
        self.embed_tokens = nn.Embedding.from_pretrained(embedding, freeze=True)
        self.head_weight = head  # the output matrix (the embedding itself where tied), float32
        linear = nn.Linear(head.shape[1], head.shape[0], bias=False)
        linear.weight = nn.Parameter(head, requires_grad=False)
        self.lm_head = Int8RowLinear(linear)  # what the heads draft with, and scores rows not the engine's
        inv_freq, self.rope_scale = rope_inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._threads = threading.local()  # each thread's LastRows (a forward and the picks read after it)

    @property
    def last(self) -> LastRows:
        """What this thread's last forward gave (another thread's forward, such as the app's
        step timing beside a reply, never replaces it)."""
        rows = getattr(self._threads, "rows", None)
        if rows is None:
            rows = self._threads.rows = LastRows()
        return rows

    def use_regions(self, regions: Any) -> None:
        """How our decoder layers run (``model.LayerRegions``): this engine runs its own, eagerly."""
        from specmemo_core.runtime.model import EAGER_REGIONS

        if regions is not EAGER_REGIONS:
            raise SpecMemoError(f"compiled layer regions are our own layers'; {self.engine_name} runs its own: "
                                "run them with the torch backend")

    def draft_embedding(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.embed_tokens

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.inv_freq, self.rope_scale, positions, self.dtype)

    def tables(self, positions: torch.Tensor, mask: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, ...]:
        """As ``CausalLM.tables``: the heads' context layer's rotary tables and attention bias."""
        return step_tables((self.inv_freq, self.rope_scale), positions, mask, spec, self.dtype)

    def _kept(self, hidden: torch.Tensor) -> slice | torch.Tensor | None:
        """Which rows of the last forward ``hidden``'s rows are ([T] indices, or every one in order),
        so their logits and picks stand for them; None where some row is not one."""
        rows = self.last.rows
        if rows is None or hidden.dim() != 2 or hidden.shape[-1] != rows.shape[-1]:
            return None
        if hidden is self.last.given and torch.equal(hidden, rows):  # the forward's own output, unchanged
            return slice(None)
        same = (hidden[:, None, :] == rows[None, :, :]).all(-1)  # [T, N]
        if not bool(same.any(-1).all()):
            return None
        return same.int().argmax(-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self._kept(hidden)
        if kept is None:
            return self.lm_head(hidden)
        return torch.from_numpy(np.stack(self.last.logits))[kept]  # a copy, out of the engine's buffer

    def greedy_picks(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self._kept(hidden)
        return self.last.picks[kept] if kept is not None else self.lm_head(hidden).argmax(-1)
