"""One decoding step, written once: propose → lay out → verify → accept → commit.

Vocabulary
----------
root         the last emitted token; its KV is not yet in the cache, it is tree node 0.
tree node    one candidate token; node i sits at position ``cache.length + depth[i]``.
path         root-to-leaf chain of nodes (one row of ``retrieve_indices``).
accepted     the nodes of the longest path whose every draft token equals what the base
             model itself picks at the parent node (greedy), or passes Medusa's typical
             acceptance test (temperature > 0). The root is always accepted.
bonus token  the base model's own pick after the last accepted node: free, always right.
step         one verify forward; it emits ``accepted`` tokens (drafts + bonus), ≥ 1.

A plain (non-speculative) step is the same step over the 1-node tree ``single``.

Batched: the same functions run B sequences at once over a ``batch_cache.BatchKVCache``.
Every per-sequence tensor then carries a leading batch axis (``root`` [B], ``state``
[B, D], tokens [B, N], hidden [B, N, D], accepted nodes [B, W] and counts [B]): each
sequence's tree sits in its own row, at its own positions, under a mask over its own
slots, and accepts and commits its own count. Shape comments write ``[..., N]`` where the
axis may be there; ``run_step`` gives [1 + W] for one sequence, [B, 1 + W] for a batch.

Every role has fixed shapes and reads what changes from device tensors (the cache's
``live_length``, ``StepParts.root``/``state``), so the same code runs eagerly (any cache,
either acceptance rule) or captured once as a CUDA graph and replayed (greedy, static
cache: ``StepUnit.capture``). A step ends in one host read (``settle``): the accepted
count and tokens, which is also when the caches' host lengths learn the count.

Greedy speculative output equals plain greedy output whatever the heads propose: every
emitted token is an argmax of the base model given exactly the tokens before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Sequence

import torch

from specmemo_core.runtime import step_kernels
from specmemo_core.runtime.batch_cache import BatchKVCache
from specmemo_core.runtime.growth import grown_layout
from specmemo_core.runtime.heads import ContextLayer, DraftHeads
from specmemo_core.runtime.kv_cache import KVCache
from specmemo_core.runtime.lookup import lookup_draft
from specmemo_core.runtime.model import CausalLM
from specmemo_core.runtime.tree import TreeBuffers


@dataclass(frozen=True)
class StepParts:
    """What every step of one decoder runs over, made once with it. ``root`` and ``state``
    carry one step to the next on the device: a step reads them and leaves the next ones
    there, so a captured graph needs nothing copied in."""

    model: CausalLM
    cache: KVCache | BatchKVCache
    heads: DraftHeads | None
    context: ContextLayer | None  # the heads' context layer, if they have one
    context_cache: KVCache | BatchKVCache | None  # its own one-layer cache, in lock-step with ``cache``
    root: torch.Tensor  # [...] long: the last emitted token, not yet in the cache ([B] batched)
    state: torch.Tensor  # [..., D] what the heads read: the draft state that produced ``root``


@dataclass(frozen=True)
class Proposal:
    tokens: torch.Tensor  # [..., N] every tree node's token, the root first
    layout: TreeBuffers  # the tree they sit in: the decoder's, or the one a grown tree grew this step


@dataclass(frozen=True)
class Verified:
    tokens: torch.Tensor  # [..., N] as proposed
    hidden: torch.Tensor  # [..., N, D] the verify forward's final hidden states


@dataclass(frozen=True)
class Accepted:
    nodes: torch.Tensor  # [..., W] the accepted path's row of ``retrieve_indices``, padding clamped to 0
    count: torch.Tensor  # [...] nodes of ``nodes`` accepted, the root included (1…W)
    picks: torch.Tensor  # [..., N] the base model's own pick after each node
    path: step_kernels.PathTokens | None = None  # the path's tokens, where ``greedy_path`` found them


# -- propose and verify -------------------------------------------------------

def draft_tokens(parts: StepParts, buf: TreeBuffers) -> Proposal:
    """Every tree node's token: the root, the heads' guesses, then the lookup chain (copied
    from the committed tokens in ``cache.ids``); and the tree they sit in (``buf``'s, or,
    for a grown tree, the one its heads grew this step)."""
    n, cache, m = buf.depths.shape[0], parts.cache, parts.model
    layout = buf
    if parts.heads is not None and buf.growth is not None:  # grown this step (growth.py)
        grown, depth, ancestors = parts.heads.grow(parts.state, parts.root, buf.growth, m.draft_embedding(), m.lm_head)
        tokens = torch.cat((parts.root[..., None], grown), dim=-1)  # [..., N - lookup]: the chain follows below
        layout = grown_layout(buf, depth, ancestors)
    elif parts.heads is not None and len(buf.level_starts) > 2:
        tokens = parts.heads.draft(parts.state, parts.root, buf, m.draft_embedding(), m.lm_head)  # [..., N]
    else:
        tokens = parts.root[..., None].expand(*parts.root.shape, n)  # [..., N]
    if not buf.lookup:
        return Proposal(tokens, layout)
    chain = lookup_draft(cache.ids, cache.live_length, parts.root, buf.lookup)  # [..., lookup]
    return Proposal(torch.cat((tokens[..., : n - buf.lookup], chain), dim=-1), layout)


def verify(parts: StepParts, proposal: Proposal, buf: TreeBuffers, span: int | None) -> Verified:
    """Run the tree at the cache's scratch slots: the cache lays out positions and mask."""
    positions, mask = parts.cache.prepare(buf.depths, buf.attn_mask, span)
    parts.cache.write_ids(proposal.tokens)
    return Verified(proposal.tokens, parts.model(proposal.tokens, positions, mask, parts.cache))  # [..., N, D]


