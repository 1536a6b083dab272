"""A KV cache for a batch of sequences: one row of slots per sequence, allocated once.

``KVCache`` holds one conversation; this cache holds ``rows`` of them side by side
([layers, B, kvh, C, hd]), each row with its own length, so one forward verifies every
sequence's tree at once ([B, N] tokens, ``model.CausalLM.forward``). It speaks the same
small API as ``static_decoding.StaticKVCache`` — ``prepare``, ``write``, ``write_ids``,
``commit_row`` / ``settle``, ``rewind`` — with a leading batch axis, so ``step.py``'s one
step runs over it unchanged:

- every row's length lives on the host (``lengths``, a CPU tensor) and on the device
  (``length_t`` [B]); a step reads and advances the device one only, ``settle`` tells the
  host after the step's one host read (as in the static cache);
- keys and values are written at per-row device-tensor slots (``scatter_``) and attended
  over a fixed span of slots, each row masked to its own live length, so every step has
  the same shapes (CUDA-graph capture per batch size and tree);
- ``live`` [B] marks the rows that hold a sequence. A step also runs over the rows
  between sequences (fixed shapes), but their lengths never move (``commit_row`` adds
  ``count × live``), and they stay at length 0, so their scratch writes stay in bounds.

``rows_view(start, stop)`` is a cache over some of the rows that shares this one's memory:
a step over the first b rows (a batch bucket), or a prefill of one row alone.
"""

from __future__ import annotations

import torch

from specmemo_core.errors import ContextFullError
from specmemo_core.runtime.kv_cache import span_ladder


