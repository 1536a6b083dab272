"""Speculation trees: which candidate tokens one verification step checks.

Vocabulary:

* A *tree node* is one candidate token position. Node 0 is the *root*: the
  last accepted token, whose KV is not yet in the cache.
* A *path* is a tuple of top-k ranks from the root. ``(0, 2)`` is the child of
  the root drawn from head 1's rank-0 token, then that node's child drawn from
  head 2's rank-2 token. A tree is given by its list of paths, root excluded
  (Medusa's "choices" format).
* The root has depth 0; a node at depth d holds the token that head d
  (1-based) proposed at rank ``path[-1]``.
* Node order: root first, then nodes sorted by ``(depth, path)``, i.e.
  breadth-first and lexicographic within a level, so every parent precedes
  its children.
* A *level-count name* such as ``"1-10-16-17"`` lists how many nodes each
  depth holds (root first); :func:`tree_name` gives it for any tree.
* A tree may end with a *lookup chain* (``"1-10-16-17+lookup-8"``): ``lookup`` more
  nodes after the heads' nodes, a chain hanging off the root whose tokens are copied
  from earlier in the conversation (``lookup.py``) instead of proposed by heads.
  ``lookup-8`` alone is such a chain with no heads at all.
* A *grown* tree (``"dynamic-8"``, ``growth.py``) has no fixed paths: each step grows
  its N - 1 heads' nodes from the heads' own confidences. Its buffers hold a placeholder
  layout (a star under the root) that the step replaces with the tree it grew.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Protocol

import torch

from specmemo_core.errors import TreeError
from specmemo_core.runtime.growth import Growth

MAX_TREE_NODES = 256  # root included; bounds the [N, N] mask and the verify batch
MAX_ARITY = 10  # top-k each head proposes at most, as in Medusa

Paths = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class TreeBuffers:
    """Tensors the verifier needs, built once per tree (treat as read-only).

    ``head_index``/``rank`` are -1 for the root, which no head proposes.
    ``retrieve_indices`` has one row per leaf, leaves in node order; each row
    lists node indices root-to-leaf and is right-padded with -1.
    """

    parents: torch.Tensor  # [N] long, root -1
    depths: torch.Tensor  # [N] long, root 0
    attn_mask: torch.Tensor  # [N, N] bool, [i, j] = j is i or an ancestor of i
    head_index: torch.Tensor  # [N] long, depth - 1 (root -1)
    rank: torch.Tensor  # [N] long, path[-1] (root -1)
    retrieve_indices: torch.Tensor  # [L, depth + 1] long, -1 padded
    topk_needed: tuple[int, ...]  # [depth]: top-k each head must propose
    leaf_count: int
    level_starts: tuple[int, ...]  # [depth + 2]: nodes of depth d are level_starts[d]:level_starts[d+1]
    lookup: int = 0  # the last ``lookup`` nodes: the lookup chain (root → first → … → last)
    growth: Growth | None = None  # a grown tree: each step lays out its heads' nodes anew (growth.py)
    # [N, max(topk_needed)] long: node i's child at each rank its head proposes, -1 none (drafting
    # writes a level's picks straight into the tokens: ``step_kernels.top_k_into``); None: grown
    children: torch.Tensor | None = None

    def row(self, b: int) -> "TreeBuffers":
        """Sequence ``b``'s tree: the same buffers for a tree shared by a batch; row ``b`` of
        per-sequence ones (a grown layout over a batch, ``growth.grown_layout``)."""
        if self.depths.dim() == 1:
            return self
        return replace(self, parents=self.parents[b], depths=self.depths[b], attn_mask=self.attn_mask[b],
                       retrieve_indices=self.retrieve_indices[b])

    def to(self, device: torch.device | str) -> "TreeBuffers":
        """The same buffers on ``device`` (moved once per decoder, not per step)."""
        return replace(self, **{name: value.to(device) for name, value in vars(self).items()
                                if isinstance(value, torch.Tensor)})


@dataclass(frozen=True)
class Tree:
    """A validated speculation tree; ``paths`` are sorted by (len, path)."""

    name: str
    paths: Paths
    lookup: int = 0  # nodes of the lookup chain, after the heads' nodes (module doc)
    growth: Growth | None = None  # a grown tree (no paths): its heads' nodes are chosen each step

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", _validate_paths(self.paths))
        if self.growth is not None and self.paths:
            raise TreeError(f"tree {self.name}: a grown tree has no fixed paths")
        if isinstance(self.lookup, bool) or not isinstance(self.lookup, int) or self.lookup < 0:
            raise TreeError(f"lookup chain length {self.lookup!r} must be an integer >= 0")
        if self.num_nodes > MAX_TREE_NODES:
            raise TreeError(
                f"tree has {self.num_nodes} nodes with its lookup chain but at most {MAX_TREE_NODES} "
                "are allowed (root included); use a shorter chain or a smaller tree"
            )

    def with_lookup(self, count: int) -> Tree:
        """This tree plus a lookup chain of ``count`` nodes, named ``NAME+lookup-count``."""
        parts = split_lookup(self.name)
        base = parts[0] if parts and parts[0] else self.name
        return Tree(name=f"{base}+lookup-{count}" if count else base, paths=self.paths, lookup=count,
                    growth=self.growth)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], name: str | None = None) -> Tree:
        """Build a tree from Medusa-style paths (root excluded), in any order."""
        checked = _validate_paths(paths)
        return cls(name=name or "-".join(map(str, _level_counts(checked))), paths=checked)

    @property
    def num_nodes(self) -> int:
        return len(self.paths) + 1 + self.lookup + (self.growth.nodes if self.growth else 0)

    @property
    def drafts(self) -> bool:
        """Whether the heads propose any of this tree's nodes (fixed paths or grown ones)."""
        return bool(self.paths) or self.growth is not None

    @property
    def depth(self) -> int:
        """Levels the heads draft (the lookup chain needs no head)."""
        if self.growth is not None:
            return self.growth.depth
        return max((len(p) for p in self.paths), default=0)

    def speculates(self, heads: "Drafter | None") -> bool:
        """Whether decoding on this tree with ``heads`` (None: none loaded) verifies more
        than one node."""
        return self.num_nodes > 1 and self.fits_heads(heads)

    def fits_heads(self, heads: "Drafter | None") -> bool:
        """Whether ``heads`` (None: none loaded) can draft this tree (``heads_can_draft``)."""
        return heads_can_draft(self.depth, heads, grown=self.growth is not None)

    def check_heads(self, heads: "Drafter | None") -> None:
        """Raise, saying what to do, unless ``fits_heads``."""
        if self.fits_heads(heads):
            return
        if self.growth is not None and heads is not None and heads.kind != "hydra":
            raise TreeError(f"tree {self.name} grows along the heads' drafted paths, which needs hydra heads; "
                            "with medusa heads use a fixed tree (calibrated-N, medusa-64)")
        num_heads = heads.num_heads if heads is not None else None
        if num_heads is None:
            raise TreeError(f"tree {self.name} needs draft heads; load heads, or decode plainly or with a "
                            "lookup chain alone (lookup-N)")
        raise TreeError(f"tree {self.name} needs {self.depth} draft heads but only {num_heads} are loaded; "
                        "choose a shallower tree")

    @property
    def width(self) -> int:
        """Nodes on the longest root-to-leaf path, root included: most tokens a step accepts."""
        return max(self.depth, self.lookup) + 1

    @property
    def level_counts(self) -> tuple[int, ...]:
        return _level_counts(self.paths)

    @property
    def widest_drafting_level(self) -> int:
        """Most states one drafting level scores at once (chained heads draft level by
        level; the last level's states are not scored): the memory model's draft rows.
        A grown tree scores its ``beam`` expanded nodes per level."""
        if self.growth is not None:
            return self.growth.beam
        return max(self.level_counts[:-1], default=1)

    @cached_property
    def buffers(self) -> TreeBuffers:
        return build_tree_buffers(self)

    # Shortcuts so callers can write tree.attn_mask etc.
    parents = property(lambda self: self.buffers.parents)
    depths = property(lambda self: self.buffers.depths)
    attn_mask = property(lambda self: self.buffers.attn_mask)
    head_index = property(lambda self: self.buffers.head_index)
    rank = property(lambda self: self.buffers.rank)
    retrieve_indices = property(lambda self: self.buffers.retrieve_indices)
    topk_needed = property(lambda self: self.buffers.topk_needed)
    leaf_count = property(lambda self: self.buffers.leaf_count)