# -- accept -------------------------------------------------------------------

def longest_accepted(ok: torch.Tensor, retrieve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The path (row of ``retrieve`` [L, d+1], -1 padded) accepted furthest from the root,
    and how many of its nodes are accepted, root included; both stay on the device (no
    host read, so a CUDA graph can hold it). ``ok`` [..., L, d]: each path's draft j
    accepted given its parent (a leading batch axis: one path per sequence, [..., d+1]
    and [...]; ``retrieve`` may carry it too, [..., L, d+1], for trees grown per
    sequence). Ties go to the first such path."""
    retrieve = retrieve.expand(*ok.shape[:-2], *retrieve.shape[-2:])  # [..., L, d+1]
    lengths = (ok & (retrieve[..., 1:] >= 0)).int().cumprod(dim=-1).sum(dim=-1)  # [..., L] accepted drafts
    best = lengths.argmax(dim=-1, keepdim=True)  # [..., 1] gather, not [t]: a 0-dim index syncs
    rows = retrieve.gather(-2, best[..., None].expand(*best.shape, retrieve.shape[-1]))[..., 0, :]  # [..., d+1]
    return rows, lengths.gather(-1, best).squeeze(-1) + 1


def at_nodes(x: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
    """``x`` [..., N] at ``nodes`` [L, W], or at per-row ``nodes`` [..., L, W]: [..., L, W]."""
    if nodes.dim() == 2:
        return x[..., nodes]
    return x.gather(-1, nodes.flatten(-2)).view(nodes.shape)


class Acceptance(Protocol):
    """A rule that picks the base model's tokens and accepts drafts."""

    graph_safe: ClassVar[bool]  # no host read and no host RNG: a CUDA graph can hold it

    def first(self, model: CausalLM, hidden: torch.Tensor) -> int:
        """The token after the last of ``hidden`` [T, D] (a prefill's)."""
        ...

    def accept(self, model: CausalLM, verified: Verified, buf: TreeBuffers) -> Accepted:
        ...


def root_only(picks: torch.Tensor) -> Accepted:
    """What a 1-node tree (a plain step) accepts: its root, nothing to compare. Its path is
    node 0, of count 1 (``commit`` then takes its one-node path: fewer ops, which a CPU
    step pays ~50 µs each for with its caches cold after the forward)."""
    nodes = picks.new_zeros(*picks.shape[:-1], 1)  # [..., 1]
    return Accepted(nodes, nodes[..., 0] + 1, picks)


def _accepted(ok: torch.Tensor, picks: torch.Tensor, buf: TreeBuffers) -> Accepted:
    row, count = longest_accepted(ok, buf.retrieve_indices)
    return Accepted(row.clamp(min=0), count, picks)


@dataclass(frozen=True)
class GreedyAcceptance:
    """Accept a draft that equals its parent's argmax (needs no [N, V] logits)."""

    graph_safe: ClassVar[bool] = True

    def first(self, model: CausalLM, hidden: torch.Tensor) -> int:
        return int(model.greedy_picks(hidden[-1:])[0])

    def accept(self, model: CausalLM, verified: Verified, buf: TreeBuffers) -> Accepted:
        picks = model.greedy_picks(verified.hidden)  # [..., N]
        if verified.tokens.shape[-1] == 1:
            return root_only(picks)
        if step_kernels.applies(picks):  # one kernel for what follows and ``accepted_path``'s gathers
            nodes, count, path = step_kernels.greedy_path(verified.tokens, picks, buf.retrieve_indices)
            return Accepted(nodes, count, picks, path)
        nodes = buf.retrieve_indices.clamp(min=0)  # [L, d+1] ([..., L, d+1]: grown per sequence)
        # [..., L, d]: a child equals its parent's argmax
        ok = at_nodes(verified.tokens, nodes[..., 1:]) == at_nodes(picks, nodes[..., :-1])
        return _accepted(ok, picks, buf)


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's typical acceptance at ``temperature`` > 0: accept a draft whose probability
    exceeds min(epsilon, delta * exp(-entropy)) of its parent's distribution; the picks
    are samples (on the CPU generator ``generator``) from those same distributions."""

    temperature: float
    epsilon: float
    delta: float
    generator: torch.Generator
    top_p: float = 1.0  # nucleus: each distribution keeps its most likely tokens up to this mass

    graph_safe: ClassVar[bool] = False

    def probs(self, model: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's distribution [T, V] after each hidden state, at the temperature
        (and within the top-p nucleus: the rest is 0, so a draft outside it is rejected)."""
        probs = torch.softmax(model.logits(hidden).float() / self.temperature, dim=-1)  # [T, V]
        return probs if self.top_p >= 1.0 else nucleus(probs, self.top_p)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token [T] from each row of ``probs``, on ``probs``' device."""
        return torch.multinomial(probs.cpu(), 1, generator=self.generator)[:, 0].to(probs.device)

    def first(self, model: CausalLM, hidden: torch.Tensor) -> int:
        return int(self.sample(self.probs(model, hidden[-1:]))[0])

    def accept(self, model: CausalLM, verified: Verified, buf: TreeBuffers) -> Accepted:
        nodes = buf.retrieve_indices.clamp(min=0)  # [L, d+1]
        probs = self.probs(model, verified.hidden)  # [N, V]
        entropy = -(probs * torch.log(probs.clamp_min(1e-10))).sum(-1)  # [N]
        threshold = torch.minimum(torch.full_like(entropy, self.epsilon), self.delta * torch.exp(-entropy))  # [N]
        parent = nodes[:, :-1]  # [L, d]
        ok = probs[parent, verified.tokens[nodes[:, 1:]]] > threshold[parent]  # [L, d]
        return _accepted(ok, self.sample(probs), buf)  # the same probs, sampled once


@dataclass(frozen=True)
class RowAcceptance:
    """One rule per sequence of a batch (greedy and sampled rows side by side): each row
    accepts by its own rule over its own tree. Used only where some row samples (else the
    batch runs ``GreedyAcceptance`` whole, which a CUDA graph can hold)."""

    rules: tuple[Acceptance, ...]  # [B]

    graph_safe: ClassVar[bool] = False

    def first(self, model: CausalLM, hidden: torch.Tensor) -> int:
        raise TypeError("a batch's first tokens come from each sequence's own rule")

    def accept(self, model: CausalLM, verified: Verified, buf: TreeBuffers) -> Accepted:
        rows = [rule.accept(model, Verified(verified.tokens[b], verified.hidden[b]), buf.row(b))
                for b, rule in enumerate(self.rules)]
        return Accepted(torch.stack([r.nodes for r in rows]), torch.stack([r.count for r in rows]),
                        torch.stack([r.picks for r in rows]))  # [B, W], [B], [B, N]


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [T, V] with each row cut to its most likely tokens whose mass reaches
    ``top_p`` (the most likely one always kept), renormalized."""
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [T, V]
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # [T, V] the mass before a token already reaches top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))  # [T, V]
    return kept / kept.sum(-1, keepdim=True)


# -- prefill and commit -------------------------------------------------------

def prefill(parts: StepParts, new_ids: Sequence[int], *, chunk: int,
            run_chunk: Callable[[Sequence[int], Sequence[int] | None], torch.Tensor] | None = None) -> torch.Tensor:
    """Run prompt tokens ``chunk`` at a time into the caches (committed as they go); leave
    the last one's draft state in ``parts.state`` and return its hidden state [..., 1, D].
    The token tensors take the root's shape plus a token axis: [T] for one sequence, [1, T]
    for one row of a batched cache (a sequence joining a batch is prefilled alone).

    A context layer that reads next tokens (``reads_next``) cannot run the last prompt
    token yet: its next token is the first reply token. That position stays pending, its
    hidden state in ``parts.state``, until ``finish_prefill`` runs it once the root is chosen.

    ``run_chunk(ids, following)`` runs one chunk (``following``: each position's next
    token, the chunk's last one's where known, for a layer that reads it; else None) and
    returns ``padded_prefill``'s hidden state: by default the chunk as it is
    (``chunk_as_is``); a static decoder pads it to a fixed shape and replays a graph."""
    parts.cache.ensure_room(len(new_ids))
    pending = reads_next(parts)
    run = run_chunk or (lambda ids, following: chunk_as_is(parts, ids, following))
    hidden = None
    for start in range(0, len(new_ids), chunk):
        ids, following = new_ids[start:start + chunk], new_ids[start + 1:start + chunk + 1]
        hidden = run(ids, following if pending else None)
        parts.cache.commit_prefix(len(ids))
        if parts.context_cache is not None:  # less the pending last position: its next token is not known yet
            parts.context_cache.commit_prefix(len(following) if pending else len(ids))
    return hidden


def chunk_as_is(parts: StepParts, ids: Sequence[int], following: Sequence[int] | None) -> torch.Tensor:
    """``padded_prefill`` over a chunk without padding: [..., 1, D] (see ``prefill``)."""
    device, lead = parts.root.device, parts.root.shape
    tokens = torch.tensor(ids, device=device).view(*lead, -1)  # [..., T]
    nexts = None
    if following is not None:  # the pending last position's next token is unknown: any token stands in
        nexts = torch.tensor(list(following) + list(ids[len(following):]), device=device).view(*lead, -1)
    count = torch.full(lead, len(ids), dtype=torch.long, device=device)
    return padded_prefill(parts, tokens, nexts, count, None)


def padded_prefill(parts: StepParts, tokens: torch.Tensor, following: torch.Tensor | None, count: torch.Tensor,
                   span: int | None) -> torch.Tensor:
    """One prefill chunk in fixed shapes (a CUDA graph can hold it): ``tokens`` [..., T] at
    the cache's scratch slots, of which the first ``count`` [...] (a device tensor) are the
    prompt's and the rest padding; ``following`` [..., T]: each position's next token, for
    a context layer that reads it (None otherwise). Padding sits after the prompt under a
    causal mask, so the prompt's keys, values and hidden states are an unpadded chunk's.
    ``span``: the slots attended (None: the whole cache). Commits nothing (``prefill``
    commits ``count``, less a pending last position); leaves the last prompt token's draft state in ``parts.state`` (its hidden
    state where that position is pending) and returns its hidden state [..., 1, D]."""
    t = tokens.shape[-1]
    positions, mask = parts.cache.prepare(torch.arange(t, device=tokens.device), span=span)
    parts.cache.write_ids(tokens)
    # without a context layer only the last prompt token's hidden state is read
    hidden = parts.model(tokens, positions, mask, parts.cache, last_only=parts.context is None)  # [..., T, D]
    draft = contextualize(parts, hidden, span, next_ids=following)  # [..., T, D]
    last = (count - 1)[..., None, None].expand(*count.shape, 1, hidden.shape[-1])  # [..., 1, D]
    parts.state.copy_((hidden if reads_next(parts) else draft).gather(-2, last)[..., 0, :])
    return hidden.gather(-2, last)


def reads_next(parts: StepParts) -> bool:
    """The heads' context layer reads each position's next token (``heads.ContextLayer``)."""
    return parts.context is not None and parts.context.reads_next


def finish_prefill(parts: StepParts) -> None:
    """After a prefill, once the first reply token is in ``parts.root``: run the pending last
    prompt position through a context layer that reads next tokens (``prefill``), commit it,
    and leave its draft state in ``parts.state``. Nothing to do for other heads."""
    if not reads_next(parts):
        return
    draft = contextualize(parts, parts.state[..., None, :], next_ids=parts.root[..., None])  # [..., 1, D]
    parts.context_cache.commit_prefix(1)
    parts.state.copy_(draft[..., 0, :])


def contextualize(parts: StepParts, hidden: torch.Tensor, span: int | None = None, *,
                  next_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draft states [..., T, D] for T hidden states at the context cache's scratch slots:
    the heads' context layer over them (the caller commits its cache), or ``hidden``.
    ``next_ids`` [..., T]: each position's next token, for a layer that reads it."""
    if parts.context is None:
        return hidden
    c = parts.context_cache
    positions, mask = c.prepare(torch.arange(hidden.shape[-2], device=hidden.device), span=span)
    next_emb = parts.model.draft_embedding()(next_ids) if reads_next(parts) else None
    cos, sin, bias = parts.model.tables(positions, mask, parts.context.mspec)
    return parts.context(hidden, cos, sin, mask, c, next_emb, bias=bias)


