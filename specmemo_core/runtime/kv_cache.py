"""Static KV cache: allocated once, written by slot, compacted after verification.

Slots ``[0, length)`` hold the committed conversation. A forward over ``T`` new tokens
(a prefill chunk or the nodes of a speculation tree) writes its keys and values into
the scratch slots ``[length, length + T)``. ``commit`` then moves the entries of the
accepted tree nodes down to ``[length, length + A)`` and advances ``length``; rejected
entries are simply overwritten by the next forward. Nothing is ever reallocated, so the
memory the planner reserved is the memory the chat uses.

The cache also keeps the token id of every slot (``ids``, moved with the keys and values:
8 bytes a slot beside the KV's kilobytes), so lookup drafting (``lookup.py``) can read the
conversation on the device.
"""

from __future__ import annotations

import torch

from specmemo_core.errors import ContextFullError


MIN_SPAN = 256  # the smallest span a static step attends over (``StaticKVCache.spans``)


def span_ladder(capacity: int, smallest: int = MIN_SPAN) -> tuple[int, ...]:
    """The spans fixed-shape steps attend over: powers of two from ``smallest`` below
    ``capacity``, then ``capacity`` (``StaticKVCache.spans``, ``BatchKVCache.span_for``; the
    staged prefill's prompt lengths, ``staged_prefill.py``)."""
    spans, span = [], smallest
    while span < capacity:
        spans.append(span)
        span *= 2
    return (*spans, capacity)


class KVCache:
    """Keys and values of every layer in two tensors of fixed size."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, kvh, C, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [layers, kvh, C, hd]
        self.ids = torch.zeros(capacity, dtype=torch.long, device=device)  # [C] token of each slot
        self.capacity = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def free_slots(self) -> int:
        return self.capacity - self.length

    def ensure_room(self, new_tokens: int) -> None:
        """Raise a clear error if ``new_tokens`` more scratch slots do not fit."""
        if self.length + new_tokens > self.capacity:
            raise ContextFullError(
                f"The conversation needs {self.length + new_tokens} tokens of context but "
                f"only {self.capacity} were allocated. Start a new chat, or plan for more "
                f"turns (a larger KV cache)."
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` of ``T`` new tokens at the scratch slots and return the
        keys/values of every slot up to and including them (views, no copy).

        k, v: [kvh, T, hd]
        """
        end = self.length + k.shape[1]
        self.k[layer, :, self.length:end] = k
        self.v[layer, :, self.length:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]  # [kvh, end, hd]

    def slot_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where a kernel that writes ``layer``'s keys and values itself puts them: the layer's
        keys and values [kvh, C, hd] and the forward's slots [T] as a device tensor (a static
        cache's, ``token_layer``); None here: this cache's slots are the host's ``length``."""
        return None

    def write_ids(self, tokens: torch.Tensor) -> None:
        """Record the token ids [T] of a forward at its scratch slots (as ``write`` does their KV)."""
        self.ids[self.length:self.length + tokens.shape[0]] = tokens

    @property
    def live_length(self) -> torch.Tensor | int:
        """The length as a step's tensors read it: here the host's (a static cache keeps a
        device copy that a captured step advances, ``StaticKVCache``)."""
        return self.length

    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [T] and attention mask for a forward of T new tokens at scratch slots
        ``length + i``: token i sits at ``length + offsets[i]`` and sees every committed
        token and, among the new ones, its ``ancestors[i]`` (None: the causal chain).
        ``span`` is for static caches; this one's mask is exactly [T, length + T]."""
        past, t = self.length, offsets.shape[0]
        mask = causal_mask(past, t, offsets.device) if ancestors is None else tree_mask(past, ancestors)
        return past + offsets, mask

    # -- the length moves only through these ------------------------------------
    # A step commits in two halves: ``commit_row`` on the device (no host read, so a
    # CUDA graph can hold it) and ``settle`` with the count the step's one host read
    # reported. ``commit`` and ``commit_prefix`` do both at once.

    def commit_row(self, nodes: torch.Tensor | None, count: torch.Tensor | int) -> None:
        """Device half of a commit: the scratch entries of ``nodes`` [W] (relative to
        ``length``, root first, increasing up to ``count``) move to slots length…length+W-1;
        None: they already sit there. Entries past ``count`` land in scratch slots that the
        next forward overwrites. This cache's only length is the host's: see ``settle``."""
        if nodes is None:
            return
        src = nodes.to(self.k.device) + self.length  # [W]
        end = self.length + nodes.shape[0]
        self.k[:, :, self.length:end] = self.k.index_select(2, src)
        self.v[:, :, self.length:end] = self.v.index_select(2, src)
        self.ids[self.length:end] = self.ids.index_select(0, src)

    def settle(self, count: int) -> None:
        """Host half of a commit: ``count`` more tokens are committed (``commit_row`` moved them)."""
        self.ensure_room(count)
        self.length += count

    def commit(self, node_indices: torch.Tensor) -> None:
        """Keep the scratch entries of ``node_indices`` (relative to ``length``, in
        order, root first) as the next committed tokens.

        Index 0..A-1 of an accepted tree path is always increasing, so copying through a
        gather keeps entries that are already in place correct.
        """
        count = int(node_indices.numel())
        self.ensure_room(count)
        self.commit_row(node_indices, count)
        self.settle(count)

    def commit_prefix(self, count: int) -> None:
        """Keep the first ``count`` scratch entries as they are (prefill chunks)."""
        self.ensure_room(count)
        self.commit_row(None, count)
        self.settle(count)

    def rewind(self) -> None:
        """Undo device halves not settled (trial runs of a step: graph warm-ups). Here: nothing."""

    def truncate(self, length: int) -> None:
        """Forget every token from ``length`` on (a new turn that diverges from the cache)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def reset(self) -> None:
        self.truncate(0)


def causal_mask(past: int, new: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[new, past + new] bool: token i sees the whole past and new tokens 0..i."""
    cols = torch.arange(past + new, device=device)
    rows = torch.arange(new, device=device)
    return cols[None, :] <= (past + rows)[:, None]


def tree_mask(past: int, ancestor_mask: torch.Tensor) -> torch.Tensor:
    """[N, past + N] bool: each tree node sees the whole past and its own ancestors."""
    n = ancestor_mask.shape[0]
    prefix = torch.ones(n, past, dtype=torch.bool, device=ancestor_mask.device)
    return torch.cat((prefix, ancestor_mask), dim=1)