def _validate_paths(paths: object) -> Paths:
    """Normalise paths to sorted int tuples, or say exactly what is wrong."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
        raise TreeError("tree paths must be a list of lists of ranks, e.g. [[0], [1], [0, 0]]")
    out: list[tuple[int, ...]] = []
    for p in paths:
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TreeError(f"tree path {p!r} is not a list of ranks; write it like [0, 2]")
        if len(p) == 0:
            raise TreeError("tree path [] is the root, which is implicit; remove it")
        for r in p:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise TreeError(f"tree path {list(p)} has rank {r!r}; ranks must be integers >= 0")
        out.append(tuple(p))
    present = set(out)
    if len(present) != len(out):
        dup = next(p for p in out if out.count(p) > 1)
        raise TreeError(f"tree path {list(dup)} is listed twice; remove the duplicate")
    if len(out) + 1 > MAX_TREE_NODES:
        raise TreeError(
            f"tree has {len(out) + 1} nodes but at most {MAX_TREE_NODES} are allowed "
            "(root included); use a smaller tree"
        )
    for p in out:
        if len(p) > 1 and p[:-1] not in present:
            raise TreeError(
                f"tree path {list(p)} has no parent: add path {list(p[:-1])} or remove {list(p)}"
            )
    return tuple(sorted(out, key=lambda p: (len(p), p)))


def build_tree_buffers(tree: Tree) -> TreeBuffers:
    """Derive the verifier's tensors from the sorted path list (and the lookup chain,
    whose nodes come last: node ``first + j`` sits at depth j + 1 under node ``first + j - 1``)."""
    if tree.growth is not None:  # its placeholder layout: a star of depth 1 under the root
        return _grown_skeleton(tree)
    paths, n, depth, chain = tree.paths, tree.num_nodes, tree.depth, tree.lookup
    first = len(paths) + 1  # the chain's first node
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    chain_parents = [0] + list(range(first, first + chain - 1)) if chain else []
    parents = torch.tensor([-1] + [index[p[:-1]] for p in paths] + chain_parents, dtype=torch.long)  # [N]
    depths = torch.tensor([0] + [len(p) for p in paths] + list(range(1, chain + 1)), dtype=torch.long)  # [N]
    rank = torch.tensor([-1] + [p[-1] for p in paths] + [-1] * chain, dtype=torch.long)  # [N]
    head_index = torch.tensor([-1] + [len(p) - 1 for p in paths] + [-1] * chain, dtype=torch.long)  # [N]
    mask = torch.eye(n, dtype=torch.bool)  # [N, N]
    for i in range(1, n):  # parents precede children, so the parent's row is final
        mask[i] |= mask[parents[i]]
    has_child = {p[:-1] for p in paths} | ({()} if chain else set())
    rows = [[index[leaf[:d]] for d in range(len(leaf) + 1)] for leaf in ((),) + paths if leaf not in has_child]
    if chain:
        rows.append([0] + list(range(first, first + chain)))
    retrieve = torch.full((len(rows), tree.width), -1, dtype=torch.long)  # [L, width]
    for r, row in enumerate(rows):
        retrieve[r, : len(row)] = torch.tensor(row)
    topk = tuple(max(p[-1] for p in paths if len(p) == d) + 1 for d in range(1, depth + 1))
    children = torch.full((n, max(topk, default=1)), -1, dtype=torch.long)  # [N, k]
    for i, p in enumerate(paths):
        children[index[p[:-1]], p[-1]] = i + 1
    return TreeBuffers(
        parents=parents,
        depths=depths,
        attn_mask=mask,
        head_index=head_index,  # [N], root and chain -1
        rank=rank,
        retrieve_indices=retrieve,
        topk_needed=topk,
        leaf_count=len(rows),
        level_starts=tuple(itertools.accumulate(tree.level_counts, initial=0)),
        lookup=chain,
        children=children,
    )


def _grown_skeleton(tree: Tree) -> TreeBuffers:
    """A grown tree's buffers: the lookup chain's as usual; its heads' nodes laid out as a
    star under the root until a step grows them (``growth.grown_layout``)."""
    star = build_tree_buffers(Tree(name="star", paths=tuple((i,) for i in range(tree.growth.nodes)),
                                   lookup=tree.lookup))
    width = tree.width
    retrieve = torch.full((star.leaf_count, width), -1, dtype=torch.long)  # [L, width]: as deep as the growth
    retrieve[:, : star.retrieve_indices.shape[1]] = star.retrieve_indices
    return replace(star, retrieve_indices=retrieve, head_index=torch.full_like(star.head_index, -1),
                   rank=torch.full_like(star.rank, -1), topk_needed=(), level_starts=(0, 1, 1 + tree.growth.nodes),
                   growth=tree.growth, children=None)


def _level_counts(paths: Paths) -> tuple[int, ...]:
    counts = [1] + [0] * max((len(p) for p in paths), default=0)
    for p in paths:
        counts[len(p)] += 1
    return tuple(counts)


def tree_name(tree: Tree) -> str:
    """Level-count name of any tree, e.g. ``"1-10-28-23-2"`` (``"1"`` for the root alone),
    with ``+lookup-N`` for a lookup chain; a grown tree's is ``dynamic-N``."""
    if tree.growth is not None:
        return f"dynamic-{tree.growth.nodes + 1}" + (f"+lookup-{tree.lookup}" if tree.lookup else "")
    return "-".join(map(str, tree.level_counts)) + (f"+lookup-{tree.lookup}" if tree.lookup else "")