def commit(parts: StepParts, verified: Verified, accepted: Accepted, span: int | None) -> torch.Tensor:
    """Commit the accepted path's KV (the whole fixed-size row; only ``count`` entries
    count) and the context layer's, leave the next root and draft state in ``parts``, and
    return [..., 1 + W]: the count, then the emitted tokens (accepted drafts, then the bonus)."""
    nodes, count = accepted.nodes, accepted.count  # [..., W], [...]
    # a one-node path is the root, already at its slot: no entries to move (a plain step)
    parts.cache.commit_row(nodes if nodes.shape[-1] > 1 else None, count)
    emitted, bonus, path_hidden, last = accepted_path(verified, accepted)
    path_hidden = contextualize(parts, path_hidden, span, next_ids=emitted)  # at length, length+1, …
    if parts.context_cache is not None:
        parts.context_cache.commit_row(None, count)
    parts.root.copy_(bonus[..., 0])
    parts.state.copy_(at_last(path_hidden, last)[..., 0, :])
    if accepted.path is not None:
        return accepted.path.out
    return torch.cat((count.unsqueeze(-1), emitted), dim=-1)  # [..., 1 + W]


def accepted_path(verified: Verified, accepted: Accepted) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor | None]:
    """The accepted path's emitted tokens [..., W] (the token after each node: the next
    accepted draft, then the bonus pick), the bonus pick [..., 1], its hidden states
    [..., W, D], and the index of its last accepted node [..., 1]. A 1-node path (a plain
    step, ``root_only``) needs none of a longer path's gathers: its root and the pick after
    it, ``last`` None."""
    nodes = accepted.nodes  # [..., W]
    w, d = nodes.shape[-1], verified.hidden.shape[-1]
    if w == 1:
        bonus = accepted.picks[..., :1]  # [..., 1]
        return bonus, bonus, verified.hidden[..., :1, :], None
    path_hidden = verified.hidden.gather(-2, nodes[..., None].expand(*nodes.shape, d))  # [..., W, D]
    if accepted.path is not None:  # found by ``step_kernels.greedy_path``
        return accepted.path.out[..., 1:], accepted.path.bonus, path_hidden, accepted.path.last
    # gather, not x[t]: indexing by a 0-dim tensor reads it on the host (a sync, which
    # graph capture forbids)
    last = (accepted.count - 1).unsqueeze(-1)  # [..., 1]
    bonus = accepted.picks.gather(-1, nodes.gather(-1, last))  # [..., 1]
    j = torch.arange(w, device=nodes.device)  # [W]
    drafted = verified.tokens.gather(-1, nodes[..., (j + 1).clamp(max=w - 1)])  # [..., W] the token after each node
    emitted = torch.where(j < last, drafted, bonus)  # [..., W]: the token after each path node
    return emitted, bonus, path_hidden, last


