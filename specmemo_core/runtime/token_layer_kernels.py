"""The Triton kernels of ``token_layer`` (imported only where Triton is installed).

A one-token step's matmuls are matrix-vector products bound by reading the weight; these
read it once, with what cuBLAS would leave to kernels of their own (the norm before, the
rotary, cache write, SiLU or residual add after) done on the way in or out. Weights are
loaded to be evicted first: each is read once a step, and the activations and the cache
are what L2 should keep. A 16-bit step of several tokens runs the same work as tiles on the
tensor cores (``norm_pair_rows``, ``matmul_add_rows``: each weight tile read once for all the
tokens; ``norm_scale_rows`` first, the norm once per token); an fp32 one, or a large layer's
prompt chunk past one tile of tokens, keeps cuBLAS's matmul and ends it with ``rotate_rows``:
the one-token kernel's rotary and cache write, for every token.
Parameters are positional pointers, sizes and strides, as Triton kernels take them
(``scripts/check_code_shape.py`` leaves ``@triton.jit`` functions' parameter counts alone).
"""

import triton
import triton.language as tl

# programmatic dependent launch (None where Triton lacks it: ``token_layer`` launches without it)
from specmemo_core.runtime.chunked_attention_kernels import dependent_launch, gdc_launch_dependents, gdc_wait


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each of ``ptrs`` (``prefetch.global.L2``): nothing comes to the
    program and nothing waits, so a kernel may ask before ``gdc_wait`` for what the kernel ahead of it
    does not write (weights). Only on a GPU: Triton's interpreter runs no PTX."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(base_ptr, rows, stride, COLS: tl.constexpr, LINE: tl.constexpr):
    """``prefetch_l2`` of the first COLS columns of each of ``rows`` (valid row numbers) of a
    row-major matrix at ``base_ptr`` (``stride`` elements apart): one ask per LINE elements."""
    lines = tl.arange(0, COLS // LINE) * LINE
    prefetch_l2(base_ptr + rows[:, None] * stride + lines[None, :])


@triton.jit
def _weight_tile(w_ptr, rows, live, k, k_cols, stride_w):
    """W[rows, k] (zeros past the edges: the tile after the last is all masked, no traffic),
    loaded to be evicted first."""
    return tl.load(w_ptr + rows[:, None] * stride_w + k[None, :], mask=live[:, None] & (k < k_cols)[None, :],
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def norm_pair_matmul(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr,
                     d_model, half, group, eps, stride_w, stride_kh, stride_ks, stride_vh, stride_vs,
                     heads, kv_heads,
                     PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, ROPE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PDL: tl.constexpr):
    """W · rmsnorm(x)·g for PAIRS pairs of weight rows (a = group·G + j, b = a + half), a
    pair's two outputs finished together:

    - ROPE (the fused q/k/v weight; group = head dim, half = its half; G = head): the rotary
      of q and k heads (rotate-half, signed sin table as ``model.rope_tables`` gives), q
      stored at out [H·hd], k and v at the cache slot ``slot_ptr`` holds.
    - else (the fused gate/up weight; half = intermediate size, G = 0): out[j] = silu(a)·b.
    """
    p = tl.program_id(0)
    per_group = tl.cdiv(half, PAIRS)
    grp = p // per_group
    j = (p % per_group) * PAIRS + tl.arange(0, PAIRS)
    live = j < half
    rows_a = grp * group + j
    rows_b = rows_a + half
    squares = tl.zeros((BLOCK_K,), tl.float32)
    acc_a = tl.zeros((PAIRS, BLOCK_K), tl.float32)
    acc_b = tl.zeros((PAIRS, BLOCK_K), tl.float32)
    k = tl.arange(0, BLOCK_K)
    wa = _weight_tile(w_ptr, rows_a, live, k, d_model, stride_w)  # the weights are no kernel's output:
    wb = _weight_tile(w_ptr, rows_b, live, k, d_model, stride_w)  # read before waiting for x
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    for k0 in range(0, d_model, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < d_model
        x = tl.load(x_ptr + k, mask=in_k, other=0.0).to(tl.float32)
        xg = x * tl.load(g_ptr + k, mask=in_k, other=0.0).to(tl.float32)
        squares += x * x
        acc_a += wa.to(tl.float32) * xg[None, :]
        acc_b += wb.to(tl.float32) * xg[None, :]
        wa = _weight_tile(w_ptr, rows_a, live, k + BLOCK_K, d_model, stride_w)  # the next tile, in flight
        wb = _weight_tile(w_ptr, rows_b, live, k + BLOCK_K, d_model, stride_w)  # while this one is summed
    # the norm's 1/rms is one number for the row: it scales the sums instead of each input
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 0) / d_model + eps)
    ya = tl.sum(acc_a, 1) * rstd
    yb = tl.sum(acc_b, 1) * rstd
    if HAS_BIAS:
        ya += tl.load(b_ptr + rows_a, mask=live, other=0.0).to(tl.float32)
        yb += tl.load(b_ptr + rows_b, mask=live, other=0.0).to(tl.float32)
    ya = ya.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection's output, as stored
    yb = yb.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        _rotate_and_store(ya, yb, j, live, grp, half, group, heads, kv_heads, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                          k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs)
    else:
        tl.store(out_ptr + j, (ya / (1.0 + tl.exp(-ya)) * yb).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def _rotate_and_store(ya, yb, j, live, grp, half, group, heads, kv_heads, out_ptr, cos_ptr, sin_ptr, slot_ptr,
                      k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs):
    """``norm_pair_matmul``'s q/k/v ending: head ``grp``'s outputs j and j + half (ya, yb, fp32)
    rotated if a q or k head, then stored: q at out, k and v at the cache slot."""
    rotate = grp < heads + kv_heads
    cos_a = tl.load(cos_ptr + j, mask=live, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + j, mask=live, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + j + half, mask=live, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + j + half, mask=live, other=0.0).to(tl.float32)
    ra = tl.where(rotate, ya * cos_a + yb * sin_a, ya).to(out_ptr.dtype.element_ty)
    rb = tl.where(rotate, yb * cos_b + ya * sin_b, yb).to(out_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr)
    if grp < heads:
        tl.store(out_ptr + grp * group + j, ra, mask=live)
        tl.store(out_ptr + grp * group + j + half, rb, mask=live)
    elif grp < heads + kv_heads:
        at = k_ptr + (grp - heads) * stride_kh + slot * stride_ks + j
        tl.store(at, ra, mask=live)
        tl.store(at + half, rb, mask=live)
    else:
        at = v_ptr + (grp - heads - kv_heads) * stride_vh + slot * stride_vs + j
        tl.store(at, ra, mask=live)
        tl.store(at + half, rb, mask=live)


@triton.jit
def matmul_add(a_ptr, w_ptr, b_ptr, r_ptr, out_ptr, n_rows, k_cols, stride_w,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    """out[n] = r[n] + Σ_k W[n, k]·a[k] (+ bias[n]) for BLOCK_N rows n: o_proj or down_proj
    with its residual add, fp32 sums over BLOCK_K-wide tiles."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < n_rows
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    w = _weight_tile(w_ptr, n, live, tl.arange(0, BLOCK_K), k_cols, stride_w)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    for k0 in range(0, k_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + k, mask=k < k_cols, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[None, :]
        w = _weight_tile(w_ptr, n, live, k + BLOCK_K, k_cols, stride_w)
    y = tl.sum(acc, 1)
    if HAS_BIAS:  # a linear with a bias rounds its output before the residual add
        y = (y + tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)).to(out_ptr.dtype.element_ty)
        y = y.to(tl.float32)
    y += tl.load(r_ptr + n, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def rotate_rows(qkv_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, tokens, half, heads, kv_heads,
                stride_x, stride_c, stride_kh, stride_ks, stride_vh, stride_vs, HALF: tl.constexpr):
    """One program per (token t, head of the fused q/k/v output qkv [T, (H + 2·Hkv)·hd]): the
    head's two halves rotated (q and k) and stored as ``norm_pair_matmul``'s ending stores
    them, q at out [H, T, hd] (``Attention.attend``'s [Hkv, groups·T, hd]), k and v at the
    cache slot ``slot_ptr[t]``."""
    t, grp = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, HALF)
    live = j < half
    row = qkv_ptr + t * stride_x + grp * 2 * half
    ya = tl.load(row + j, mask=live, other=0.0).to(tl.float32)
    yb = tl.load(row + j + half, mask=live, other=0.0).to(tl.float32)
    _rotate_and_store(ya, yb, j, live, grp, half, tokens * 2 * half, heads, kv_heads, out_ptr + t * 2 * half,
                      cos_ptr + t * stride_c, sin_ptr + t * stride_c, slot_ptr + t, k_ptr, v_ptr,
                      stride_kh, stride_ks, stride_vh, stride_vs)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a·b on the tensor cores; fp32 operands as IEEE products (no TF32)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _weight_tile_t(w_ptr, cols, live, k, k_cols, stride_w):
    """W[cols, k] transposed, [len(k), len(cols)]: a matmul's right operand, evicted first."""
    return tl.load(w_ptr + cols[None, :] * stride_w + k[:, None], mask=live[None, :] & (k < k_cols)[:, None],
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def norm_scale_rows(x_ptr, g_ptr, xg_ptr, rstd_ptr, d_model, eps, stride_x, stride_xg,
                    BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One program per token of x [T, D]: x·g in x's precision at xg and the norm's 1/rms (fp32)
    at rstd [T], for ``norm_pair_rows``' PRENORMED launch."""
    dependent_launch(PDL)
    t = tl.program_id(0)
    k = tl.arange(0, BLOCK_D)
    in_k = k < d_model
    x = tl.load(x_ptr + t * stride_x + k, mask=in_k, other=0.0).to(tl.float32)
    tl.store(rstd_ptr + t, 1.0 / tl.sqrt(tl.sum(x * x, 0) / d_model + eps))
    g = tl.load(g_ptr + k, mask=in_k, other=0.0).to(tl.float32)
    tl.store(xg_ptr + t * stride_xg + k, (x * g).to(xg_ptr.dtype.element_ty), mask=in_k)


@triton.jit
def norm_pair_rows(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr,
                   tokens, d_model, half, group, eps, stride_x, stride_w, stride_c, stride_o,
                   stride_kh, stride_ks, stride_vh, stride_vs, heads, kv_heads,
                   BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, ROPE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                   PRENORMED: tl.constexpr = False, PREFETCH: tl.constexpr = 0, LINE: tl.constexpr = 64,
                   EARLY: tl.constexpr = False):
    """``norm_pair_matmul`` for T tokens x [T, D] at once, as tiles: a program finishes PAIRS weight-row
    pairs for BLOCK_M tokens (grid: pair tiles × token tiles), each weight tile read once for them all.
    The norm's weight g scales x before the tensor cores' products (x·g in x's precision), its 1/rms,
    one per token, the sums after. Endings as the one-token kernel's, per token: ROPE stores q at out
    [H, T, hd] and k, v at the cache slots ``slot_ptr[t]``; else out[t, j] = silu(a)·b, rows ``stride_o``
    apart. PRENORMED: x holds x·g and g_ptr the 1/rms per token (``norm_scale_rows``), so the loop only
    loads and multiplies (the norm in every program: the default model's tree step 0.14 ms longer on an
    H100). PDL: ``dependent_launch``'s modes; PREFETCH: a weight row's columns asked of L2 before it waits.
    EARLY: the ending's inputs (1/rms, biases, rotary tables, slots: ``_pair_ending_inputs``) loaded
    before the loop, their latency under its loads, not after it where every program waits for them."""
    p, mt = tl.program_id(0), tl.program_id(1)
    per_group = tl.cdiv(half, PAIRS)
    grp = p // per_group
    j = (p % per_group) * PAIRS + tl.arange(0, PAIRS)
    live = j < half
    rows_a = grp * group + j
    if PREFETCH > 0:  # the weights are no kernel's output: asked for while the kernel ahead drains
        prefetch_rows(w_ptr, grp * group + tl.where(live, j, 0), stride_w, PREFETCH, LINE)
        prefetch_rows(w_ptr, grp * group + tl.where(live, j, 0) + half, stride_w, PREFETCH, LINE)
    dependent_launch(PDL)
    t = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = t < tokens
    if EARLY:  # (``both`` made where the ending's inputs are read: else its predicates live through the loop)
        both = in_t[:, None] & live[None, :]
        ending = _pair_ending_inputs(g_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, t, j, rows_a, in_t, live, both,
                                     half, stride_c, PRENORMED, HAS_BIAS, ROPE)
    acc_a, acc_b, squares = _pair_sums(x_ptr, g_ptr, w_ptr, t, in_t, rows_a, live, half, d_model, stride_x, stride_w,
                                       BLOCK_M, PAIRS, BLOCK_K, PRENORMED, IEEE)
    if not EARLY:
        both = in_t[:, None] & live[None, :]
        ending = _pair_ending_inputs(g_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, t, j, rows_a, in_t, live, both,
                                     half, stride_c, PRENORMED, HAS_BIAS, ROPE)
    rstd, bias_a, bias_b, cos_a, sin_a, cos_b, sin_b, slot = ending
    if not PRENORMED:
        rstd = 1.0 / tl.sqrt(squares / d_model + eps)
    ya = acc_a * rstd[:, None]
    yb = acc_b * rstd[:, None]
    if HAS_BIAS:
        ya += bias_a.to(tl.float32)[None, :]
        yb += bias_b.to(tl.float32)[None, :]
    ya = ya.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection's output, as stored
    yb = yb.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        _rotate_and_store_rows(ya, yb, cos_a, sin_a, cos_b, sin_b, slot, t, j, both, grp, tokens, half, group,
                               heads, kv_heads, out_ptr, k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs)
    else:
        tl.store(out_ptr + t[:, None] * stride_o + j[None, :],
                 (ya / (1.0 + tl.exp(-ya)) * yb).to(out_ptr.dtype.element_ty), mask=both)


@triton.jit
def _pair_sums(x_ptr, g_ptr, w_ptr, t, in_t, rows_a, live, half, d_model, stride_x, stride_w,
               BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, PRENORMED: tl.constexpr,
               IEEE: tl.constexpr):
    """``norm_pair_rows``'s loop: the sums of x·g (PRENORMED: x holds it, ``norm_scale_rows``) with the
    pairs' rows a and b (rows_a, rows_a + half) for the tokens t, and each token's sum of squares."""
    squares = tl.zeros((BLOCK_M,), tl.float32)
    acc_a = tl.zeros((BLOCK_M, PAIRS), tl.float32)
    acc_b = tl.zeros((BLOCK_M, PAIRS), tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < d_model
        if PRENORMED:  # x holds x·g already, g_ptr the 1/rms (``norm_scale_rows``)
            xg = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=in_t[:, None] & in_k[None, :], other=0.0)
        else:
            x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=in_t[:, None] & in_k[None, :],
                        other=0.0).to(tl.float32)
            squares += tl.sum(x * x, 1)
            xg = (x * tl.load(g_ptr + k, mask=in_k, other=0.0).to(tl.float32)[None, :]).to(w_ptr.dtype.element_ty)
        acc_a = _dot(xg, _weight_tile_t(w_ptr, rows_a, live, k, d_model, stride_w), acc_a, IEEE)
        acc_b = _dot(xg, _weight_tile_t(w_ptr, rows_a + half, live, k, d_model, stride_w), acc_b, IEEE)
    return acc_a, acc_b, squares


@triton.jit
def _pair_ending_inputs(g_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, t, j, rows_a, in_t, live, both, half, stride_c,
                        PRENORMED: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE: tl.constexpr):
    """What ``norm_pair_rows``'s ending reads besides its sums, as stored: the 1/rms a token
    (PRENORMED), the pairs' biases, the rotary tables at (t, j) and (t, j + half) and the tokens'
    cache slots (ROPE); zeros where a kind is not read."""
    rstd = tl.zeros((t.shape[0],), tl.float32)
    bias_a = tl.zeros((j.shape[0],), tl.float32)
    bias_b = bias_a
    cos_a = tl.zeros((t.shape[0], j.shape[0]), tl.float32)
    sin_a, cos_b, sin_b = cos_a, cos_a, cos_a
    slot = tl.zeros((t.shape[0],), tl.int32)
    if PRENORMED:
        rstd = tl.load(g_ptr + t, mask=in_t, other=0.0)
    if HAS_BIAS:
        bias_a = tl.load(b_ptr + rows_a, mask=live, other=0.0)
        bias_b = tl.load(b_ptr + rows_a + half, mask=live, other=0.0)
    if ROPE:
        at_a = t[:, None] * stride_c + j[None, :]
        cos_a = tl.load(cos_ptr + at_a, mask=both, other=0.0)
        sin_a = tl.load(sin_ptr + at_a, mask=both, other=0.0)
        cos_b = tl.load(cos_ptr + at_a + half, mask=both, other=0.0)
        sin_b = tl.load(sin_ptr + at_a + half, mask=both, other=0.0)
        slot = tl.load(slot_ptr + t, mask=in_t, other=0)
    return rstd, bias_a, bias_b, cos_a, sin_a, cos_b, sin_b, slot


@triton.jit
def _rotate_and_store_rows(ya, yb, cos_a, sin_a, cos_b, sin_b, slots, t, j, both, grp, tokens, half, group, heads,
                           kv_heads, out_ptr, k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs):
    """``_rotate_and_store`` for a tile of tokens t × pair columns j (ya, yb [len(t), len(j)]), the
    rotary tables and slots ``_pair_ending_inputs`` read: q at out [H, T, hd], k and v at each token's
    cache slot."""
    rotate = grp < heads + kv_heads
    cos_a, sin_a = cos_a.to(tl.float32), sin_a.to(tl.float32)
    cos_b, sin_b = cos_b.to(tl.float32), sin_b.to(tl.float32)
    ra = tl.where(rotate, ya * cos_a + yb * sin_a, ya).to(out_ptr.dtype.element_ty)
    rb = tl.where(rotate, yb * cos_b + ya * sin_b, yb).to(out_ptr.dtype.element_ty)
    slot = slots[:, None]
    if grp < heads:
        at = out_ptr + grp * tokens * group + t[:, None] * group + j[None, :]
    elif grp < heads + kv_heads:
        at = k_ptr + (grp - heads) * stride_kh + slot * stride_ks + j[None, :]
    else:
        at = v_ptr + (grp - heads - kv_heads) * stride_vh + slot * stride_vs + j[None, :]
    tl.store(at, ra, mask=both)
    tl.store(at + half, rb, mask=both)


@triton.jit
def _add_ending_inputs(b_ptr, r_ptr, t, n, live, both, stride_r, HAS_BIAS: tl.constexpr):
    """What ``matmul_add_rows``'s ending reads besides its sums, as stored: the residual r[t, n]
    and the bias (zeros without one)."""
    bias = tl.zeros((n.shape[0],), tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=live, other=0.0)
    return tl.load(r_ptr + t[:, None] * stride_r + n[None, :], mask=both, other=0.0), bias


@triton.jit
def matmul_add_rows(a_ptr, w_ptr, b_ptr, r_ptr, out_ptr, tokens, n_rows, k_cols, stride_a, stride_w, stride_r,
                    stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                    PREFETCH: tl.constexpr = 0, LINE: tl.constexpr = 64, EARLY: tl.constexpr = False):
    """``matmul_add`` for T tokens a [T, K] at once, as tiles (grid: output tiles × token
    tiles): out[t, n] = r[t, n] + Σ_k a[t, k]·W[n, k] (+ bias[n], rounded first); PDL,
    PREFETCH and EARLY (here: r and the bias) as ``norm_pair_rows``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live, in_t = n < n_rows, t < tokens
    if PREFETCH > 0:
        prefetch_rows(w_ptr, tl.where(live, n, 0), stride_w, PREFETCH, LINE)
    dependent_launch(PDL)
    if EARLY:
        both = in_t[:, None] & live[None, :]
        residual, bias = _add_ending_inputs(b_ptr, r_ptr, t, n, live, both, stride_r, HAS_BIAS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + t[:, None] * stride_a + k[None, :], mask=in_t[:, None] & (k < k_cols)[None, :],
                    other=0.0)
        acc = _dot(a, _weight_tile_t(w_ptr, n, live, k, k_cols, stride_w), acc, IEEE)
    if not EARLY:
        both = in_t[:, None] & live[None, :]
        residual, bias = _add_ending_inputs(b_ptr, r_ptr, t, n, live, both, stride_r, HAS_BIAS)
    if HAS_BIAS:
        acc = (acc + bias.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
        acc = acc.to(tl.float32)
    acc += residual.to(tl.float32)
    tl.store(out_ptr + t[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=both)