def default_rank_prior(arity: int = MAX_ARITY) -> list[float]:
    """Placeholder head accuracy p(rank r) proportional to 1/(r+1).

    Calibrated per-head accuracies (measured on held-out text) replace this;
    it only has to rank children sensibly until then.
    """
    weights = [1.0 / (r + 1) for r in range(arity)]
    total = sum(weights)
    return [w / total for w in weights]


def _score(path: tuple[int, ...], rank_scores: Sequence[Sequence[float]]) -> float:
    return math.prod(rank_scores[d][r] for d, r in enumerate(path))


def tree_from_level_counts(
    counts: Sequence[int],
    rank_scores: Sequence[Sequence[float]] | None = None,
    name: str | None = None,
) -> Tree:
    """Greedy tree with ``counts[d]`` nodes at depth d.

    Rule: at each depth, among all children (ranks < arity) of the previous
    depth's nodes, keep the ``counts[d]`` with the highest score = product of
    per-rank accuracies along the path; ties go to the lexicographically
    smaller path. ``rank_scores[d][r]`` is head d+1's accuracy at rank r; when
    None, :func:`default_rank_prior` is used for every head.
    """
    counts = list(counts)
    if not counts or counts[0] != 1:
        raise TreeError(f"level counts {counts} must start with 1 (the root), e.g. 1-10-16-17")
    if rank_scores is None:
        rank_scores = [default_rank_prior()] * (len(counts) - 1)
    if len(rank_scores) < len(counts) - 1:
        raise TreeError(
            f"level counts {counts} need accuracies for {len(counts) - 1} heads but "
            f"rank_scores has {len(rank_scores)}; give one list per head"
        )
    if sum(counts) > MAX_TREE_NODES:
        raise TreeError(
            f"tree {'-'.join(map(str, counts))} has {sum(counts)} nodes but at most "
            f"{MAX_TREE_NODES} are allowed (root included); use smaller level counts"
        )
    level: list[tuple[int, ...]] = [()]
    paths: list[tuple[int, ...]] = []
    for d, want in enumerate(counts[1:]):
        arity = min(MAX_ARITY, len(rank_scores[d]))
        if not 1 <= want <= len(level) * arity:
            raise TreeError(
                f"level {d + 1} of {counts} asks for {want} nodes but must have 1 to "
                f"{len(level) * arity} (previous level {len(level)} x arity {arity})"
            )
        children = [p + (r,) for p in level for r in range(arity)]
        children.sort(key=lambda p: (-_score(p, rank_scores), p))
        level = sorted(children[:want])
        paths += level
    return Tree.from_paths(paths, name=name)