def at_last(hidden: torch.Tensor, last: torch.Tensor | None) -> torch.Tensor:
    """A path's hidden states [..., W, D] at its last accepted node ``last`` [..., 1]
    (``accepted_path``; None: a 1-node path, already that node's): [..., 1, D]."""
    if last is None:
        return hidden
    return hidden.gather(-2, last[..., None].expand(*last.shape, hidden.shape[-1]))


STEP_PHASES = ("draft", "verify", "accept", "commit")  # profiler ranges of ``run_step``


def run_step(parts: StepParts, buf: TreeBuffers, acceptance: Acceptance, span: int | None) -> torch.Tensor:
    """The whole step on the device: [..., 1 + W] (see ``commit``), no host read. Each phase
    runs under a profiler range of its name (``STEP_PHASES``; host-side only, nothing in a
    captured graph): where a step's kernels go (``scripts/time_graph_steps.py --kernels``)."""
    phase = torch.profiler.record_function
    with phase("draft"):
        proposal = draft_tokens(parts, buf)
    with phase("verify"):
        verified = verify(parts, proposal, proposal.layout, span)
    with phase("accept"):
        accepted = acceptance.accept(parts.model, verified, proposal.layout)
    with phase("commit"):
        return commit(parts, verified, accepted, span)


def settle(parts: StepParts, out: torch.Tensor) -> list[int] | list[list[int]]:
    """The step's one host read: its emitted tokens (per sequence, batched); the caches'
    host lengths learn the counts."""
    values = out.tolist()
    rows = values if out.dim() > 1 else [values]
    counts = [row[0] for row in rows]
    for cache in (parts.cache, parts.context_cache):
        if cache is not None:
            cache.settle(counts if out.dim() > 1 else counts[0])
    emitted = [row[1:1 + count] for row, count in zip(rows, counts)]
    return emitted if out.dim() > 1 else emitted[0]