class BatchKVCache:
    """Keys, values and token ids of ``rows`` sequences (see the module doc)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, *, rows: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if capacity <= 0 or rows <= 0:
            raise ValueError(f"a batch cache needs positive rows and capacity, got {rows} × {capacity}")
        shape = (num_layers, rows, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, kvh, C, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, B, kvh, C, hd]
        self.ids = torch.zeros(rows, capacity, dtype=torch.long, device=device)  # [B, C]
        self.length_t = torch.zeros(rows, dtype=torch.long, device=device)  # [B] on the device
        self.live = torch.zeros(rows, dtype=torch.long, device=device)  # [B] 1: the row holds a sequence
        self.lengths = torch.zeros(rows, dtype=torch.long)  # [B] host mirror of length_t
        self.live_host = torch.zeros(rows, dtype=torch.bool)  # [B] host mirror of live
        self.columns = torch.arange(capacity, device=device)  # [C]
        self.slots = torch.zeros(rows, 0, dtype=torch.long, device=device)  # set by prepare()
        self.capacity = capacity

    def rows_view(self, start: int, stop: int) -> "BatchKVCache":
        """A cache over rows ``start:stop`` sharing this one's memory (and host lengths)."""
        view = object.__new__(BatchKVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        view.ids, view.length_t, view.live = self.ids[start:stop], self.length_t[start:stop], self.live[start:stop]
        view.lengths, view.live_host = self.lengths[start:stop], self.live_host[start:stop]
        view.columns, view.capacity = self.columns, self.capacity
        view.slots = self.slots[start:stop]
        return view

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def length(self) -> int:
        """The longest live row (0 if none): what a step's span must hold."""
        live = self.lengths[self.live_host]
        return int(live.max()) if live.numel() else 0

    @property
    def live_length(self) -> torch.Tensor:
        return self.length_t  # [B]

    def row_length(self, row: int) -> int:
        return int(self.lengths[row])

    def free_slots(self) -> int:
        """Slots left in the fullest live row."""
        return self.capacity - self.length

    def spans(self) -> list[int]:
        """The spans a step may attend over (``kv_cache.span_ladder``)."""
        return list(span_ladder(self.capacity))

    def span_for(self, new_tokens: int) -> int:
        """The smallest span that holds every live row and ``new_tokens`` more."""
        return next(s for s in span_ladder(self.capacity) if s >= min(self.length + new_tokens, self.capacity))

    def ensure_room(self, new_tokens: int) -> None:
        """Raise a clear error if a live row has no room for ``new_tokens`` more slots."""
        if self.length + new_tokens > self.capacity:
            raise ContextFullError(
                f"A sequence of the batch needs {self.length + new_tokens} tokens of context but each batch slot "
                f"holds {self.capacity}. Ask for fewer new tokens, or make the batch decoder with a larger "
                "capacity per slot."
            )

    # -- rows join and leave (between steps) -------------------------------------
    def open_row(self, row: int) -> None:
        """Row ``row`` now holds a new sequence: empty and live."""
        self.lengths[row] = 0
        self.length_t[row] = 0
        self.live_host[row] = True
        self.live[row] = 1

    def close_row(self, row: int) -> None:
        """Row ``row`` holds nothing: length 0 (its scratch writes stay in bounds), not live."""
        self.lengths[row] = 0
        self.length_t[row] = 0
        self.live_host[row] = False
        self.live[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Copy row ``src`` (its entries, ids, length, liveness) to row ``dst`` and close ``src``."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.ids[dst] = self.ids[src]
        self.lengths[dst], self.live_host[dst] = self.lengths[src], self.live_host[src]
        self.length_t[dst], self.live[dst] = self.length_t[src], self.live[src]
        self.close_row(src)

    # -- a forward: positions, mask, writes ----------------------------------------
    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [B, T] and mask [B, T, span] for T new tokens per row at scratch slots
        ``length_t[b] + i``: token i sits at ``length + offsets[i]`` and sees its row's
        committed slots and, among the new ones, its ``ancestors[i]`` (None: the causal
        chain). ``offsets`` [T] and ``ancestors`` [T, T] are every row's, or [B, T] and
        [B, T, T] each row's own (trees grown per sequence). ``span``: the slots attended
        (default: all); it must hold every live row."""
        t = offsets.shape[-1]
        new = torch.arange(t, device=offsets.device)  # [T]
        self.slots = self.length_t[:, None] + new  # [B, T]
        rel = self.columns[: span or self.capacity] - self.length_t[:, None]  # [B, S]
        if ancestors is None:
            mask = rel[:, None, :] <= new[None, :, None]  # [B, T, S]
        else:
            b, s = rel.shape
            in_new = ((rel >= 0) & (rel < t))[:, None, :]  # [B, 1, S]
            seen = ancestors.expand(b, t, t).gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, s))  # [B, T, S]
            mask = (rel < 0)[:, None, :] | (in_new & seen)
        return self.length_t[:, None] + offsets, mask

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, kvh, T, hd] stored at ``slots`` [B, T]; returns every slot [B, kvh, C, hd].
        Indexed writes, not ``scatter_`` over an expanded index: in bf16 on a CPU that took
        time in proportion to the whole cache (7 ms a layer at 8,192 slots, against 0.01)."""
        rows = self._rows(self.slots)
        self.k[layer][rows, :, self.slots] = k.transpose(1, 2)
        self.v[layer][rows, :, self.slots] = v.transpose(1, 2)
        return self.k[layer], self.v[layer]

    def _rows(self, index: torch.Tensor) -> torch.Tensor:
        """Each row's number beside its entries of ``index`` [B, W]: [B, W]."""
        return torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index)

    def write_ids(self, tokens: torch.Tensor) -> None:
        """Record each row's token ids [B, T] at its scratch slots."""
        self.ids.scatter_(1, self.slots, tokens)

    # -- commit: device half in the step, host half after its host read ------------
    def commit_row(self, nodes: torch.Tensor | None, count: torch.Tensor | int) -> None:
        """Per row b, the scratch entries of ``nodes[b]`` [W] (relative to the row's length,
        root first, increasing) move to slots length…length+W-1 (None: they already sit
        there) and a live row's device length grows by ``count[b]``; ``settle`` tells the host."""
        if nodes is not None:
            w = nodes.shape[-1]
            dst = self.length_t[:, None] + torch.arange(w, device=nodes.device)  # [B, W]
            src = self.length_t[:, None] + nodes.to(self.ids.device)  # [B, W]
            rows = self._rows(dst)
            for t in (self.k, self.v):  # [layers, B, kvh, C, hd]; indexed as ``write``, read whole before written
                t[:, rows, :, dst] = t[:, rows, :, src]
            self.ids.scatter_(1, dst, self.ids.gather(1, src))
        self.length_t += self.live * count

    def settle(self, counts: list[int] | int) -> None:
        """Host half of a commit: each live row committed ``counts[b]`` more tokens."""
        counts = torch.as_tensor(counts, dtype=torch.long).expand(self.rows)
        grown = self.lengths + counts * self.live_host
        if bool((grown > self.capacity).any()):
            self.ensure_room(int((counts * self.live_host).max()))
        self.lengths.copy_(grown)

    def commit_prefix(self, count: int) -> None:
        """Keep the first ``count`` scratch entries of every live row as they are (prefill chunks)."""
        self.ensure_room(count)
        self.commit_row(None, count)
        self.settle(count)

    def rewind(self) -> None:
        """Put the device lengths back to the host's (undo warm-up steps of a capture)."""
        self.length_t.copy_(self.lengths.to(self.length_t.device))