# Fitted level scale for specmemo_prune_rates: x_l = slope * l + offset.
_PRUNE_X_SLOPE, _PRUNE_X_OFFSET = 15.055, 0.95


def specmemo_prune_rates(levels: int, a: float = 0.02, b: float = 0.1) -> list[float]:
    """SpecMemo's prune rate for each tree level 1..``levels``, rounded to 4 decimals.

    The paper prints y = clip(1 - e^(-a x) (1 - b x), 0, 1) with a = 0.02,
    b = 0.1, and its figure shows 0, 0.9274, 0.9809, 0.9951 for levels 1-4.
    No natural reading reproduces those values: we tried x = level, level - 1,
    10^level, cumulative node counts and percentages, with e^(-a x (1 - b x)),
    e^(-a x) (1 - b)^x, e^(-a x)/(1 + b x) and a/b swapped. The literal reading
    clips to 1 for any x >= 10 and stays small below it; the closest natural
    one, 1 - (1 + a x)^(-1/b) at x = 15 (level - 1), is off by up to 0.01.
    So this is a reading fitted to the figure, keeping the paper's
    "exponential times linear" shape and its a and b: level 1 is never pruned
    (rate 0), and level l >= 2 gets 1 - (1 + a x) e^(-b x) with
    x = 15.055 l + 0.95, which matches the figure to 4e-6 (exactly after
    rounding). Replace it if the authors' code turns up.
    """
    if levels < 0:
        raise TreeError(f"levels {levels} must be >= 0")
    rates = [0.0]
    for level in range(2, levels + 1):
        x = _PRUNE_X_SLOPE * level + _PRUNE_X_OFFSET
        rates.append(round(min(1.0, max(0.0, 1.0 - (1.0 + a * x) * math.exp(-b * x))), 4))
    return rates[:levels]


