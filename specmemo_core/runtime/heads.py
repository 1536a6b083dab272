"""Draft heads: K small residual blocks that guess the tokens after the next one.

Head k (0-based) reads the final hidden state at position t and proposes the token at
t + k + 2 (the base LM head already gives t + 1). Each head is ``num_layers`` residual
SiLU blocks, ``x + SiLU(W x + b)``, followed by an LM head. By default that LM head is
the base model's own frozen one, so a head costs D² + D parameters (1.3 MB in fp32 for
the default model) instead of the ~0.6 GB per head the SpecMemo paper budgets for a
7B model with a private vocabulary projection. Per-head LM heads are supported to load
checkpoints in the FasterDecoding Medusa format.

Two kinds share the files and the tree decoder:

* ``medusa``: head k sees only the hidden state, so all heads draft in one call and a
  node's token is ``topk(head[depth-1])[rank]`` whatever its parent is.
* ``hydra``: heads form a small recurrent chain along each tree path. Every node n
  gets a state ``s(n) = g_d(s(parent), e(token of n))`` where d is n's depth, the
  root's parent state is the base hidden state h, and
  ``g_d(s, e) = s + SiLU(W_d [s; e] + b_d)`` followed by ``num_layers - 1`` residual
  blocks; n's children are the top-k of ``LM head(s(n))``. So head d sees the whole
  drafted path, not just h (as Hydra's sequentially dependent heads do). Drafting goes
  level by level down the tree: a few extra small matmuls per step.

Context layer (optional, hydra only)
------------------------------------
Both kinds above read one hidden state, h_t. A ``context`` layer — one small Llama
decoder layer (attention over every committed position, then a SiLU MLP) with its own
KV cache — turns the base model's hidden states into h'_t = h_t + layer(h_≤t), and the
heads read h'_t instead (Hydra++'s "prefix attention"): a head then sees which tokens
came before, not only the last state. Its output projections start at zero, so an
untrained context layer passes h through unchanged. The decoder runs it on every
committed token (prefill chunks and each step's accepted path), in lock-step with the
base model's cache; it never touches what is emitted, only what is proposed.

A context layer may also read the *next* token (``context_next``): its input at position i
is h_i + P·norm(e(x_{i+1})), P starting at zero. Every committed position's next token is
known when it is committed (the token after it on the accepted path, or the bonus token),
except the prompt's last, whose next token is the first reply token: a prefill leaves that
position pending (its hidden state held in the draft-state buffer) and
``step.finish_prefill`` runs it once the first token is chosen. So the draft state the
heads read has seen the root token, and its attention can look for where that token came
before (what followed it then is what a reply that copies will say next). In a trial on
4,000 distilled replies this raised the held-out walked tokens per step of
``calibrated-48+lookup-8`` from 3.22 to 3.32 (``scripts/feature_layers_trial.py``,
``docs/results/feature_layers_h200/``), and heads trained so went from 3.29 to 3.40 on
MT-Bench (README, "Draft heads").

Files
-----
Own format: one ``heads.safetensors`` whose metadata records the kind, the shapes and
the identity (name + fingerprint) of the base model it was trained on; loading it onto
another model is refused. Medusa format: a folder with ``config.json``
(``medusa_num_heads``, ``medusa_num_layers``) and ``medusa_lm_head.safetensors`` or
``medusa_lm_head.pt``; a ``.pt`` is read with ``weights_only=True`` so pickled code is
never executed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from specmemo_core.errors import HeadsError, TreeError
from specmemo_core.runtime import step_kernels
from specmemo_core.runtime.growth import DEPTH_TIEBREAK, MIN_SCORE, Growth, pick_nodes
from specmemo_core.runtime.kv_cache import KVCache
from specmemo_core.runtime.model import DecoderLayer, ModelSpec, RMSNorm, apply_rope, attention_bias
from specmemo_core.runtime.tree import TreeBuffers

TOPK_CHUNK = 512  # a drafting top-k's first stage: each chunk of this many tokens gives its own top-k


def chunked_topk(x: torch.Tensor, k: int, *, chunk: int = TOPK_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (values, indices) in two stages: the top-k of each ``chunk`` of
    the last axis, then the top-k of those. Why: on a GPU, torch.topk over a few long rows
    (a tree level's 8 states × the drafting vocabulary) runs about one thread block per
    row and leaves most of the chip idle; chunks give it rows × V / chunk slices. Rows
    whose length ``chunk`` does not divide, or that are shorter than two chunks, or a
    ``k`` above ``chunk``, take torch.topk as they are."""
    v = x.shape[-1]
    if v % chunk or v < 2 * chunk or k > chunk:
        top = x.topk(k, dim=-1)
        return top.values, top.indices
    part = x.unflatten(-1, (v // chunk, chunk)).topk(k, dim=-1)  # [..., V / chunk, k]
    offsets = torch.arange(0, v, chunk, device=x.device)[:, None]  # [V / chunk, 1]
    values, pick = part.values.flatten(-2).topk(k, dim=-1)  # [..., k]
    return values, (part.indices + offsets).flatten(-2).gather(-1, pick)


def draft_topk(x: torch.Tensor, k: int, chunk: int, *, ids: torch.Tensor | None = None,
               log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafting top-k of ``x`` [..., V] (values, indices; the indices as ``ids`` [V] names
    them if given; with ``log_softmax`` the values are log-probabilities, fp32): one kernel
    where ``step_kernels.top_k`` takes the rows (a GPU, a drafting vocabulary), else two-stage
    on a GPU (``chunked_topk`` with ``chunk``; 0: one stage), torch.topk elsewhere."""
    if step_kernels.takes_top_k(x, k):
        return step_kernels.top_k(x, k, ids=ids, log_softmax=log_softmax)
    if log_softmax:
        x = torch.log_softmax(x.float(), dim=-1)
    if chunk and x.device.type == "cuda":
        values, index = chunked_topk(x, k, chunk=chunk)
    else:
        values, index = x.topk(k, dim=-1)
    return values, (index if ids is None else ids[index])


FORMAT_NAME = "specmemo-heads"
FORMAT_VERSION = "1"
HEAD_KINDS = ("medusa", "hydra")


@dataclass(frozen=True)
class HeadsSpec:
    kind: str  # "medusa" or "hydra"
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    own_lm_heads: bool
    base_name: str = ""
    base_fingerprint: str = ""  # empty: unknown (Medusa-format checkpoints)
    # context layer (0: none): its attention shape copies the base model's; its MLP is
    # ``context_mlp`` wide (the hidden size by default: ~1.9 M parameters at D = 576)
    context_mlp: int = 0
    context_heads: int = 0
    context_kv_heads: int = 0
    context_head_dim: int = 0
    # drafting vocabulary (0: the whole vocabulary): hydra heads draft only among this many
    # tokens, the most frequent in their training replies (see ``HydraHeads.draft``)
    draft_vocab: int = 0
    # the context layer also reads each position's next token (module docstring)
    context_next: bool = False

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise HeadsError(f"unknown heads kind {self.kind!r}; this version reads {', '.join(HEAD_KINDS)}")
        if self.kind == "hydra" and self.own_lm_heads:
            raise HeadsError("hydra heads use the base model's LM head")
        if self.num_heads < 1 or self.num_layers < 1:
            raise HeadsError("heads need at least one head and one layer")
        if self.context_mlp and (self.kind != "hydra" or min(self.context_heads, self.context_kv_heads,
                                                               self.context_head_dim) < 1):
            raise HeadsError("a context layer needs hydra heads and the base model's attention shape")
        if self.context_next and not self.context_mlp:
            raise HeadsError("reading the next token is a context layer's: give the heads a context layer")
        if self.draft_vocab and (self.kind != "hydra" or not 0 < self.draft_vocab <= self.vocab_size):
            raise HeadsError("a drafting vocabulary needs hydra heads and at most the model's vocabulary")

    @property
    def has_context(self) -> bool:
        return self.context_mlp > 0

    def context_model_spec(self):
        """The context layer's shape as a one-layer ``ModelSpec`` (so it reuses model.py)."""
        return ModelSpec(self.vocab_size, self.hidden_size, self.context_mlp, 1, self.context_heads,
                         self.context_kv_heads, self.context_head_dim, False, model_type="llama", rms_norm_eps=1e-5,
                         qkv_bias=False, o_bias=False, mlp_bias=False, max_position_embeddings=0)


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``; W and b start at zero so an untrained head copies the base LM head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class ContextLayer(nn.Module):
    """One decoder layer over the base model's hidden states (see the module docstring)."""

    def __init__(self, spec: HeadsSpec) -> None:
        super().__init__()
        self.mspec = spec.context_model_spec()
        self.layer = DecoderLayer(self.mspec, 0)
        nn.init.zeros_(self.layer.self_attn.o_proj.weight)
        nn.init.zeros_(self.layer.mlp.down_proj.weight)
        self.reads_next = spec.context_next
        if self.reads_next:
            self.next_norm = RMSNorm(spec.hidden_size, self.mspec.rms_norm_eps)
            self.next_proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=False)
            nn.init.zeros_(self.next_proj.weight)

    def inputs(self, hidden: torch.Tensor, next_emb: torch.Tensor | None) -> torch.Tensor:
        """The layer's input [..., T, D]: ``hidden``, plus the next tokens' embeddings
        ``next_emb`` [..., T, D] projected, when the layer reads them (else ignored)."""
        if not self.reads_next:
            return hidden
        if next_emb is None:
            raise ValueError("this context layer reads each position's next token: pass its embedding")
        return hidden + self.next_proj(self.next_norm(next_emb))

    def fuse(self) -> bool:
        """On a GPU, as the model's layers (``CausalLM.fuse_projections``): one matmul for q/k/v
        and one for gate/up, and so ``token_layer``'s kernels for its steps over a static cache
        (a step's accepted path: five kernels and the attention's two, where its regions ran ~30)."""
        return self.layer.fuse()

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        m = self.mspec
        return KVCache(1, m.num_kv_heads, m.head_dim, capacity, dtype, device)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: KVCache, next_emb: torch.Tensor | None = None, *,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., T, D] at scratch slots ``cache.length + i`` → h' [..., T, D] (caller commits);
        ``mask`` [T, S] bool, as ``CausalLM.forward`` takes it, or its additive ``bias`` if given
        (``CausalLM.tables``); ``next_emb``: see ``inputs``."""
        cache.ensure_room(hidden.shape[-2])
        x = self.inputs(hidden, next_emb)
        return self.layer(x, cos, sin, attention_bias(mask, self.mspec, hidden.dtype) if bias is None else bias, cache)

    def forward_batch(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      next_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Training: hidden [B, T, D], causal within each row (right padding is harmless:
        padded positions come after every real one), cos/sin [T, hd] → h' [B, T, D]."""
        att, m = self.layer.self_attn, self.mspec
        hidden = self.inputs(hidden, next_emb)
        b, t, _ = hidden.shape
        x = self.layer.input_layernorm(hidden)
        q = att.q_proj(x).view(b, t, m.num_heads, m.head_dim).transpose(1, 2)
        k = att.k_proj(x).view(b, t, m.num_kv_heads, m.head_dim).transpose(1, 2)
        v = att.v_proj(x).view(b, t, m.num_kv_heads, m.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = hidden + att.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return self.layer.mlp(self.layer.post_attention_layernorm(h), h)


class MedusaHeads(nn.Module):
    def __init__(self, spec: HeadsSpec) -> None:
        super().__init__()
        self.spec = spec
        # One ModuleList per head, each block built separately: no shared weights.
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(spec.hidden_size) for _ in range(spec.num_layers)])
            for _ in range(spec.num_heads)
        )
        self.lm_heads = (
            nn.ModuleList(nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) for _ in range(spec.num_heads))
            if spec.own_lm_heads else None
        )
        self.context: ContextLayer | None = None  # medusa heads have no context layer
        self.topk_chunk = TOPK_CHUNK  # drafting top-k's first-stage chunk on a GPU (0: one stage)

    def use_draft_vocab(self, lm_head_weight: torch.Tensor) -> None:
        """Medusa heads draft over the whole vocabulary (``HeadsSpec`` refuses a drafting one)."""

    @property
    def num_heads(self) -> int:
        return self.spec.num_heads

    @property
    def kind(self) -> str:
        return self.spec.kind

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] → [K, ..., D], one transformed hidden state per head."""
        return torch.stack([blocks(x) for blocks in self.blocks])

    def logits(self, x: torch.Tensor, base_lm_head: nn.Linear) -> torch.Tensor:
        """x: [..., D] → [K, ..., V]."""
        h = self.hidden(x)
        if self.lm_heads is None:
            return base_lm_head(h)
        return torch.stack([head(h[i]) for i, head in enumerate(self.lm_heads)])

    def draft(self, hidden: torch.Tensor, root: torch.Tensor | int, tree: TreeBuffers, embed: nn.Embedding,
              lm_head: nn.Linear) -> torch.Tensor:
        """Token of every tree node [..., N]: node i gets head (depth-1)'s rank-``rank[i]``
        guess; ``hidden`` [..., D] and ``root`` [...] may carry a batch axis."""
        proposals = draft_topk(self.logits(hidden, lm_head), max(tree.topk_needed), self.topk_chunk)[1]  # [K, ..., k]
        proposals = proposals.movedim(0, -2)  # [..., K, k]
        tokens = proposals[..., tree.head_index.clamp(min=0), tree.rank.clamp(min=0)]  # [..., N]
        tokens[..., 0] = root
        return tokens


class HydraHeads(nn.Module):
    """Heads chained along the drafted path (see the module docstring)."""

    def __init__(self, spec: HeadsSpec) -> None:
        super().__init__()
        self.spec = spec
        d = spec.hidden_size
        self.inputs = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(spec.num_heads))
        for layer in self.inputs:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(d) for _ in range(spec.num_layers - 1)]) for _ in range(spec.num_heads)
        )
        self.lm_heads = None
        self.context = ContextLayer(spec) if spec.has_context else None
        if spec.draft_vocab:  # saved with the heads; the matching LM-head rows are copied at load
            self.register_buffer("vocab_ids", torch.zeros(spec.draft_vocab, dtype=torch.long))
        self.vocab_head: nn.Linear | None = None  # set by use_draft_vocab
        self.topk_chunk = TOPK_CHUNK  # drafting top-k's first-stage chunk on a GPU (0: one stage)

    def use_draft_vocab(self, lm_head_weight: torch.Tensor) -> None:
        """Draft through the LM head's rows of ``vocab_ids`` only. Why: drafting a tree
        level multiplies its states by the whole LM head (49,152 × 576 for the default
        model: ~3.5 ms per level on a 2-core CPU, two thirds of a small tree's drafting);
        the 8,192 most frequent reply tokens cover ~94% of held-out replies, and a token
        outside them is only never proposed — verification keeps the output exact."""
        if self.spec.draft_vocab:
            rows = lm_head_weight.detach().index_select(0, self.vocab_ids.to(lm_head_weight.device))
            self.vocab_head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            self.vocab_head.weight = nn.Parameter(rows, requires_grad=False)

    def propose(self, states: torch.Tensor, lm_head: nn.Module, k: int) -> torch.Tensor:
        """Each state's top-``k`` next tokens [.., k], through the drafting vocabulary if set."""
        if self.vocab_head is None:
            return draft_topk(lm_head(states), k, self.topk_chunk)[1]
        return draft_topk(self.vocab_head(states), k, self.topk_chunk, ids=self.vocab_ids)[1]

    @property
    def num_heads(self) -> int:
        return self.spec.num_heads

    @property
    def kind(self) -> str:
        return self.spec.kind

    def step(self, k: int, state: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """Head k's state for a node: parent state and the node's token embedding [..., D] → [..., D]."""
        u = state + nn.functional.silu(self.inputs[k](torch.cat((state, token_emb), dim=-1)))
        return self.blocks[k](u)

    def chain(self, h: torch.Tensor, path_emb: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced states along a path: h [B, D], path_emb [B, K, D] (embeddings of
        the root token and the next K-1 true tokens) → K states [B, D]; state k predicts
        the token k + 2 places past h's position."""
        states, s = [], h
        for k in range(self.spec.num_heads):
            s = self.step(k, s, path_emb[:, k])
            states.append(s)
        return states

    def draft(self, hidden: torch.Tensor, root: torch.Tensor | int, tree: TreeBuffers, embed: nn.Embedding,
              lm_head: nn.Linear) -> torch.Tensor:
        """Fill the tree level by level: level d's states come from level d-1's states
        and level d's own tokens; their LM-head top-k are level d+1's tokens. ``hidden``
        [..., D] and ``root`` [...] may carry a batch axis: tokens [..., N]."""
        n = tree.depths.shape[0]
        tokens = torch.empty(*hidden.shape[:-1], n, dtype=torch.long, device=hidden.device)  # [..., N]
        tokens[..., 0] = root
        if self._drafts_in_kernels(hidden, tree, embed):
            return self._draft_in_kernels(hidden, tree, embed.weight, lm_head, tokens)
        starts = tree.level_starts
        states = hidden[..., None, :]  # [..., 1, D] parent state of the root
        prev_lo = 0
        for d in range(0, len(starts) - 2):
            lo, hi = starts[d], starts[d + 1]  # this level's nodes
            parent_state = states if d == 0 else states[..., tree.parents[lo:hi] - prev_lo, :]  # [..., P, D]
            states = self.step(d, parent_state, embed(tokens[..., lo:hi]))  # [..., P, D]
            top = self.propose(states, lm_head, tree.topk_needed[d])  # [..., P, k]
            child = slice(starts[d + 1], starts[d + 2])
            tokens[..., child] = top[..., tree.parents[child] - lo, tree.rank[child]]
            prev_lo = lo
        return tokens

    def _drafts_in_kernels(self, hidden: torch.Tensor, tree: TreeBuffers, embed: nn.Embedding) -> bool:
        """Whether a tree's levels draft through ``step_kernels`` (``_draft_in_kernels``): one
        sequence, a static tree, plain weights where the kernels run, top-k rows they take."""
        starts = tree.level_starts
        if hidden.dim() != 1 or tree.children is None or len(starts) < 3 or not isinstance(embed, nn.Embedding):
            return False
        vocab = self.spec.draft_vocab if self.vocab_head is not None else self.spec.vocab_size
        widest = max(starts[d + 1] - starts[d] for d in range(len(starts) - 2))
        return (vocab <= step_kernels.TOP_K_COLUMNS
                and step_kernels.takes_hydra_state(hidden[None], embed.weight, self.inputs[0], widest))

    def _draft_in_kernels(self, hidden: torch.Tensor, tree: TreeBuffers, embed: torch.Tensor, lm_head: nn.Linear,
                          tokens: torch.Tensor) -> torch.Tensor:
        """``draft`` for one sequence in three kernels a level, where its torch ops ran about a dozen:
        the head's states (``step_kernels.hydra_state``: gathers, matmul, SiLU, residual), their
        logits (the drafting vocabulary's rows of the LM head) and the top-k written straight
        into the children's tokens (``step_kernels.top_k_into``)."""
        starts, states, prev_lo = tree.level_starts, hidden[None], 0  # [1, D]: the root's parent state
        head = lm_head if self.vocab_head is None else self.vocab_head
        ids = None if self.vocab_head is None else self.vocab_ids
        for d in range(0, len(starts) - 2):
            lo, hi = starts[d], starts[d + 1]
            states = self.blocks[d](step_kernels.hydra_state(states, parents=tree.parents, tokens=tokens,
                                                             level=(lo, hi), prev_lo=prev_lo, embed=embed,
                                                             layer=self.inputs[d]))  # [P, D]
            step_kernels.top_k_into(head(states), tree.topk_needed[d], ids=ids, children=tree.children[lo:hi],
                                    tokens=tokens)
            prev_lo = lo
        return tokens

    def grow(self, hidden: torch.Tensor, root: torch.Tensor, growth: Growth, embed: nn.Embedding,
             lm_head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Grow a tree from this step's confidences (``growth.py``): the heads' nodes'
        tokens [..., N], depths [..., N] and ancestors [..., N, D] (node positions,
        ``pick_nodes``), from the draft state ``hidden`` [..., D] after ``root`` [...]. A
        leading axis holds independent rows (the calibration grows one per position, a batch
        one per sequence)."""
        lead = root.shape
        hidden, root = hidden.reshape(-1, hidden.shape[-1]), root.reshape(-1)  # [B, D], [B]
        b, k, beam, device = root.shape[0], growth.topk, growth.beam, hidden.device
        states = self.step(0, hidden[:, None], embed(root[:, None]))  # [B, 1, D] the root's state
        score, tokens = (t.view(b, k) for t in self.scored(states, lm_head, k))  # [B, k]: level 1's candidates
        ancestors = torch.full((b, k, growth.depth), -1, dtype=torch.long, device=device)  # [B, k, depth]
        ancestors[..., 0] = torch.arange(k, device=device)
        parent_rows = torch.zeros(b, k, dtype=torch.long, device=device)  # each candidate's parent's row of ``states``
        all_scores, all_tokens, all_ancestors, first = [score], [tokens], [ancestors], 0
        for d in range(1, growth.depth):
            best = score.topk(beam, dim=-1).indices  # [B, beam] this level's candidates to expand
            rows = parent_rows.gather(1, best)[..., None].expand(b, beam, states.shape[-1])
            states = self.step(d, states.gather(1, rows), embed(tokens.gather(1, best)))  # [B, beam, D]
            child_score, child_tokens = self.scored(states, lm_head, k)  # [B, beam, k]
            first += score.shape[-1]  # the new level's first candidate index
            score = (score.gather(1, best)[..., None] + child_score - DEPTH_TIEBREAK).clamp(min=MIN_SCORE)
            score, tokens = score.view(b, beam * k), child_tokens.view(b, beam * k)
            ancestors = ancestors.gather(1, best[..., None].expand(b, beam, growth.depth)).repeat_interleave(k, dim=1)
            ancestors[..., d] = first + torch.arange(beam * k, device=device)
            parent_rows = torch.arange(beam, device=device).repeat_interleave(k).expand(b, beam * k)
            for kept, new in ((all_scores, score), (all_tokens, tokens), (all_ancestors, ancestors)):
                kept.append(new)
        picked, depth, node_ancestors = pick_nodes(torch.cat(all_scores, 1), torch.cat(all_ancestors, 1), growth.nodes)
        n = growth.nodes
        return (torch.cat(all_tokens, 1).gather(1, picked).view(*lead, n), depth.view(*lead, n),
                node_ancestors.view(*lead, n, growth.depth))

    def scored(self, states: torch.Tensor, lm_head: nn.Module, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each state's top-``k`` next tokens [.., k] and their log-probabilities [.., k]
        (fp32) under the heads, through the drafting vocabulary if set."""
        logits = (lm_head if self.vocab_head is None else self.vocab_head)(states)
        ids = None if self.vocab_head is None else self.vocab_ids
        return draft_topk(logits, k, self.topk_chunk, ids=ids, log_softmax=True)


class DraftHeads(Protocol):
    """What decoding and the engine need of draft heads (``MedusaHeads`` and ``HydraHeads`` are)."""

    spec: HeadsSpec  # kind, shapes, base model, drafting vocabulary (``spec.draft_vocab``)
    context: ContextLayer | None  # the context layer the decoder runs on committed tokens, or None

    @property
    def num_heads(self) -> int: ...

    @property
    def kind(self) -> str: ...  # ``spec.kind``

    def draft(self, hidden: torch.Tensor, root: torch.Tensor | int, tree: TreeBuffers, embed: nn.Embedding,
              lm_head: nn.Linear) -> torch.Tensor:
        """The token of every tree node [..., N] (the root first) from the draft state
        ``hidden`` [..., D] (a leading batch axis: one tree per sequence)."""
        ...

    def use_draft_vocab(self, lm_head_weight: torch.Tensor) -> None:
        """Draft only among ``spec.draft_vocab`` tokens, through these rows of the LM head."""
        ...


HeadsModule = MedusaHeads | HydraHeads  # the heads this module builds, loads and saves


def new_heads(spec: HeadsSpec) -> HeadsModule:
    return HydraHeads(spec) if spec.kind == "hydra" else MedusaHeads(spec)


def random_heads(
    num_heads: int, hidden_size: int, vocab_size: int, *, seed: int = 0, scale: float = 0.02,
    base_name: str = "", base_fingerprint: str = "", kind: str = "medusa", num_layers: int = 1,
    context: tuple[int, int, int, int] | None = None, context_next: bool = False, draft_vocab: int = 0,
) -> HeadsModule:
    """Heads with random weights: the decoder's output must not depend on them (tests).
    ``context``: (mlp width, heads, kv heads, head dim) of a context layer, hydra only;
    ``context_next``: it reads the next token too; ``draft_vocab``: a drafting vocabulary of
    that many distinct random token ids (hydra only; ``use_draft_vocab`` then takes their rows)."""
    ctx = dict(zip(("context_mlp", "context_heads", "context_kv_heads", "context_head_dim"), context or (0,) * 4))
    heads = new_heads(HeadsSpec(kind, num_heads, num_layers, hidden_size, vocab_size, False, base_name,
                                base_fingerprint, **ctx, context_next=context_next, draft_vocab=draft_vocab))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
        if draft_vocab:
            heads.vocab_ids.copy_(torch.randperm(vocab_size, generator=gen)[:draft_vocab].sort().values)
    return heads.eval().requires_grad_(False)


def save_heads(heads: HeadsModule, path: Path, dtype: torch.dtype | None = None) -> Path:
    """Write the own format: ``path`` is a folder (``heads.safetensors`` inside) or a file."""
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / "heads.safetensors"
    s = heads.spec
    meta = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "kind": s.kind,
        "num_heads": str(s.num_heads), "num_layers": str(s.num_layers),
        "hidden_size": str(s.hidden_size), "vocab_size": str(s.vocab_size),
        "own_lm_heads": "1" if s.own_lm_heads else "0",
        "base_name": s.base_name, "base_fingerprint": s.base_fingerprint,
        "context_mlp": str(s.context_mlp), "context_heads": str(s.context_heads),
        "context_kv_heads": str(s.context_kv_heads), "context_head_dim": str(s.context_head_dim),
        "draft_vocab": str(s.draft_vocab), "context_next": "1" if s.context_next else "0",
    }
    tensors = {k: (v if k == "vocab_ids" else v.detach().to(dtype or v.dtype)).contiguous().cpu()
               for k, v in heads.state_dict().items() if not k.startswith("vocab_head.")}  # rebuilt at load
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_heads(
    path: Path | str, hidden_size: int, vocab_size: int, base_fingerprint: str = "",
    dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
) -> HeadsModule:
    """Load heads in the own or the Medusa format and check they fit the base model."""
    path = Path(path)
    if not path.exists():
        raise HeadsError(f"{path}: heads not found. Check the path, or run without --heads.")
    if path.is_dir():
        own = path / "heads.safetensors"
        heads = _load_own(own) if own.exists() else _load_medusa_folder(path)
    elif path.suffix == ".safetensors":
        heads = _load_own(path)
    else:
        raise HeadsError(
            f"{path}: not a heads file. Give a folder with heads.safetensors, or a Medusa "
            f"folder with config.json and medusa_lm_head.safetensors/.pt."
        )
    s = heads.spec
    if s.hidden_size != hidden_size or s.vocab_size != vocab_size:
        raise HeadsError(
            f"{path}: these heads were made for a model with hidden size {s.hidden_size} and "
            f"vocabulary {s.vocab_size}, but the loaded model has {hidden_size} and {vocab_size}. "
            f"Use heads trained for this model (specmemo train-heads), or run without them."
        )
    if s.base_fingerprint and base_fingerprint and s.base_fingerprint != base_fingerprint:
        raise HeadsError(
            f"{path}: these heads were made for another model ({s.base_name or 'unknown'}, "
            f"fingerprint {s.base_fingerprint}); the loaded model's fingerprint is "
            f"{base_fingerprint}. Use heads trained for this model (specmemo train-heads)."
        )
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def _load_own(path: Path) -> HeadsModule:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for bad files
        raise HeadsError(f"{path}: unreadable heads file ({exc}). Train or copy the heads again.") from exc
    if meta.get("format") != FORMAT_NAME:
        raise HeadsError(f"{path}: not a SpecMemo heads file (no '{FORMAT_NAME}' metadata).")
    try:
        spec = HeadsSpec(
            kind=meta["kind"], num_heads=int(meta["num_heads"]), num_layers=int(meta["num_layers"]),
            hidden_size=int(meta["hidden_size"]), vocab_size=int(meta["vocab_size"]),
            own_lm_heads=meta.get("own_lm_heads") == "1", base_name=meta.get("base_name", ""),
            base_fingerprint=meta.get("base_fingerprint", ""),
            **{k: int(meta.get(k, "0")) for k in ("context_mlp", "context_heads", "context_kv_heads",
                                                   "context_head_dim", "draft_vocab")},
            context_next=meta.get("context_next") == "1",
        )
    except (KeyError, ValueError) as exc:
        raise HeadsError(f"{path}: heads metadata is incomplete ({exc}).") from exc
    return _with_weights(spec, tensors, path)


def _load_medusa_folder(folder: Path) -> MedusaHeads:
    """FasterDecoding Medusa layout: keys ``{head}.{block}.linear.*`` and ``{head}.{num_layers}.weight``."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise HeadsError(f"{folder}: no heads.safetensors and no Medusa config.json: not a heads folder.")
    try:
        config = json.loads(config_path.read_text())
        num_heads, num_layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    except (ValueError, KeyError) as exc:
        raise HeadsError(f"{config_path}: not a Medusa heads config ({exc}).") from exc
    tensors = _read_medusa_weights(folder)
    try:
        hidden = tensors["0.0.linear.weight"].shape[0]
        vocab = tensors[f"0.{num_layers}.weight"].shape[0]
    except KeyError as exc:
        raise HeadsError(f"{folder}: Medusa weights lack tensor {exc}.") from exc
    spec = HeadsSpec("medusa", num_heads, num_layers, hidden, vocab, True,
                     base_name=str(config.get("base_model_name_or_path", "")))
    ours: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        head, block, *rest = name.split(".") + ["", ""]
        if block == str(num_layers):
            ours[f"lm_heads.{head}.weight"] = t
        else:
            ours[f"blocks.{head}.{block}.{'.'.join(r for r in rest if r)}"] = t
    return _with_weights(spec, ours, folder)


def _read_medusa_weights(folder: Path) -> dict[str, torch.Tensor]:
    st, pt = folder / "medusa_lm_head.safetensors", folder / "medusa_lm_head.pt"
    if st.exists():
        with safe_open(str(st), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    if pt.exists():
        try:
            data = torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as exc:  # UnpicklingError for anything that is not plain tensors
            raise HeadsError(
                f"{pt}: refused: the file holds more than plain tensors (pickled code is never "
                f"executed). Convert it to medusa_lm_head.safetensors on a trusted machine."
            ) from exc
        if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise HeadsError(f"{pt}: expected a dictionary of tensors.")
        return data
    raise HeadsError(f"{folder}: no medusa_lm_head.safetensors or medusa_lm_head.pt found.")


def _with_weights(spec: HeadsSpec, tensors: dict[str, torch.Tensor], path: Path) -> HeadsModule:
    """Heads of ``spec`` holding ``tensors``, after every declared shape was checked against the tensors
    present: a file claiming 100,000 heads for one head's weights is refused before anything is allocated."""
    _check_declared(spec, tensors, path)
    with torch.device("meta"):  # shapes only: no memory, whatever the declared sizes
        expected = new_heads(spec).state_dict()
    missing = set(expected) - set(tensors)
    extra = set(tensors) - set(expected)
    bad = [k for k in set(expected) & set(tensors) if tensors[k].shape != expected[k].shape]
    if missing or extra or bad:
        detail = "; ".join(
            part for part in (
                f"missing {sorted(missing)[:3]}" if missing else "",
                f"unexpected {sorted(extra)[:3]}" if extra else "",
                f"wrong shape {sorted(bad)[:3]}" if bad else "",
            ) if part
        )
        raise HeadsError(f"{path}: heads weights do not match their declared shape ({detail}).")
    heads = new_heads(spec)  # now as large as the tensors actually present, no larger
    heads.load_state_dict({k: t.to(expected[k].dtype) for k, t in tensors.items()})
    if heads.spec.draft_vocab and not (
            (heads.vocab_ids >= 0) & (heads.vocab_ids < heads.spec.vocab_size)).all():
        raise HeadsError(f"{path}: the drafting vocabulary names tokens outside the model's vocabulary.")
    return heads


def _check_declared(spec: HeadsSpec, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a spec whose head and layer counts the tensors cannot back (each head has a tensor pair per
    layer), before even a shape-only model of that many modules is built."""
    present = {name.split(".")[1] for name in tensors if name.split(".")[0] in ("blocks", "inputs", "lm_heads")}
    if spec.num_heads != len(present):
        raise HeadsError(f"{path}: the heads declare {spec.num_heads} heads, but the file holds weights for "
                         f"{len(present)}. The file is damaged or was not made for this app; train or copy the "
                         "heads again.")
    if 2 * spec.num_heads * spec.num_layers > len(tensors):
        raise HeadsError(f"{path}: the heads declare {spec.num_layers} layers per head, but the file holds only "
                         f"{len(tensors)} tensors for {spec.num_heads} head(s). The file is damaged or was not "
                         "made for this app; train or copy the heads again.")
