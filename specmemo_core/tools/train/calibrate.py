"""Calibration: how often each head — and each tree path — is right on held-out text.

For every held-out position we record, per head, the rank of the true token among the
head's guesses (teacher-forced: for hydra heads the parent is the true token, i.e. the
accuracy is conditional on the parent being right, which is exactly when the child is
looked at). A tree path (r1, …, rd) is accepted at a position iff head j's rank there is
r_j for every j ≤ d, so its acceptance rate is the frequency of that rank prefix —
measured jointly, without Medusa's independence assumption. The expected tokens per
verify step of a tree is then 1 + Σ over its nodes of their paths' acceptance rates,
and the best tree of N nodes is simply the N − 1 most frequent paths (a path is never
more frequent than its prefix, so that set is always a valid tree).

Tokens per step, walked. ``1 + Σ rates`` averages over every held-out position, but a
decoder visits only the positions where its steps begin, and a step that accepts a long
run skips the positions inside it — exactly the well-predicted ones. So that average
over-predicts, the more the more a tree accepts (a lookup chain in a looping reply: 2.69
predicted against 1.48 measured on eight replies). Given the held-out text (the base
model's own greedy replies) the record therefore also walks each reply as greedy
decoding would: a step at position g emits 1 + (the furthest of the heads' accepted
depth on the tree and the lookup chain's matched length) tokens and the next step begins
after them (``walked_tokens_per_step``). ``record["tokens_per_step"]`` holds that figure
for each calibrated tree of the planner's sizes, with and without a chain beside it
(``runtime/lookup.py``: it hangs off the root, so the step takes the longer of the two),
and for the chains alone; the planner prefers it to the positional average.

Grown trees (``dynamic-N``, ``runtime/growth.py``) have no fixed paths, so no path rate
predicts them: ``grown_depths`` grows the tree at every held-out position as the decoder
would (the same ``HydraHeads.grow``, over all positions at once) and finds how deep the
true continuation runs in it; the walk then gives ``dynamic-N``'s tokens per step, and the
planner offers a grown tree only at that figure.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from specmemo_core.runtime.calibration import (  # noqa: F401  (re-exported for the training tools)
    CALIBRATION_NAME, expected_accepted, load_calibration, tree_from_calibration,
)
from specmemo_core.runtime.growth import Growth
from specmemo_core.runtime.heads import DraftHeads
from specmemo_core.runtime.lookup import lookup_draft
from specmemo_core.runtime.tree import MAX_ARITY, load_tree
from specmemo_core.tools.train.distill import Sequences
from specmemo_core.tools.train.features import IGNORE, Features
from specmemo_core.tools.train.trainer import Rope, context_hidden, head_lm, head_states

MISS = MAX_ARITY  # rank recorded when the true token is not among the top MAX_ARITY
# tree size n -> [M] accepted depths of ``dynamic-n`` (``grown_depths``), None where the heads cannot grow it
GrownDepths = Callable[[int], "torch.Tensor | None"]


@torch.inference_mode()
def draft_states(heads: DraftHeads, feats: Features, rope: Rope | None, device: str | torch.device,
                 embed: nn.Embedding | None = None) -> torch.Tensor:
    """What the heads read at every held-out row [M, D]: the context layer's output (heads
    with one need ``feats`` built with ``keep_all`` and ``rope``, and ``embed`` if it reads
    next tokens), else the base hidden state."""
    return context_hidden(heads, feats, rope, device, embed=embed) if heads.context is not None else feats.hidden


@torch.inference_mode()
def head_ranks(heads: DraftHeads, feats: Features, embed: nn.Embedding, lm_head: nn.Linear, *,
               device: str | torch.device = "cpu", batch_size: int = 4096, rope: Rope | None = None,
               hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] rank of the true token in each head's guesses (MISS if ≥ 10, -1 if no target).
    ``hidden``: ``draft_states``, if already computed (else from ``feats`` and ``rope``)."""
    heads = heads.to(device)
    m, k = feats.targets.shape
    hidden = draft_states(heads, feats, rope, device, embed) if hidden is None else hidden
    ranks = torch.full((m, k), -1, dtype=torch.long)
    for b in range(0, m, batch_size):
        sl = slice(b, b + batch_size)
        h = hidden[sl].to(device).float()
        states = head_states(heads, h, feats.parents[sl].to(device), embed)  # K x [B, D]
        for j in range(k):
            tgt = feats.targets[sl, j].to(device)
            ok = tgt != IGNORE
            logits = head_lm(heads, j, lm_head)(states[j]).float()  # [B, V]
            top = logits.topk(MAX_ARITY, dim=-1).indices  # [B, 10]
            hit = top == tgt[:, None]  # [B, 10]
            r = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(tgt, MISS))
            ranks[sl, j] = torch.where(ok, r, torch.full_like(r, -1)).cpu()
    return ranks