def specmemo_pruned_tree(
    levels: int = 4, arity: int = MAX_ARITY, node_budget: int | None = None
) -> Tree:
    """SpecMemo's pruned tree: apply :func:`specmemo_prune_rates` to a full tree.

    Level l keeps ``round(full_l * (1 - rate_l))`` nodes, where ``full_l`` is
    the kept nodes of level l-1 times ``arity``; the highest-scoring children
    under :func:`default_rank_prior` are kept. Growth stops at the first level
    that keeps no node. With ``node_budget``, nodes are then dropped deepest
    level first, lowest score first, until the tree fits.

    The defaults give ``"1-10-7-1"`` (19 nodes): 10 x (1 - 0) = 10, then
    round(100 x 0.0726) = 7, round(70 x 0.0191) = 1, round(10 x 0.0049) = 0.
    That is not the 44-node ``"1-10-16-17"`` the project issue calls the
    SpecMemo tree; that one would need rates 0.84 and 0.894 at levels 2 and 3,
    so load it by name instead.
    """
    if not 1 <= arity <= MAX_ARITY:
        raise TreeError(f"arity {arity} must be between 1 and {MAX_ARITY}")
    if node_budget is not None and node_budget < 1:
        raise TreeError(f"node budget {node_budget} must be at least 1 (the root)")
    counts = [1]
    for rate in specmemo_prune_rates(levels):
        kept = round(counts[-1] * arity * (1.0 - rate))
        if kept == 0:
            break
        counts.append(kept)
    prior = [default_rank_prior(arity)] * (len(counts) - 1)
    if node_budget is not None:
        excess = sum(counts) - node_budget
        while excess > 0:
            drop = min(excess, counts[-1])
            counts[-1] -= drop
            excess -= drop
            if counts[-1] == 0:
                counts.pop()
    return tree_from_level_counts(counts, rank_scores=prior[: len(counts) - 1])


