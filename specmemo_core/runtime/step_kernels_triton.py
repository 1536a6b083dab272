"""The Triton kernels of ``step_kernels`` (imported only where Triton is installed).

Their parameters are positional pointers, sizes and strides, as Triton kernels take them
(``scripts/check_code_shape.py`` leaves ``@triton.jit`` functions' parameter counts alone).
"""

import triton
import triton.language as tl

try:
    from triton.language.extra import libdevice
except ImportError:  # an older Triton: ``step_tables`` takes tl.cos and tl.sin (LIBDEVICE off)
    libdevice = None


@triton.jit
def greedy_path(tokens_ptr, picks_ptr, retrieve_ptr, nodes_ptr, out_ptr, bonus_ptr, last_ptr,
                paths, width, stride_t, stride_r, stride_n, stride_o,
                BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr):
    """One program per sequence b: its tree's paths ``retrieve`` [L, W] (-1 padded; a row of
    them ``stride_r`` apart, 0 for one tree shared by the batch), the node tokens [N] and the
    base model's pick after each node [N]. A path's draft j is accepted while every draft
    up to it equals its parent's pick; the path accepted furthest (the first of equals)
    gives nodes [W] (clamped to 0), and out [1 + W]: the count (root included), then the
    token after each of its nodes (the next accepted draft, then the bonus pick), the bonus
    [1] and the last accepted node's index on the path [1]."""
    b = tl.program_id(0)
    row = tl.arange(0, BLOCK_L)[:, None]
    col = tl.arange(0, BLOCK_W)[None, :]
    inside = (row < paths) & (col < width)
    paths_ptr = retrieve_ptr + b * stride_r
    node = tl.load(paths_ptr + row * width + col, mask=inside, other=-1)  # [L, W]
    parent = tl.load(paths_ptr + row * width + col - 1, mask=inside & (col > 0), other=0)  # [L, W]
    token = tl.load(tokens_ptr + b * stride_t + tl.maximum(node, 0))
    pick = tl.load(picks_ptr + b * stride_t + tl.maximum(parent, 0))
    refused = (col > 0) & ((node < 0) | (token != pick) | ~inside)  # [L, W]
    drafts = tl.min(tl.where(refused, col, BLOCK_W), axis=1) - 1  # [L] accepted drafts of each path
    drafts = tl.where(tl.arange(0, BLOCK_L) < paths, tl.minimum(drafts, width - 1), -1)
    best = tl.argmax(drafts, axis=0, tie_break_left=True)
    count = tl.max(drafts, axis=0) + 1
    j = tl.arange(0, BLOCK_W)
    best_ptr = paths_ptr + best * width
    nodes = tl.maximum(tl.load(best_ptr + j, mask=j < width, other=0), 0)  # [W]
    bonus = tl.load(picks_ptr + b * stride_t + tl.load(best_ptr + count - 1))
    following = tl.maximum(tl.load(best_ptr + j + 1, mask=j + 1 < width, other=0), 0)  # the node after each
    drafted = tl.load(tokens_ptr + b * stride_t + following)
    tl.store(nodes_ptr + b * stride_n + j, nodes, mask=j < width)
    tl.store(out_ptr + b * stride_o, count.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + b * stride_o + 1 + j, tl.where(j < count - 1, drafted, bonus), mask=j < width)
    tl.store(bonus_ptr + b, bonus)
    tl.store(last_ptr + b, count - 1)