@torch.inference_mode()
def grown_depths(heads: DraftHeads, feats: Features, embed: nn.Embedding, lm_head: nn.Linear, growth: Growth, *,
                 device: str | torch.device = "cpu", batch_size: int = 2048, rope: Rope | None = None,
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[M] the heads' accepted depth at each held-out position on a tree grown by
    ``growth`` (``growth.py``), as the decoder's step would grow it there: the deepest
    grown node whose path spells the true next tokens. Along the true path a hydra head's
    states are the teacher-forced ones, which is what the decoder has at that position.
    Drafts through the heads' drafting vocabulary, as the decoder does. ``hidden``:
    ``draft_states``, if already computed."""
    heads = heads.to(device)
    if heads.spec.draft_vocab and getattr(heads, "vocab_head", None) is None:
        heads.use_draft_vocab(lm_head.weight.to(device))
    hidden = draft_states(heads, feats, rope, device, embed) if hidden is None else hidden
    m, depth = feats.targets.shape[0], growth.depth
    out = torch.zeros(m, dtype=torch.long)
    for b in range(0, m, batch_size):
        sl = slice(b, b + batch_size)
        h = hidden[sl].to(device).to(lm_head.weight.dtype)
        tokens, _, ancestors = heads.grow(h, feats.parents[sl, 0].to(device), growth, embed, lm_head)  # [B, N], [B, N, D]
        path = tokens.gather(1, (ancestors - 1).clamp(min=0).flatten(1)).view(ancestors.shape)  # [B, N, D] tokens root→node
        want = feats.targets[sl, :depth].to(device)[:, None, :]  # [B, 1, D] the true tokens after the root
        right = ((path == want) | (ancestors < 0)).all(-1)  # [B, N] the node's whole path is the true one
        out[sl] = torch.where(right, (ancestors >= 0).sum(-1), 0).amax(-1).cpu()
    return out


def path_rates(ranks: torch.Tensor, max_paths: int = 512) -> list[tuple[tuple[int, ...], float]]:
    """Acceptance rate of every observed rank path, most frequent first (≤ max_paths)."""
    m = ranks.shape[0]
    counts: Counter[tuple[int, ...]] = Counter()
    for row in ranks.tolist():
        path: tuple[int, ...] = ()
        for r in row:
            if r < 0 or r >= MISS:
                break
            path = path + (r,)
            counts[path] += 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))[:max_paths]
    return [(p, c / m) for p, c in ordered]


def lookup_lengths(seqs: Sequences, count: int) -> torch.Tensor:
    """[M] how many leading tokens of a ``count``-token lookup chain are right at each
    training position, in ``features.training_positions``' order. At position g the
    committed tokens are the sequence's up to g, the root is token g + 1 and chain node i
    guesses token g + 2 + i, as at decode time (``lookup_draft`` never reads past the root)."""
    out = []
    for s, r, e in zip(seqs.starts.tolist(), seqs.reply_starts.tolist(), seqs.ends.tolist()):
        seq = seqs.tokens[s:e]
        n = e - s
        g = torch.arange(r - 1 - s, n)  # [P] the sequence's training positions
        room = torch.cat((seq, seq.new_zeros(1)))  # the root's slot after the last token, as a cache has
        chain = lookup_draft(room.expand(len(g), n + 1), g + 1, room[g + 1], count)  # [P, count]
        idx = g[:, None] + 2 + torch.arange(count)  # [P, count] the tokens the chain guesses
        ok = (chain == seq[idx.clamp(max=n - 1)]) & (idx < n)
        out.append(ok.long().cumprod(dim=1).sum(dim=1))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def tree_depths(ranks: torch.Tensor, paths: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """[M] the heads' accepted depth at each position on a tree of these paths: the longest
    prefix of the position's rank row that is one of them."""
    have = set(paths)
    depths = []
    for row in ranks.tolist():
        d = 0
        while d < len(row) and 0 <= row[d] < MISS and tuple(row[: d + 1]) in have:
            d += 1
        depths.append(d)
    return torch.tensor(depths, dtype=torch.long)


def walked_tokens_per_step(reach: torch.Tensor, seqs: Sequences) -> float:
    """Tokens per step of greedy decoding over ``seqs``' replies: a step at position g
    (``features.training_positions``' order, ``reach`` [M] the drafts it would accept there)
    emits ``1 + reach[g]`` tokens, capped at the reply's end, and the next step begins at
    g plus that. The prefill's token (the reply's first) is no step's, as in the decoders."""
    tokens = steps = first = 0
    for r, e in zip(seqs.reply_starts.tolist(), seqs.ends.tolist()):
        row = reach[first:first + e - r + 1].tolist()  # index i: position g = r - 1 + i
        i = 0
        while r - 1 + i < e - 2:  # the root (g + 1) is not the reply's last token yet
            emitted = min(1 + row[i], e - 2 - (r - 1 + i))
            tokens, steps, i = tokens + emitted, steps + 1, i + emitted
        first += e - r + 1
    return tokens / steps if steps else 1.0


def walked_record(ranks: torch.Tensor, seqs: Sequences, record: dict[str, Any], sizes: Sequence[int],
                  lookup: dict[int, torch.Tensor], grown: GrownDepths | None = None) -> dict[str, float]:
    """{tree name: walked tokens per step} for the calibrated trees of ``sizes`` nodes, each
    also with every chain of ``lookup`` ({length: ``lookup_lengths``}) beside it, and the
    chains alone; with ``grown`` (the accepted depths of a grown tree of n nodes, for each
    size n), the grown trees ``dynamic-n`` too."""
    out: dict[str, float] = {}
    for n in sizes:
        if n <= 1:
            continue
        fixed = tree_from_calibration(record, n)
        trees = [(fixed.name, tree_depths(ranks, fixed.paths))]
        if grown is not None and (depths := grown(n)) is not None:
            trees.append((f"dynamic-{n}", depths))
        for name, depths in trees:
            out[name] = round(walked_tokens_per_step(depths, seqs), 4)
            for count, matched in lookup.items():
                out[f"{name}+lookup-{count}"] = round(walked_tokens_per_step(torch.maximum(depths, matched), seqs), 4)
    for count, matched in lookup.items():
        out[f"lookup-{count}"] = round(walked_tokens_per_step(matched, seqs), 4)
    return out


def calibrate(ranks: torch.Tensor, heads_kind: str, trees: Sequence[str] = ("medusa-64", "1-10-16-17"), *,
              sequences: Sequences | None = None, lookup: dict[int, torch.Tensor] | None = None,
              sizes: Sequence[int] = (), grown: GrownDepths | None = None) -> dict[str, Any]:
    """The calibration record written beside the heads (small JSON). With the held-out
    ``sequences`` the ranks came from, also ``record["tokens_per_step"]`` (module doc) for
    the calibrated trees of ``sizes`` nodes and the chains of ``lookup`` ({length:
    ``lookup_lengths``}), and with ``grown`` (hydra heads: ``grown_depths`` for a tree
    of n nodes) the grown trees of those sizes."""
    m, k = ranks.shape
    topk = []
    for j in range(k):
        valid = ranks[:, j] >= 0
        if heads_kind == "hydra" and j > 0:  # conditional on the parent being right
            valid &= ranks[:, j - 1] == 0
        r = ranks[valid, j]
        topk.append([round(float((r < n).float().mean()) if r.numel() else 0.0, 5) for n in range(1, MAX_ARITY + 1)])
    paths = path_rates(ranks)
    rates = dict(paths)
    record = {
        "kind": heads_kind, "positions": m, "topk_accuracy": topk,
        "paths": [[list(p), round(r, 6)] for p, r in paths],
        "expected_accepted": {name: round(expected_accepted(load_tree(name), rates), 4) for name in trees},
    }
    for n in (8, 16, 32, 64):
        record["expected_accepted"][f"calibrated-{n}"] = round(expected_accepted(tree_from_calibration(record, n), rates), 4)
    if sequences is not None:
        record["tokens_per_step"] = walked_record(ranks, sequences, record, sizes, lookup or {}, grown)
        for name in trees:  # the named trees too, heads only
            record["tokens_per_step"][name] = round(
                walked_tokens_per_step(tree_depths(ranks, load_tree(name).paths), sequences), 4)
    return record


def save_calibration(record: dict[str, Any], folder: Path) -> Path:
    path = Path(folder) / CALIBRATION_NAME
    path.write_text(json.dumps(record, indent=1))
    return path
