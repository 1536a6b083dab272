"""The KV cache of a split model (``split.py``): one cache per segment, on its device.

Each segment's layers keep their keys and values on their own device, in a cache of the
same kind as an unsplit model's (``kv_cache.KVCache``, ``static_decoding.StaticKVCache``
or ``batch_cache.BatchKVCache``) over that segment's layers only. ``SplitCache`` joins
them behind the one cache API that ``step.py`` and the decoders speak:

- ``write(layer, k, v)`` goes to the segment that owns ``layer`` (at its own index there);
- a forward's layout (``prepare``), a commit (``commit_row``/``settle``), and every change
  of length or rows go to every segment, each with its inputs on its own device, so each
  knows its own scratch slots and lengths (on its device: a captured step reads them there);
- what the step reads of the conversation (``ids``, ``live_length``, ``length``, spans)
  comes from the *home* segment, the last one, on the device where the step runs; token ids
  are recorded there only (the lookup drafter reads them; the other segments' stay unused).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


class SplitCache:
    """Caches of one kind, one per segment, in layer order (see the module doc)."""

    def __init__(self, parts: Sequence[Any]) -> None:
        if not parts:
            raise ValueError("a split cache needs at least one segment's cache")
        self.parts = list(parts)
        self.devices = [p.ids.device for p in self.parts]
        self.owner: list[tuple[Any, int]] = [(p, i) for p in self.parts for i in range(p.k.shape[0])]

    @property
    def home(self) -> Any:
        """The last segment's cache: on the device where the step runs."""
        return self.parts[-1]

    # -- what the step reads: the home segment's --------------------------------------
    @property
    def capacity(self) -> int:
        return self.home.capacity

    @property
    def length(self) -> int:
        return self.home.length

    @property
    def ids(self) -> torch.Tensor:
        return self.home.ids

    @property
    def live_length(self) -> torch.Tensor | int:
        return self.home.live_length

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def free_slots(self) -> int:
        return self.home.free_slots()

    def ensure_room(self, new_tokens: int) -> None:
        self.home.ensure_room(new_tokens)

    def spans(self) -> list[int]:
        return self.home.spans()

    def span_for(self, new_tokens: int) -> int:
        return self.home.span_for(new_tokens)

    # -- a forward -------------------------------------------------------------------------
    def prepare(self, offsets: torch.Tensor, ancestors: torch.Tensor | None = None,
                span: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment lays out the forward on its device; the home's positions and mask."""
        for part, device in zip(self.parts[:-1], self.devices):
            part.prepare(offsets.to(device), _to(ancestors, device), span)
        return self.home.prepare(offsets, ancestors, span)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        part, local = self.owner[layer]
        return part.write(local, k, v)

    def slot_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        part, local = self.owner[layer]
        return part.slot_target(local)

    def write_ids(self, tokens: torch.Tensor) -> None:
        self.home.write_ids(tokens)

    # -- commits and lengths: every segment ---------------------------------------------------
    def commit_row(self, nodes: torch.Tensor | None, count: torch.Tensor | int) -> None:
        for part, device in zip(self.parts, self.devices):
            part.commit_row(_to(nodes, device), _to(count, device))

    def settle(self, count: Any) -> None:
        for part in self.parts:
            part.settle(count)

    def commit_prefix(self, count: int) -> None:
        for part in self.parts:
            part.commit_prefix(count)

    def commit(self, node_indices: torch.Tensor) -> None:
        for part, device in zip(self.parts, self.devices):
            part.commit(node_indices.to(device))

    def rewind(self) -> None:
        for part in self.parts:
            part.rewind()

    def truncate(self, length: int) -> None:
        for part in self.parts:
            part.truncate(length)

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    # -- the rows of a batched cache (batch_cache.BatchKVCache) ---------------------------------
    @property
    def rows(self) -> int:
        return self.home.rows

    def row_length(self, row: int) -> int:
        return self.home.row_length(row)

    def open_row(self, row: int) -> None:
        for part in self.parts:
            part.open_row(row)

    def close_row(self, row: int) -> None:
        for part in self.parts:
            part.close_row(row)

    def move_row(self, src: int, dst: int) -> None:
        for part in self.parts:
            part.move_row(src, dst)

    def rows_view(self, start: int, stop: int) -> "SplitCache":
        return SplitCache([p.rows_view(start, stop) for p in self.parts])
