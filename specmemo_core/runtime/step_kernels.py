"""A step's glue in one kernel each (Triton): the drafting top-k, the lookup chain, the greedy
acceptance of a path, the accepted entries' move in the cache, the greedy picks (two).

Why: around the verify forward a tree step ran ~170 small kernels (a `medusa-64` step of the
default model on an H100: drafting 75, accepting 27, committing 70; its verify 209), each a
few microseconds on a GPU whatever its size: a step of a small model is bound by launches.
Here four pieces of it are one kernel each (docs/results/step_glue_h100/: that step 1.40 ms
against 1.69, with the heads' context layer through ``token_layer`` too), and the greedy picks
two (docs/results/chain_pdl_h100/: 0.04 ms less a tree step, 0.014 a plain one):

- ``top_k``: a tree level's top-k over the drafting vocabulary (torch's sort-based top-k
  ran two kernels and the chunked two-stage one six, ~25 µs a level), the drafting
  vocabulary's token ids looked up in the same pass; with the log-softmax a grown tree
  scores by.
- ``lookup_chain``: ``lookup.lookup_draft``'s chain (the longest, latest match of the last
  tokens, and what followed it: ~45 kernels over the whole cache's ids).
- ``greedy_path``: which path is accepted, how far, and the tokens it emits (the
  comparisons, cumulative product, argmax and gathers: ~25 kernels).
- ``move_entries``: the accepted nodes' keys, values and token ids to the committed slots
  of every layer (an index_select and an index_copy for each of the three).
- ``greedy_picks``: the base model's argmax at every node, the LM head scored on the tensor
  cores block by block and only each block's best kept (``CausalLM.greedy_picks``' blocks of
  matmuls, maxima, stacks and gathers: ~12 kernels).
- ``hydra_state`` and ``top_k_into``: a hydra tree level's drafting for one sequence
  (``HydraHeads.draft``): the parents' states and the nodes' embeddings gathered, the head's
  input layer, its SiLU and residual in one kernel, and the level's top-k written straight into
  its children's tokens; with the LM head's matmul between them, three kernels a level where
  the torch ops ran about a dozen (``SPECMEMO_DRAFT_KERNELS=0`` runs those).

Each answers what the torch ops it stands for answer, in the same integer arithmetic (the
drafting top-k may order equal values otherwise: that changes a draft, never a reply). Where
Triton is missing, or fails to build or answer right on a device (``kernel_probe``), on
CPUs and on a split's other card, the torch ops run; so they do with
``SPECMEMO_STEP_KERNELS=0`` in the environment (read as each step is captured: an escape
hatch, and how ``scripts/time_graph_steps.py``'s ``-noglue`` regions time both in one process).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch

from specmemo_core.runtime import kernel_probe

FAMILY, FALLBACK = "decoding-step glue kernels", "the step's glue runs as torch ops"
PICK_BLOCK = 128  # LM-head rows a program of ``greedy_picks`` scores
TOP_K_COLUMNS = 16384  # the longest rows ``top_k`` takes (whole in a program's registers): drafting vocabularies


class PathTokens(NamedTuple):
    """What ``greedy_path`` leaves beside the accepted nodes: [..., 1 + W] the count and the
    emitted tokens (``step.commit``'s output), the bonus pick [..., 1] and the last accepted
    node's index on the path [..., 1]."""

    out: torch.Tensor
    bonus: torch.Tensor
    last: torch.Tensor


@functools.cache
def _kernels() -> Any:
    """The kernels' module, or None where Triton is not installed (CPU-only torch)."""
    try:
        from specmemo_core.runtime import step_kernels_triton
    except ImportError:
        return None
    return step_kernels_triton


@functools.cache
def revision() -> str:
    """A short hash of this module's and its kernels' source (``kernel_probe.source_revision``)."""
    return kernel_probe.source_revision(__file__, "step_kernels_triton.py")


def applies(x: torch.Tensor) -> bool:
    """Whether the kernels run for a step whose tensors sit where ``x`` does: a GPU where
    they build and answer right (or Triton's interpreter, for tests)."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") or _kernels() is None:
        return False
    if os.environ.get("SPECMEMO_STEP_KERNELS") == "0":
        return False
    if x.is_cuda and x.device.index not in (None, torch.cuda.current_device()):
        return False  # a split's other card: Triton launches on the current one
    return not x.is_cuda or kernel_probe.runs_on(FAMILY, x.device, torch.long, _probe)


def greedy_path(tokens: torch.Tensor, picks: torch.Tensor,
                retrieve: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, PathTokens]:
    """The greedy acceptance of ``tokens`` [..., N] against ``picks`` [..., N] over the paths
    ``retrieve`` [L, W] (or per sequence [..., L, W]): the accepted path's nodes [..., W]
    (padding clamped to 0), its count [...] (root included) and its tokens (``PathTokens``)."""
    lead, (paths, width) = tokens.shape[:-1], retrieve.shape[-2:]
    tokens, picks = tokens.reshape(-1, tokens.shape[-1]), picks.reshape(-1, picks.shape[-1])
    rows = tokens.shape[0]
    retrieve = retrieve.reshape(-1, paths, width) if retrieve.dim() > 2 else retrieve[None]
    nodes = tokens.new_empty(rows, width)
    out = tokens.new_empty(rows, 1 + width)
    bonus, last = tokens.new_empty(rows, 1), tokens.new_empty(rows, 1)
    _kernels().greedy_path[(rows,)](
        tokens, picks, retrieve, nodes, out, bonus, last, paths, width, tokens.stride(0),
        retrieve.stride(0) if retrieve.shape[0] > 1 else 0, nodes.stride(0), out.stride(0),
        BLOCK_L=_pow2(paths), BLOCK_W=_pow2(width))
    out = out.view(*lead, 1 + width)
    return nodes.view(*lead, width), out[..., 0], PathTokens(out, bonus.view(*lead, 1), last.view(*lead, 1))


def move_entries(keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, nodes: torch.Tensor,
                 length: torch.Tensor) -> None:
    """The entries at slots ``length`` + ``nodes`` [W] (increasing from 0) of every plane of
    ``keys`` and ``values`` [layers, kvh, C, hd] and of ``ids`` [C] moved to ``length`` + 0…W-1."""
    planes, width, hd = keys.shape[0] * keys.shape[1], nodes.shape[0], keys.shape[-1]
    k, v = keys.view(planes, *keys.shape[2:]), values.view(planes, *values.shape[2:])
    _kernels().move_entries[(planes,)](
        k, v, ids, nodes, length, width, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HD=hd, BLOCK_W=_pow2(width), BLOCK_D=_pow2(hd))


def lookup_chain(ids: torch.Tensor, length: torch.Tensor, root: torch.Tensor, count: int, *,
                 max_ngram: int) -> torch.Tensor:
    """``lookup.lookup_draft``'s chain [..., count] after ``root`` [...] over the committed
    tokens ``ids`` [..., C] up to ``length`` [...] (device tensors)."""
    lead, capacity = ids.shape[:-1], ids.shape[-1]
    rows = ids.reshape(-1, capacity)
    out = torch.empty(rows.shape[0], count, dtype=ids.dtype, device=ids.device)
    _kernels().lookup_chain[(rows.shape[0],)](
        rows, length.reshape(-1), root.reshape(-1), out, capacity, count, rows.stride(0), out.stride(0),
        MAX_NGRAM=max_ngram, BLOCK=1024, BLOCK_J=_pow2(count))
    return out.view(*lead, count)


def takes_picks(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``greedy_picks`` scores the hidden states [..., T, D] (one row too) against the LM
    head's plain weight [V, D]: 16- or 32-bit, the hidden states' dtype and device, rows
    contiguous; not with ``SPECMEMO_PICK_KERNEL=0`` (to time the blocks of matmuls it replaces)."""
    return (hidden.dtype == weight.dtype and hidden.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.device == hidden.device and weight.stride(-1) == 1 and hidden.shape[-1] == weight.shape[-1]
            and os.environ.get("SPECMEMO_PICK_KERNEL") != "0" and applies(hidden))


def greedy_picks(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(hidden, weight).argmax(-1)`` [..., T] (``takes_picks``) in two kernels, without
    the [T, V] logits: blocks of the head's rows scored on the tensor cores, each token's best
    of each block (its logits rounded to their dtype, ties to the lowest row, as argmax's), then
    the best of the blocks."""
    lead, (vocab, d_model) = hidden.shape[:-1], weight.shape
    h = hidden.reshape(-1, d_model)
    if h.stride(-1) != 1:
        h = h.contiguous()
    tokens = h.shape[0]
    block_t = 16 if tokens <= 16 else (32 if tokens <= 32 else 64)
    blocks = -(-vocab // PICK_BLOCK)
    values = torch.empty(blocks, tokens, dtype=torch.float32, device=h.device)
    index = torch.empty(blocks, tokens, dtype=torch.long, device=h.device)
    kernels = _kernels()
    # Triton's default 3 stages of [block_t + PICK_BLOCK, 64] loads, fewer where a block's shared
    # memory may not hold them (counting every stage: fp32 one row 108 KB, a laptop GPU gives ~100)
    stages = kernel_probe.fitting_stages(3, stage_bytes=(block_t + PICK_BLOCK) * 64 * h.element_size(),
                                         shared_bytes=kernel_probe.shared_bytes(h.device))
    kernels.pick_blocks[(blocks, -(-tokens // block_t))](
        h, weight, values, index, tokens, vocab, d_model, h.stride(0), weight.stride(0),
        BLOCK_T=block_t, BLOCK_V=PICK_BLOCK, BLOCK_K=64, IEEE=h.dtype == torch.float32, num_stages=stages)
    out = torch.empty(tokens, dtype=torch.long, device=h.device)
    kernels.pick_best[(tokens,)](values, index, out, blocks, tokens, BLOCK_P=min(1024, _pow2(blocks)))
    return out.view(lead)


def takes_top_k(x: torch.Tensor, k: int) -> bool:
    """Whether ``top_k`` takes rows like ``x`` [..., V]: V within ``TOP_K_COLUMNS``, k within V."""
    return x.shape[-1] <= TOP_K_COLUMNS and k <= x.shape[-1] and applies(x)


def top_k(x: torch.Tensor, k: int, *, ids: torch.Tensor | None = None,
          log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of ``x`` [..., V] (``takes_top_k``): their values [..., k]
    (fp32, descending; with ``log_softmax`` the rows' log-probabilities) and their indices
    [..., k], as ``ids`` [V] names them if given."""
    lead, cols = x.shape[:-1], x.shape[-1]
    rows = _rows(x)
    values = torch.empty(rows.shape[0], k, dtype=torch.float32, device=x.device)
    index = torch.empty(rows.shape[0], k, dtype=torch.long, device=x.device)
    _kernels().top_k[(rows.shape[0],)](
        rows, rows if ids is None else ids, values, index, index, index, cols, k, rows.stride(0), values.stride(0), 0,
        BLOCK=_pow2(cols), MAP_IDS=ids is not None, LOG_SOFTMAX=log_softmax, SCATTER=False,
        num_warps=8 if cols > 4096 else 4)
    return values.view(*lead, k), index.view(*lead, k)


def top_k_into(x: torch.Tensor, k: int, *, ids: torch.Tensor | None, children: torch.Tensor,
               tokens: torch.Tensor) -> None:
    """``top_k``'s indices of each row r of ``x`` [R, V] straight into a tree's tokens [N]: the i-th
    at ``tokens[children[r, i]]`` (``TreeBuffers.children``' rows of a level; -1: no such child)."""
    rows, cols = _rows(x), x.shape[-1]
    _kernels().top_k[(rows.shape[0],)](
        rows, rows if ids is None else ids, tokens, tokens, children, tokens, cols, k, rows.stride(0), 0,
        children.stride(0), BLOCK=_pow2(cols), MAP_IDS=ids is not None, LOG_SOFTMAX=False, SCATTER=True,
        num_warps=8 if cols > 4096 else 4)


def takes_tables(positions: torch.Tensor, mask: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """Whether ``step_tables`` builds a step's tables: one sequence's positions [T] and bool mask
    [T, S] (rows contiguous) and fp32 inverse frequencies, on a device where the kernels run; not
    with ``SPECMEMO_TABLES_KERNEL=0`` (to time the torch ops it replaces)."""
    return (os.environ.get("SPECMEMO_TABLES_KERNEL") != "0" and positions.dim() == 1 and mask.dim() == 2
            and mask.dtype == torch.bool
            and mask.shape[0] == positions.shape[0] and mask.stride(-1) == 1 and inv_freq.dtype == torch.float32
            and mask.device == positions.device == inv_freq.device and applies(positions)
            and (not mask.is_cuda or kernel_probe.runs_on(TABLES, mask.device, torch.float32, _probe_tables)))


def step_tables(positions: torch.Tensor, mask: torch.Tensor, *, inv_freq: torch.Tensor, scale: float, groups: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``model.rope_tables`` and ``model.attention_bias`` of a step in one kernel (``takes_tables``):
    cos and signed sin [T, hd] and the bias [groups·T, S], the same numbers (the angle, its cosine
    and sine in fp32, scaled, then rounded), where the torch ops ran about fourteen kernels."""
    (tokens, span), half = mask.shape, inv_freq.shape[0]
    cos = torch.empty(tokens, 2 * half, dtype=dtype, device=mask.device)
    sin = torch.empty_like(cos)
    bias = torch.empty(groups * tokens, span, dtype=dtype, device=mask.device)
    _kernels().step_tables[(tokens,)](
        positions, inv_freq, mask, cos, sin, bias, tokens, span, groups, float(scale), mask.stride(0), cos.stride(0),
        bias.stride(0), HALF=half, BLOCK_H=_pow2(half), BLOCK_S=min(1024, _pow2(span)),
        LIBDEVICE=mask.is_cuda and _kernels().libdevice is not None)
    return cos, sin, bias


TABLES = "a step's rotary tables and bias kernel"  # its own probe: a failure leaves the other kernels on


def _probe_tables(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``step_tables`` builds and gives torch's tables on ``device``: angles of 3 and 40
    radians, two groups."""
    try:
        inv, positions = torch.tensor([1.0, 0.01], device=device), torch.tensor([3, 4000], device=device)
        cos, sin, bias = step_tables(positions, torch.tensor([[True, False], [True, True]], device=device),
                                     inv_freq=inv, scale=1.0, groups=2, dtype=torch.float32)
        angles = positions[:, None].float() * inv
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: the torch ops
        return kernel_probe.failed(TABLES, device, e, "the tables are torch ops")
    error = max((cos - angles.cos().repeat(1, 2)).abs().max().item(), (sin[:, 2:] - angles.sin()).abs().max().item())
    right = error < 1e-5 and bias.tolist() == [[0.0, float("-inf")], [0.0, 0.0]] * 2
    return right or kernel_probe.wrong(TABLES, device, error, "the tables are torch ops")


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


HYDRA_ROWS = 64  # the most nodes of a tree level ``hydra_state`` takes (one tile of them)


def takes_hydra_state(prev: torch.Tensor, embed: torch.Tensor, layer: torch.nn.Linear, count: int) -> bool:
    """Whether ``hydra_state`` runs a level of ``count`` nodes from the states ``prev`` [P', D]:
    plain weights (the token embedding [V, D], the head's input layer [D, 2D] with its bias) of
    ``prev``'s dtype and device, rows contiguous, at most ``HYDRA_ROWS`` nodes; not with
    ``SPECMEMO_DRAFT_KERNELS=0`` (to time the torch ops it replaces)."""
    return (count <= HYDRA_ROWS and os.environ.get("SPECMEMO_DRAFT_KERNELS") != "0" and prev.dim() == 2
            and prev.stride(-1) == 1 and applies(prev) and prev.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(type(w) in (torch.Tensor, torch.nn.Parameter) and w.dtype == prev.dtype
                    and w.device == prev.device and w.stride(-1) == 1
                    for w in (embed, layer.weight, layer.bias)))  # read where the kernels run (a CPU's: packed)


def hydra_state(prev: torch.Tensor, *, parents: torch.Tensor, tokens: torch.Tensor, level: tuple[int, int],
                prev_lo: int, embed: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """The states [P, D] of a tree level's nodes ``level`` (lo, hi) under a hydra head whose input
    layer is ``layer`` (``HydraHeads.step`` before its blocks): each node's parent's row of
    ``prev`` (``parents`` [N] minus ``prev_lo``, the root's parent row 0) and the embedding of its
    token (``tokens`` [N]) in, one kernel (``takes_hydra_state``)."""
    (lo, hi), d_model = level, prev.shape[-1]
    out = torch.empty(hi - lo, d_model, dtype=prev.dtype, device=prev.device)
    block_n, block_k = (32, 128) if d_model >= 2048 else (16, 64)
    block_p = _pow2(hi - lo)  # at least 16: the tensor cores' least
    stages = kernel_probe.fitting_stages(4, stage_bytes=2 * (block_p + block_n) * block_k * prev.element_size(),
                                         shared_bytes=kernel_probe.shared_bytes(prev.device))
    _kernels().hydra_state[(-(-d_model // block_n),)](
        prev, parents, tokens, embed, layer.weight, layer.bias, out, lo, hi - lo, prev_lo, d_model, prev.stride(0),
        embed.stride(0), layer.weight.stride(0), out.stride(0), BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=prev.dtype == torch.float32, num_stages=stages)
    return out


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and give the torch ops' answers on ``device``
    (``kernel_probe``): a 3-path tree accepted, 3 entries moved over 2 planes, a top-3, the greedy
    picks of 3 rows over a 300-row head in fp32 (the most shared memory they ask), a hydra
    level's states."""
    try:
        tokens = torch.tensor([[5, 7, 8, 9, 4], [5, 7, 6, 9, 9]], device=device)
        picks = torch.tensor([[7, 9, 1, 2, 3], [6, 0, 9, 9, 1]], device=device)
        retrieve = torch.tensor([[0, 1, 3], [0, 2, -1], [0, 4, -1]], device=device)
        nodes, count, path = greedy_path(tokens, picks, retrieve)
        cache = torch.arange(2 * 8 * 4, device=device, dtype=torch.float32).view(1, 2, 8, 4)
        moved, ids = cache.clone(), torch.arange(8, device=device)
        move_entries(moved, moved.clone(), ids, torch.tensor([0, 2, 3], device=device),
                     torch.tensor(1, device=device))
        values, index = top_k(torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.5]], device=device), 3)
        g = torch.Generator(device="cpu").manual_seed(0)
        hidden, head = (torch.randn(n, 64, generator=g).to(device) for n in (3, 300))
        best = greedy_picks(hidden, head)
        layer = torch.nn.utils.skip_init(torch.nn.Linear, 128, 64, device=device)  # no draw from torch's RNG
        with torch.no_grad():
            layer.weight.copy_(torch.randn(64, 128, generator=g) * 0.1)
            layer.bias.copy_(torch.randn(64, generator=g))
        embed, prev = (torch.randn(n, 64, generator=g).to(device) for n in (9, 1))
        level = torch.tensor([-1, 0, 0, 0], device=device), torch.tensor([7, 2, 8, 2], device=device)
        states = hydra_state(prev, parents=level[0], tokens=level[1], level=(1, 4), prev_lo=0, embed=embed,
                             layer=layer)
        want_states = prev + torch.nn.functional.silu(layer(torch.cat((prev.expand(3, 64), embed[level[1][1:]]), -1)))
    except Exception as e:  # noqa: BLE001 - any failure to build or launch means: the torch ops
        return kernel_probe.failed(FAMILY, device, e, FALLBACK)
    right = (nodes.tolist() == [[0, 1, 3], [0, 2, 0]] and count.tolist() == [3, 2]
             and path.out.tolist() == [[3, 7, 9, 2], [2, 6, 9, 9]] and path.last.tolist() == [[2], [1]]
             and torch.equal(moved[..., 2:4, :], cache[..., 3:5, :]) and ids.tolist()[1:4] == [1, 3, 4]
             and index.tolist() == [[1, 3, 4]] and values.tolist() == [[2.0, 2.0, 1.5]]
             and torch.equal(best, (hidden @ head.T).argmax(-1))
             and (states - want_states).abs().max().item() < 1e-4)
    return right or kernel_probe.wrong(FAMILY, device, 1.0, FALLBACK)
