"""The decoding loop: prefill, then propose → verify on the tree → accept → commit.

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

Greedy speculative output equals plain greedy output whatever the heads propose: every
emitted token is an argmax of the base model given exactly the tokens before it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.runtime.heads import DraftHeads
from specmemo_core.runtime.kv_cache import KVCache
from specmemo_core.runtime.lookup import lookup_draft
from specmemo_core.runtime.model import CausalLM
from specmemo_core.runtime.tree import Tree, TreeBuffers

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory on long prompts


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    seed: int = 0
    # Medusa's typical acceptance (temperature > 0): accept a draft token whose
    # probability exceeds min(epsilon, delta * exp(-entropy)).
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3

    def __post_init__(self) -> None:
        if not self.max_new_tokens >= 1:
            raise SpecMemoError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0 and self.temperature < float("inf")):
            raise SpecMemoError(f"temperature must be a number ≥ 0, got {self.temperature}")


@dataclass(frozen=True)
class Step:
    """What one forward produced: the new tokens and how long the forward took."""

    token_ids: tuple[int, ...]
    accepted: int  # tokens this step emitted before any stop cut (drafts + bonus)
    forward_s: float
    tree_nodes: int
    prefill: bool = False


@dataclass
class _State:
    root: int  # emitted, not yet in the cache
    hidden: torch.Tensor  # [D] what the heads read: the hidden state that produced ``root``
    # (after the heads' context layer, when they have one)


def longest_accepted(ok: torch.Tensor, retrieve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The path (row of ``retrieve`` [L, d+1], -1 padded) accepted furthest from the root,
    and how many of its nodes are accepted, root included; both stay on the device (no
    host read, so a CUDA graph can hold it). ``ok`` [L, d]: each path's draft j accepted
    given its parent."""
    lengths = (ok & (retrieve[:, 1:] >= 0)).int().cumprod(dim=1).sum(dim=1)  # [L] accepted drafts
    best = lengths.argmax().view(1)  # index_select, not [t]: indexing by a 0-dim tensor syncs
    return retrieve.index_select(0, best)[0], lengths.index_select(0, best)[0] + 1


def draft_tokens(model: CausalLM, heads: DraftHeads | None, cache: KVCache, buf: TreeBuffers,
                 hidden: torch.Tensor, root: torch.Tensor | int, length: torch.Tensor | int) -> torch.Tensor:
    """Every tree node's token [N]: the root, the heads' guesses, then the lookup chain
    (copied from the ``length`` committed tokens in ``cache.ids``)."""
    n = buf.depths.shape[0]
    if heads is not None and len(buf.level_starts) > 2:
        tokens = heads.draft(hidden, root, buf, model.model.embed_tokens, model.lm_head)  # [N]
    else:
        tokens = torch.as_tensor(root, device=cache.ids.device).view(1).expand(n)
    if not buf.lookup:
        return tokens
    chain = lookup_draft(cache.ids, length, root, buf.lookup)  # [lookup]
    return torch.cat((tokens[: n - buf.lookup], chain))