# Medusa's default tree for Vicuna-7B: `mc_sim_7b_63` from FasterDecoding/Medusa,
# medusa/model/medusa_choices.py (Apache-2.0), reproduced as data.
MEDUSA_64_PATHS = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
    [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
    [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
    [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
    [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
    [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip

_LEVELS_RE = re.compile(r"^1(-\d+)+$")
_CHAIN_RE = re.compile(r"^chain-(\d+)$")
_DYNAMIC_RE = re.compile(r"^dynamic-(\d+)$")
_LOOKUP_RE = re.compile(r"^(?:(.+)\+)?lookup-(\d+)$")
_NAMES_HELP = ("medusa-64, single, chain-N, dynamic-N, level counts like 1-10-16-17, or a .json file; "
               "any of them with +lookup-N, or lookup-N alone")


class Drafter(Protocol):
    """What the heads rule reads of heads: loaded ones (``heads.DraftHeads``) or their
    planned shape (``planning.memory.HeadsShape``)."""

    num_heads: int
    kind: str  # "medusa" or "hydra"


def heads_can_draft(depth: int, heads: Drafter | None, *, grown: bool = False) -> bool:
    """The one rule for "do these heads fit this tree": a tree whose head-drafted part is
    ``depth`` levels deep needs at least that many heads; depth 0 (one node, or a lookup
    chain alone) needs none; a ``grown`` tree grows along the heads' drafted paths, which
    needs hydra heads. ``heads`` None: none are loaded."""
    if depth == 0:
        return True
    return heads is not None and depth <= heads.num_heads and (not grown or heads.kind == "hydra")


def split_lookup(name: str) -> tuple[str | None, int] | None:
    """``"BASE+lookup-N"`` → (BASE, N); ``"lookup-N"`` → (None, N); a name without a
    lookup chain → None."""
    m = _LOOKUP_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def is_lookup_only(name: str) -> bool:
    """A tree name that needs no heads: a lookup chain alone (``lookup-N``)."""
    parts = split_lookup(name)
    return parts is not None and parts[0] is None


def load_tree(spec: str | Path) -> Tree:
    """Resolve ``medusa-64``, ``single``, ``chain-N``, ``dynamic-N`` (a grown tree of N
    nodes, ``growth.py``), level counts or a JSON file, each
    optionally with ``+lookup-N`` (a lookup chain of N nodes), or ``lookup-N`` alone.

    JSON may be a bare path list, ``{"paths": [...]}``, or
    ``{"parents": [-1, 0, ...], "ranks": [...]}`` (ranks default to sibling order).
    """
    text = str(spec)
    if not isinstance(spec, Path) and (parts := split_lookup(text)):
        base, count = parts
        return load_tree(base).with_lookup(count) if base else Tree(name=text, paths=(), lookup=count)
    if not isinstance(spec, Path):
        if text == "medusa-64":
            return Tree.from_paths(MEDUSA_64_PATHS, name="medusa-64")
        if text == "single":
            return Tree(name="single", paths=())
        if m := _CHAIN_RE.match(text):
            n = int(m.group(1))
            if n + 1 > MAX_TREE_NODES:
                raise TreeError(
                    f"{text} has {n + 1} nodes; at most {MAX_TREE_NODES} are allowed"
                )
            return Tree.from_paths([(0,) * d for d in range(1, n + 1)], name=text)
        if m := _DYNAMIC_RE.match(text):
            n = int(m.group(1))
            if n > MAX_TREE_NODES:
                raise TreeError(f"{text} has {n} nodes; at most {MAX_TREE_NODES} are allowed")
            return Tree(name=text, paths=(), growth=Growth.for_nodes(n, MAX_ARITY))
        if _LEVELS_RE.match(text):
            return tree_from_level_counts([int(c) for c in text.split("-")], name=text)
    path = Path(spec)
    if not path.is_file():
        raise TreeError(f"unknown tree {text!r}: use {_NAMES_HELP}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Tree.from_paths(_paths_from_json(data), name=path.stem)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TreeError(
            f"tree file {path}: cannot read it as JSON ({exc}); fix or replace it"
        ) from exc
    except TreeError as exc:
        raise TreeError(f"tree file {path}: {exc}") from exc


def _paths_from_json(data: object) -> list:
    """Accept a bare path list, {"paths": [...]}, or {"parents": [...], "ranks": [...]}."""
    if isinstance(data, dict) and "paths" in data:
        return data["paths"]
    if isinstance(data, dict) and "parents" in data:
        return _paths_from_parents(data["parents"], data.get("ranks"))
    if isinstance(data, list):
        return data
    raise TreeError(
        'expected a list of paths, {"paths": [...]} or {"parents": [...], "ranks": [...]}'
    )


def _paths_from_parents(parents: object, ranks: object) -> list[tuple[int, ...]]:
    """Turn parent-index form into paths; ranks default to sibling order."""
    if not isinstance(parents, list) or not all(type(p) is int for p in parents):
        raise TreeError('"parents" must be a list of integers, root first with parent -1')
    n = len(parents)
    if n > MAX_TREE_NODES:
        raise TreeError(
            f"tree has {n} nodes but at most {MAX_TREE_NODES} are allowed; use a smaller tree"
        )
    if n == 0 or parents[0] != -1:
        raise TreeError('"parents" must start with -1 for the root (node 0)')
    if ranks is None:
        seen: dict[int, int] = {}
        ranks = [0] * n
        for i in range(1, n):
            ranks[i] = seen.get(parents[i], 0)
            seen[parents[i]] = ranks[i] + 1
    if not isinstance(ranks, list) or len(ranks) != n or not all(type(r) is int for r in ranks):
        raise TreeError(f'"ranks" must be a list of {n} integers, one per node (root included)')
    for i, p in enumerate(parents[1:], start=1):
        if p == i:
            raise TreeError(f"node {i} is its own parent; point it at an earlier node")
        if not 0 <= p < n:
            raise TreeError(f"node {i} has parent {p}, which is not a node index 0..{n - 1}")
    paths: dict[int, tuple[int, ...]] = {0: ()}
    for start in range(1, n):
        chain, node = [], start
        while node not in paths:
            if node in chain:
                cycle = chain[chain.index(node):] + [node]
                raise TreeError(
                    f"parents form a cycle {' -> '.join(map(str, cycle))}; "
                    "every node must lead to the root"
                )
            chain.append(node)
            node = parents[node]
        for node in reversed(chain):
            paths[node] = paths[parents[node]] + (ranks[node],)
    return [paths[i] for i in range(1, n)]