# -- eager or captured --------------------------------------------------------

def capture_graph(run: Callable[[], torch.Tensor], *, warmup: int = 2, pool=None,
                  stream: torch.cuda.Stream | None = None, after_warmup: Callable[[], None] | None = None):
    """Capture ``run()`` as a CUDA graph after ``warmup`` runs on a side stream (as capture
    requires); returns the graph and the outputs of the captured run, which every replay
    rewrites in place. ``after_warmup``: called after each warm-up run (to undo its effects).
    ``pool``: a memory pool shared with other graphs. ``stream``: the side stream (None: a
    new one). Share one between captures: cuBLAS keeps a workspace for every stream it has
    run on (32 MiB each on an H200), for the life of the process."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
            if after_warmup is not None:
                after_warmup()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


class Launched:
    """A step started on the device and not yet read: ``read`` waits for it and settles it
    (``settle``), ``discard`` waits for it and undoes what it committed on the device."""

    def __init__(self, parts: StepParts, out: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self.parts, self._out, self._done = parts, out, done

    def _wait(self) -> None:
        if self._done is not None:
            self._done.synchronize()

    def read(self) -> list[int] | list[list[int]]:
        self._wait()
        return settle(self.parts, self._out)

    def discard(self) -> None:
        """The step's commits undone: the caches' device lengths back to their host ones (the
        slots past them are scratch). ``root`` and ``state`` keep what it left: the next
        prefill writes both."""
        self._wait()
        rewind(self.parts)


def rewind(parts: StepParts) -> None:
    """The caches' device lengths back to their host ones: undoes commits not settled (a
    capture's trial runs, a step started for a reply that ended)."""
    for cache in (parts.cache, parts.context_cache):
        if cache is not None:
            cache.rewind()