@triton.jit
def move_entries(k_ptr, v_ptr, ids_ptr, nodes_ptr, length_ptr, width, stride_kp, stride_ks, stride_vp, stride_vs,
                 HD: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (layer, key/value head) plane of the keys and values [planes, C, hd]:
    the entries at slots length + nodes[j] move to length + j (j < W; nodes increasing from
    0, so a slot is written only after every read of it: the whole tile is read, then, past
    a barrier, written). The first program moves the token ids [C] too."""
    p = tl.program_id(0)
    length = tl.load(length_ptr)
    j = tl.arange(0, BLOCK_W)
    live = j < width
    src = length + tl.load(nodes_ptr + j, mask=live, other=0)  # [W]
    dst = length + j
    d = tl.arange(0, BLOCK_D)
    both = live[:, None] & (d < HD)[None, :]
    k_at, v_at = k_ptr + p * stride_kp, v_ptr + p * stride_vp
    keys = tl.load(k_at + src[:, None] * stride_ks + d[None, :], mask=both)
    values = tl.load(v_at + src[:, None] * stride_vs + d[None, :], mask=both)
    first = live & (j * 0 + p == 0)  # the first program's ids
    ids = tl.load(ids_ptr + src, mask=first)
    tl.debug_barrier()
    tl.store(k_at + dst[:, None] * stride_ks + d[None, :], keys, mask=both)
    tl.store(v_at + dst[:, None] * stride_vs + d[None, :], values, mask=both)
    tl.store(ids_ptr + dst, ids, mask=first)


@triton.jit
def top_k(x_ptr, ids_ptr, values_ptr, index_ptr, child_ptr, tokens_ptr, n_cols, k, stride_x, stride_o, stride_c,
          BLOCK: tl.constexpr, MAP_IDS: tl.constexpr, LOG_SOFTMAX: tl.constexpr, SCATTER: tl.constexpr):
    """One program per row of x [R, V] (V ≤ BLOCK): its ``k`` largest values (fp32, in
    descending order; equals by their lowest index first) and their indices, mapped through
    ``ids`` [V] if MAP_IDS; with LOG_SOFTMAX the values are the row's log-probabilities.
    SCATTER: instead, the i-th index goes to tokens[children[r, i]] (a tree level's children by
    rank, -1 where row r has no child of that rank), values and indices unstored."""
    r = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + col, mask=col < n_cols, other=float("-inf")).to(tl.float32)
    shift = 0.0
    if LOG_SOFTMAX:
        top = tl.max(x, axis=0)
        shift = top + tl.log(tl.sum(tl.exp(x - top), axis=0))
    for i in range(k):
        value, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        token = at.to(tl.int64)
        if MAP_IDS:
            token = tl.load(ids_ptr + at)
        if SCATTER:
            child = tl.load(child_ptr + r * stride_c + i)
            tl.store(tokens_ptr + tl.maximum(child, 0), token, mask=child >= 0)
        else:
            tl.store(values_ptr + r * stride_o + i, value - shift)
            tl.store(index_ptr + r * stride_o + i, token)
        x = tl.where(col == at, float("-inf"), x)


@triton.jit
def lookup_chain(ids_ptr, length_ptr, root_ptr, out_ptr, capacity, count, stride_i, stride_o,
                 MAX_NGRAM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_J: tl.constexpr):
    """One program per sequence b: ``lookup.lookup_draft``'s chain [count]. The committed tokens
    ids [C] up to ``length``, the root after them: among the positions p < length whose token
    ends a match of the sequence's last 1…MAX_NGRAM tokens (the root the last), the longest
    match wins, then the latest; the chain is what followed it, repeating with the match's
    period where it runs into the root (no match: position 0's)."""
    b = tl.program_id(0)
    row = ids_ptr + b * stride_i
    length = tl.load(length_ptr + b)
    root = tl.load(root_ptr + b)
    best_score = tl.full((), -1, tl.int64)
    best = tl.full((), 0, tl.int64)
    for start in range(0, length, BLOCK):  # only the committed slots (the cache's capacity may be 8× more)
        p = start + tl.arange(0, BLOCK).to(tl.int64)
        run = p < length
        matched = tl.zeros((BLOCK,), tl.int64)
        for k in tl.static_range(MAX_NGRAM):
            if k == 0:
                key = root
            else:  # no k-th last token: a key no token equals (-1 is what a masked load gives)
                key = tl.where(length >= k, tl.load(row + tl.maximum(length - k, 0)), -2)
            token = tl.load(row + p - k, mask=run & (p >= k), other=-1)
            run = run & (token == key)
            matched += run.to(tl.int64)
        score = tl.where((p < length) & (matched > 0), matched * capacity + p, -1)
        top = tl.max(score, axis=0)
        at = tl.argmax(score, axis=0, tie_break_left=True).to(tl.int64)
        if top > best_score:
            best = start + at
            best_score = top
    period = tl.maximum(length - best, 1)
    j = tl.arange(0, BLOCK_J)
    take = tl.minimum(best + 1 + j % period, capacity - 1)
    token = tl.load(row + take, mask=j < count, other=0)
    tl.store(out_ptr + b * stride_o + j, tl.where(take == length, root, token), mask=j < count)


@triton.jit
def pick_blocks(h_ptr, w_ptr, values_ptr, index_ptr, tokens, vocab, d_model, stride_h, stride_w,
                BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """One program per (BLOCK_V rows of the LM head W [V, D], BLOCK_T hidden states h [T, D]):
    the scores h·W[v] on the tensor cores, rounded to h's dtype as the head's logits are
    stored, and each token's best among them with the lowest row among equals, at values and
    index [blocks, T] (blocks in vocabulary order)."""
    pv, pt = tl.program_id(0), tl.program_id(1)
    v = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    t = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    in_v, in_t = v < vocab, t < tokens
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < d_model
        h = tl.load(h_ptr + t[:, None] * stride_h + k[None, :], mask=in_t[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + v[None, :] * stride_w + k[:, None], mask=in_v[None, :] & in_k[:, None], other=0.0,
                    eviction_policy="evict_first")  # [BLOCK_K, BLOCK_V]: W's rows as columns
        if IEEE:
            acc = tl.dot(h, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(h, w, acc)
    scores = tl.where(in_v[None, :], acc.to(h_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    best, at = tl.max(scores, axis=1, return_indices=True, return_indices_tie_break_left=True)
    tl.store(values_ptr + pv * tokens + t, best, mask=in_t)
    tl.store(index_ptr + pv * tokens + t, pv * BLOCK_V + at.to(tl.int64), mask=in_t)


@triton.jit
def pick_best(values_ptr, index_ptr, out_ptr, blocks, tokens, BLOCK_P: tl.constexpr):
    """One program per token: the best of ``pick_blocks``' blocks (the lowest row among equals:
    the blocks are in vocabulary order), its row at out [T]."""
    t = tl.program_id(0)
    best = tl.full((), float("-inf"), tl.float32)
    row = tl.load(index_ptr + t)  # the first block's (a row of all -inf: row 0, as argmax)
    for lo in range(0, blocks, BLOCK_P):
        p = lo + tl.arange(0, BLOCK_P)
        value, at = tl.max(tl.load(values_ptr + p * tokens + t, mask=p < blocks, other=float("-inf")), axis=0,
                           return_indices=True, return_indices_tie_break_left=True)
        row = tl.where(value > best, tl.load(index_ptr + (lo + at) * tokens + t), row)
        best = tl.maximum(best, value)
    tl.store(out_ptr + t, row)


@triton.jit
def hydra_state(prev_ptr, parents_ptr, tokens_ptr, emb_ptr, w_ptr, b_ptr, out_ptr, lo, count, prev_lo, d_model,
                stride_p, stride_e, stride_w, stride_o, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """A hydra head's states for a tree level's ``count`` nodes lo… (``HydraHeads.step``), BLOCK_N
    of their D columns a program: out[p] = s + silu(W·[s; e] + b), where s is the node's parent's
    state (row parents[lo + p] - prev_lo of prev [P', D]; the root's: row 0) and e the embedding of
    the node's token (tokens[lo + p]), W [D, 2D] and b [D] the head's input layer. The gathers,
    the concatenation, the matmul, its bias, the SiLU and the residual in one kernel."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    in_p, in_n = p < count, n < d_model
    rows = tl.maximum(tl.load(parents_ptr + lo + p, mask=in_p, other=0) - prev_lo, 0)
    toks = tl.load(tokens_ptr + lo + p, mask=in_p, other=0)
    acc = tl.zeros((BLOCK_P, BLOCK_N), tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < d_model
        both = in_p[:, None] & in_k[None, :]
        s = tl.load(prev_ptr + rows[:, None] * stride_p + k[None, :], mask=both, other=0.0)
        e = tl.load(emb_ptr + toks[:, None] * stride_e + k[None, :], mask=both, other=0.0)
        w_at = w_ptr + n[None, :] * stride_w + k[:, None]  # [BLOCK_K, BLOCK_N]: W's rows as columns
        w_live = in_n[None, :] & in_k[:, None]
        ws = tl.load(w_at, mask=w_live, other=0.0, eviction_policy="evict_first")
        we = tl.load(w_at + d_model, mask=w_live, other=0.0, eviction_policy="evict_first")
        if IEEE:
            acc = tl.dot(s, ws, acc, input_precision="ieee")
            acc = tl.dot(e.to(s.dtype), we, acc, input_precision="ieee")
        else:
            acc = tl.dot(s, ws, acc)
            acc = tl.dot(e.to(s.dtype), we, acc)
    acc = (acc + tl.load(b_ptr + n, mask=in_n, other=0.0).to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
    acc = acc.to(tl.float32)  # the layer's output as stored, then its SiLU and the residual
    both = in_p[:, None] & in_n[None, :]
    s = tl.load(prev_ptr + rows[:, None] * stride_p + n[None, :], mask=both, other=0.0).to(tl.float32)
    silu = (acc / (1.0 + tl.exp(-acc))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + p[:, None] * stride_o + n[None, :], (s + silu).to(out_ptr.dtype.element_ty), mask=both)


@triton.jit
def step_tables(pos_ptr, inv_ptr, mask_ptr, cos_ptr, sin_ptr, bias_ptr, tokens, span, groups, scale,
                stride_m, stride_t, stride_b, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
                LIBDEVICE: tl.constexpr):
    """One program per token t of a step: its rotary tables cos, signed sin [T, 2·HALF] (as
    ``model.rope_tables``: angle pos·inv_freq in fp32, cos and sin scaled, then rounded to the
    tables' dtype; the sin's first half negated) and its rows g·T + t of the additive attention
    bias [groups·T, S] (0 where ``mask`` [T, S] lets it attend, else -inf, as ``attention_bias``).
    LIBDEVICE: the cosine and sine of CUDA's math library, as torch's take them (not the hardware's
    approximations, whose error grows with the angle); off in Triton's interpreter, which has none."""
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_H)
    live = j < HALF
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + j, mask=live, other=0.0)
    if LIBDEVICE:
        c = libdevice.cos(angle) * scale
        s = libdevice.sin(angle) * scale
    else:
        c = tl.cos(angle) * scale
        s = tl.sin(angle) * scale
    row = t * stride_t
    tl.store(cos_ptr + row + j, c.to(cos_ptr.dtype.element_ty), mask=live)
    tl.store(cos_ptr + row + HALF + j, c.to(cos_ptr.dtype.element_ty), mask=live)
    tl.store(sin_ptr + row + j, (-s).to(sin_ptr.dtype.element_ty), mask=live)
    tl.store(sin_ptr + row + HALF + j, s.to(sin_ptr.dtype.element_ty), mask=live)
    for s0 in range(0, span, BLOCK_S):
        cols = s0 + tl.arange(0, BLOCK_S)
        in_s = cols < span
        seen = tl.load(mask_ptr + t * stride_m + cols, mask=in_s, other=0) != 0
        bias = tl.where(seen, 0.0, float("-inf")).to(bias_ptr.dtype.element_ty)
        for g in range(groups):
            tl.store(bias_ptr + (g * tokens + t) * stride_b + cols, bias, mask=in_s)