@dataclass
class Decoder:
    """One conversation's decoding state over a model, optional heads and a tree.

    ``history`` mirrors the token ids whose KV sits in ``cache`` (``len == cache.length``),
    so a new turn re-uses every cached token it shares with the previous one.
    """

    model: CausalLM
    cache: KVCache
    heads: DraftHeads | None = None
    tree: Tree | None = None
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.tree is not None:
            if not self.tree.paths:
                self.heads = None  # a lookup chain alone (or a 1-node tree): the heads would draft nothing
            self.tree.check_heads(self.heads.num_heads if self.heads is not None else None)
        self._buffers = self.tree.buffers.to(self.model.device) if self.speculative else None
        # The heads' context layer (if any) keeps its own one-layer cache in lock-step
        # with ``cache``: allocated here, once, at the same capacity.
        self._context = getattr(self.heads, "context", None) if self.speculative else None
        self._context_cache = self._new_context_cache() if self._context is not None else None

    def _new_context_cache(self) -> KVCache:
        return self._context.new_cache(self.cache.capacity, self.model.dtype, self.model.device)

    @property
    def speculative(self) -> bool:
        """A tree to verify: heads' nodes (given heads) and/or a lookup chain."""
        return self.tree is not None and self.tree.speculates(self.heads)

    def reset(self) -> None:
        self.cache.reset()
        if self._context_cache is not None:
            self._context_cache.reset()
        self.history.clear()

    def _contextualize(self, hidden: torch.Tensor, past: int) -> torch.Tensor:
        """Draft states [T, D] for T tokens just committed at positions past…past+T-1:
        the heads' context layer over them (committing its own cache), or ``hidden``."""
        if self._context is None:
            return hidden
        t = hidden.shape[0]
        positions, mask = self._context_cache.prepare(torch.arange(t, device=hidden.device))
        cos, sin = self.model.rope(positions)
        out = self._context(hidden, cos, sin, mask, self._context_cache)
        self._context_cache.commit_prefix(t)
        return out

    def _run(self, tokens: torch.Tensor, offsets: torch.Tensor, ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, D] of ``tokens`` at scratch slots: see ``KVCache.prepare``
        (the cache decides positions and mask, so a static-shape cache slots in)."""
        positions, mask = self.cache.prepare(offsets, ancestors)
        self.cache.write_ids(tokens)
        return self.model(tokens, positions, mask, self.cache)

    # -- prefill ---------------------------------------------------------------
    def _reuse_prefix(self, prompt_ids: Sequence[int]) -> list[int]:
        """Truncate the cache to the longest prefix shared with ``prompt_ids``; return the rest."""
        common = 0
        for a, b in zip(self.history, prompt_ids):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt_ids) - 1)  # at least one token must run
        self.cache.truncate(common)
        if self._context_cache is not None:
            self._context_cache.truncate(common)
        del self.history[common:]
        return list(prompt_ids[common:])

    @torch.inference_mode()
    def _prefill(self, new_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the new prompt tokens; return the last one's hidden state and draft state."""
        self.cache.ensure_room(len(new_ids))
        device = self.model.device
        hidden = draft = None
        for start in range(0, len(new_ids), PREFILL_CHUNK):
            chunk = torch.tensor(new_ids[start:start + PREFILL_CHUNK], device=device)
            past = self.cache.length
            hidden = self._run(chunk, torch.arange(chunk.numel(), device=device))
            self.cache.commit_prefix(chunk.numel())
            draft = self._contextualize(hidden, past)
            self.history.extend(new_ids[start:start + PREFILL_CHUNK])
        return hidden[-1], draft[-1]  # [D], [D]

    # -- generation ------------------------------------------------------------
    def generate(
        self, prompt_ids: Sequence[int], config: GenerationConfig, cancel: threading.Event | None = None
    ) -> Iterator[Step]:
        """Yield Steps until a stop token, ``max_new_tokens`` or ``cancel`` is set.

        ``prompt_ids``: the whole conversation so far, chat template applied. Tokens it
        shares with the cache are not run again.
        """
        if not prompt_ids:
            raise SpecMemoError("the prompt is empty: type a message first")
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        new_ids = self._reuse_prefix(prompt_ids)
        t0 = time.perf_counter()
        last_hidden, draft_state = self._prefill(new_ids)
        first = self._pick(last_hidden[None], config, gen)[0]
        state = _State(root=int(first), hidden=draft_state)
        emitted = 1
        stop = first in config.stop_token_ids
        yield Step((first,) if not stop else (), 1, time.perf_counter() - t0, len(new_ids), prefill=True)
        while not stop and emitted < config.max_new_tokens:
            if cancel is not None and cancel.is_set():
                return
            t0 = time.perf_counter()
            tokens, state = self._step(state, config, gen)
            dt = time.perf_counter() - t0
            out: list[int] = []
            for tok in tokens:
                if tok in config.stop_token_ids:
                    stop = True
                    break
                out.append(tok)
                emitted += 1
                if emitted >= config.max_new_tokens:
                    break
            yield Step(tuple(out), len(tokens), dt, self._nodes_used)

    @torch.inference_mode()
    def _step(self, state: _State, config: GenerationConfig, gen: torch.Generator) -> tuple[list[int], _State]:
        room = self.cache.free_slots()
        if room < 1:
            self.cache.ensure_room(1)
        if not self.speculative or room < self.tree.num_nodes:
            return self._plain_step(state, config, gen)
        buf = self._buffers
        n = self.tree.num_nodes
        tokens = draft_tokens(self.model, self.heads, self.cache, buf, state.hidden, state.root,
                              self.cache.length)  # [N]
        past = self.cache.length
        hidden = self._run(tokens, buf.depths, buf.attn_mask)  # [N, D]
        path, picks = self._accept(tokens, hidden, buf.retrieve_indices, config, gen)  # path: [A] node ids
        self.cache.commit(path)
        path_list = path.tolist()
        token_list = tokens.tolist()
        self.history.extend(token_list[i] for i in path_list)
        bonus = int(picks[path_list[-1]])
        emitted = [token_list[i] for i in path_list[1:]] + [bonus]
        self._nodes_used = n
        draft = self._contextualize(hidden[path], past)  # the path's nodes sit at past, past+1, …
        return emitted, _State(root=bonus, hidden=draft[-1])

    def _plain_step(self, state: _State, config: GenerationConfig, gen: torch.Generator) -> tuple[list[int], _State]:
        device = self.model.device
        past = self.cache.length
        tokens = torch.tensor([state.root], device=device)
        hidden = self._run(tokens, torch.zeros(1, dtype=torch.long, device=device))
        self.cache.commit_prefix(1)
        self.history.append(state.root)
        nxt = int(self._pick(hidden, config, gen)[0])
        self._nodes_used = 1
        return [nxt], _State(root=nxt, hidden=self._contextualize(hidden, past)[0])

    _nodes_used: int = 1

    # -- acceptance ------------------------------------------------------------
    def _pick(self, hidden: torch.Tensor, config: GenerationConfig, gen: torch.Generator) -> list[int]:
        """The base model's own choice after each hidden state [T, D]: the argmax (without
        full logits: ``CausalLM.greedy_picks``), or at temperature > 0 a sample."""
        if config.temperature == 0.0:
            return self.model.greedy_picks(hidden).tolist()
        return self._sample(self._probs(hidden, config), gen)

    def _probs(self, hidden: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
        """The base model's distribution [T, V] after each hidden state, at the temperature."""
        return torch.softmax(self.model.logits(hidden).float() / config.temperature, dim=-1)

    @staticmethod
    def _sample(probs: torch.Tensor, gen: torch.Generator) -> list[int]:
        """One token from each row of ``probs`` (on the CPU generator ``gen``)."""
        return torch.multinomial(probs.cpu(), 1, generator=gen)[:, 0].tolist()

    def _accept(
        self, tokens: torch.Tensor, hidden: torch.Tensor, retrieve: torch.Tensor,
        config: GenerationConfig, gen: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the accepted path (node ids, root first) and each node's own pick.

        tokens: [N], hidden: [N, D] (the verify forward's), retrieve: [L, depth+1] (-1 padded).
        Greedy needs no [N, V] logits; typical acceptance needs every node's distribution.
        """
        nodes = retrieve.clamp(min=0)  # [L, d+1]
        drafts = tokens[nodes[:, 1:]]  # [L, d] token at each child along each path
        if config.temperature == 0.0:
            picks = self.model.greedy_picks(hidden)  # [N]
            ok = drafts == picks[nodes[:, :-1]]  # [L, d] child equals parent's argmax
        else:
            probs = self._probs(hidden, config)  # [N, V]
            entropy = -(probs * torch.log(probs.clamp_min(1e-10))).sum(-1)  # [N]
            threshold = torch.minimum(
                torch.full_like(entropy, config.typical_epsilon), config.typical_delta * torch.exp(-entropy)
            )  # [N]
            parent = nodes[:, :-1]
            p_child = probs[parent, drafts]  # [L, d]
            ok = p_child > threshold[parent]
            picks = torch.tensor(self._sample(probs, gen), device=probs.device)  # the same probs, once
        row, count = longest_accepted(ok, retrieve)
        return row[: int(count)], picks
