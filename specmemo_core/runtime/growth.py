"""Dynamic draft trees: a tree grown each step from the heads' own confidences.

A static tree (``tree.py``) fixes which rank paths a step verifies, whatever the heads
think at that step. A grown tree (``dynamic-N``) spends the same N nodes where the heads
are confident *now*, in fixed shapes so that a CUDA graph still holds the step:

1. Level 1: the first head's top-``topk`` tokens after the root are candidates, scored by
   their log-probability under the head.
2. Level d + 1 (up to ``depth``): the ``beam`` best candidates of level d (by path score,
   the sum of log-probabilities from the root) are expanded: each one's top-``topk``
   children become candidates, scored by their parent's score plus their own.
3. Of all candidates, the ``nodes`` best by path score are verified. A child never scores
   above its parent (its log-probability is ≤ 0, and each level costs a further
   ``DEPTH_TIEBREAK``, so a child the head is certain of still ranks below its parent),
   so the chosen set always holds every chosen node's ancestors: it is a tree. The
   chosen order (best first) puts every parent before its children.

Which tree the step verifies then lives in device tensors made inside the step
(``grown_layout``): node depths, the ancestor mask and one retrieval row per node. The
rest of the step (verify, accept, commit) reads them as it reads a static tree's.

Greedy output stays exact: every emitted token is still the base model's argmax given
the tokens before it; the heads only choose which guesses are checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from specmemo_core.errors import TreeError

if TYPE_CHECKING:
    from specmemo_core.runtime.tree import TreeBuffers

DEPTH_TIEBREAK = 1e-3  # score a level costs besides its log-probability: parents rank above children
MIN_SCORE = -300.0  # path scores are clamped here, far below any kept candidate, so the tie-break survives fp32
MAX_GROWTH_DEPTH = 4


@dataclass(frozen=True)
class Growth:
    """How a ``dynamic-N`` tree grows (module doc): ``nodes`` heads' nodes (the root not
    counted) out of candidates ``depth`` levels deep, expanding the ``beam`` best of each
    level into their ``topk`` children."""

    nodes: int
    depth: int
    beam: int
    topk: int

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= self.nodes:
            raise TreeError(f"a grown tree of {self.nodes} nodes can be 1 to {self.nodes} levels deep, "
                            f"not {self.depth}")
        if not 1 <= self.beam <= self.topk:
            raise TreeError(f"a grown tree expands 1 to topk ({self.topk}) nodes per level, not {self.beam}")
        if self.nodes > self.candidates:
            raise TreeError(f"a grown tree of {self.nodes} nodes needs more candidates than depth {self.depth}, "
                            f"beam {self.beam} and topk {self.topk} give ({self.candidates}); grow a wider tree")

    @property
    def candidates(self) -> int:
        """Candidates drafted per step: ``topk`` at level 1, ``beam × topk`` at each deeper level."""
        return self.topk + (self.depth - 1) * self.beam * self.topk

    @classmethod
    def for_nodes(cls, total: int, max_arity: int) -> Growth:
        """The growth ``dynamic-total`` uses (``total`` nodes, root included): 4 levels at
        most, and beam = topk ≈ √(nodes) + 1, so the candidates are a few times the nodes
        while drafting stays a handful of small batched head calls per level."""
        nodes = total - 1
        if nodes < 1:
            raise TreeError(f"dynamic-{total}: a grown tree needs at least 2 nodes (the root and one guess)")
        width = max(2, min(max_arity, round(math.sqrt(nodes)) + 1))
        return cls(nodes=nodes, depth=min(MAX_GROWTH_DEPTH, nodes), beam=width, topk=width)


def pick_nodes(scores: torch.Tensor, ancestors: torch.Tensor, nodes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``nodes`` best candidates of each row of ``scores`` [B, C] (path scores) and
    their layout: (picked candidate indices [B, N], best first; depths [B, N]; ancestors
    [B, N, D] as node positions 1…N, the node itself at its own depth's column, -1 past
    it). ``ancestors`` [B, C, D]: each candidate's ancestors as candidate indices (-1 padded)."""
    b, d = scores.shape[0], ancestors.shape[-1]
    picked = scores.topk(nodes, dim=-1).indices  # [B, N] sorted: every parent before its children
    position = torch.full_like(scores, -1, dtype=torch.long)  # [B, C] node position of each candidate, -1 if left out
    position.scatter_(1, picked, torch.arange(1, nodes + 1, device=scores.device).expand(b, nodes))
    chosen = ancestors.gather(1, picked[..., None].expand(b, nodes, d))  # [B, N, D] candidate indices
    depth = (chosen >= 0).sum(-1)  # [B, N]
    where = position.gather(1, chosen.clamp(min=0).view(b, -1)).view(b, nodes, d)
    return picked, depth, torch.where(chosen >= 0, where, -1)


def grown_layout(buf: "TreeBuffers", depth: torch.Tensor, ancestors: torch.Tensor) -> "TreeBuffers":
    """The step's tree buffers for heads' nodes at ``depth`` [..., N] with ``ancestors``
    [..., N, D] (``pick_nodes``): ``buf``'s root row and lookup chain kept, the heads' rows
    replaced. A leading axis (a batch, one tree per sequence) gives per-row buffers:
    parents and depths [..., total], the mask [..., total, total], retrieval rows
    [..., L, W]."""
    *lead, n, d = ancestors.shape
    total, width, device = buf.depths.shape[0], buf.retrieve_indices.shape[1], depth.device

    def static(t: torch.Tensor) -> torch.Tensor:  # a static tree's rows, with the leading axis
        return t.expand(*lead, *t.shape)

    rows = torch.zeros(*lead, n, total, dtype=torch.bool, device=device)  # [..., N, total]
    rows.scatter_(-1, ancestors.clamp(min=0), True)  # -1 lands on the root's column, which every node sees
    rows[..., 0] = True
    path = torch.cat((torch.zeros(*lead, n, 1, dtype=torch.long, device=device), ancestors), dim=-1)  # [..., N, 1 + D]
    retrieve = torch.cat((path, torch.full((*lead, n, width - 1 - d), -1, dtype=torch.long, device=device)), dim=-1)
    parent = path.gather(-1, (depth - 1)[..., None])[..., 0]  # [..., N]
    return replace(
        buf,
        parents=torch.cat((static(buf.parents[:1]), parent, static(buf.parents[1 + n:])), dim=-1),
        depths=torch.cat((static(buf.depths[:1]), depth, static(buf.depths[1 + n:])), dim=-1),
        attn_mask=torch.cat((static(buf.attn_mask[:1]), rows, static(buf.attn_mask[1 + n:])), dim=-2),
        retrieve_indices=torch.cat((retrieve, static(buf.retrieve_indices[n:])), dim=-2),
    )