class StepUnit:
    """One step over one tree (and, on a static cache, one attended ``span``), run eagerly
    or replayed as a captured CUDA graph. Calling it runs a step and returns the tokens it
    emitted (one list per sequence over a batched cache); ``launch`` only starts it, so the
    host can start the next step before it reads this one (``Decoder.generate``)."""

    def __init__(self, parts: StepParts, buffers: TreeBuffers, acceptance: Acceptance, *,
                 span: int | None = None) -> None:
        self.parts, self.buffers, self.acceptance, self.span = parts, buffers, acceptance, span
        self.nodes = buffers.depths.shape[0]
        self.graph: torch.cuda.CUDAGraph | None = None
        self._out: torch.Tensor | None = None
        self._host: list[torch.Tensor] = []  # two pinned copies of a graph's output (``launch``)

    @torch.inference_mode()
    def _run(self) -> torch.Tensor:
        return run_step(self.parts, self.buffers, self.acceptance, self.span)

    def capture(self, *, pool=None, stream: torch.cuda.Stream | None = None, warmup: int = 2) -> None:
        """Capture the step as a CUDA graph (greedy acceptance, static cache). The warm-up
        runs commit and move the root and state: each is undone, so the conversation is
        as it was."""
        if not self.acceptance.graph_safe:
            raise ValueError("only a graph-safe acceptance rule (greedy) can be captured")
        p = self.parts
        root, state = p.root.clone(), p.state.clone()

        def undo() -> None:
            p.root.copy_(root)
            p.state.copy_(state)
            rewind(p)

        self.graph, self._out = capture_graph(self._run, warmup=warmup, pool=pool, stream=stream, after_warmup=undo)

    def __call__(self) -> list[int] | list[list[int]]:
        return self.launch().read()

    def launch(self, *, ahead: int = 0) -> Launched:
        """Start the step: a graph's replay is queued with a copy of its output into pinned
        host memory (two, taken in turn: the next replay of the same graph rewrites its
        output before this one is read); an eager step just runs. ``ahead``: tokens a step
        still in flight may commit before this one runs (its room and span must hold them)."""
        cache = self.parts.cache
        cache.ensure_room(ahead + self.nodes)
        if self.span is not None and cache.length + ahead + self.nodes > self.span:
            raise ValueError(f"this step unit attends over {self.span} slots; the cache needs a larger span")
        if self.graph is None:
            return Launched(self.parts, self._run(), None)
        if not self._host:
            self._host = [torch.empty_like(self._out, device="cpu", pin_memory=True) for _ in range(2)]
        self.graph.replay()
        host = self._host[0]
        self._host.reverse()
        host.copy_(self._out, non_blocking=True)  # on the graph's device's stream, as its replay
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._out.device))
        return Launched(self.parts, host, done)
