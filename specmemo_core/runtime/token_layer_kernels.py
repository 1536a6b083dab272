"""The Triton kernels of ``token_layer`` (imported only where Triton is installed).

A decoding step of a few tokens is bound by reading the weights: its matmuls are
matrix-vector products, one per token, over the same weight rows. These read each weight
tile once for all the step's tokens (``TOKENS``, the step's token count rounded up to a power
of two; a one-token step has 1), with what cuBLAS would leave to kernels of their own (the
norm before, the rotary, cache write, SiLU or residual add after) done on the way in or
out. Weights are loaded to be evicted first: each is read once a step, and the activations
and the cache are what L2 should keep. A step of more tokens keeps cuBLAS's matmul and ends
it with ``rotate_rows``: the same rotary and cache write, for every token.
Parameters are positional pointers, sizes and strides, as Triton kernels take them
(``scripts/check_code_shape.py`` leaves ``@triton.jit`` functions' parameter counts alone).
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper on): a kernel's programs start while the one before drains
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: ``token_layer`` launches without it
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _weight_tile(w_ptr, rows, live, k, k_cols, stride_w):
    """W[rows, k] (zeros past the edges: the tile after the last is all masked, no traffic),
    loaded to be evicted first."""
    return tl.load(w_ptr + rows[:, None] * stride_w + k[None, :], mask=live[:, None] & (k < k_cols)[None, :],
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def norm_pair_matmul(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr,
                     d_model, half, group, eps, stride_w, stride_kh, stride_ks, stride_vh, stride_vs,
                     heads, kv_heads, tokens, stride_x, stride_o, stride_c,
                     PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, ROPE: tl.constexpr, HAS_BIAS: tl.constexpr,
                     PDL: tl.constexpr, TOKENS: tl.constexpr):
    """W · rmsnorm(x[t])·g for each of the ``tokens`` rows t of x (row stride ``stride_x``) and
    PAIRS pairs of weight rows (a = group·G + j, b = a + half), a pair's two outputs finished
    together:

    - ROPE (the fused q/k/v weight; group = head dim, half = its half; G = head): the rotary
      of q and k heads (rotate-half, signed sin tables as ``model.rope_tables`` gives, row
      stride ``stride_c``), q stored at out [H, T, hd], k and v at the cache slot
      ``slot_ptr[t]``.
    - else (the fused gate/up weight; half = intermediate size, G = 0): out[t, j] = silu(a)·b
      (row stride ``stride_o``).
    """
    p = tl.program_id(0)
    per_group = tl.cdiv(half, PAIRS)
    grp = p // per_group
    j = (p % per_group) * PAIRS + tl.arange(0, PAIRS)
    live = j < half
    t = tl.arange(0, TOKENS)
    live_t = t < tokens
    rows_a = grp * group + j
    rows_b = rows_a + half
    squares = tl.zeros((TOKENS, BLOCK_K), tl.float32)
    acc_a = tl.zeros((TOKENS, PAIRS, BLOCK_K), tl.float32)
    acc_b = tl.zeros((TOKENS, PAIRS, BLOCK_K), tl.float32)
    k = tl.arange(0, BLOCK_K)
    wa = _weight_tile(w_ptr, rows_a, live, k, d_model, stride_w)  # the weights are no kernel's output:
    wb = _weight_tile(w_ptr, rows_b, live, k, d_model, stride_w)  # read before waiting for x
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    for k0 in range(0, d_model, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < d_model
        x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=live_t[:, None] & in_k[None, :],
                    other=0.0).to(tl.float32)  # [TOKENS, BLOCK_K]
        xg = x * tl.load(g_ptr + k, mask=in_k, other=0.0).to(tl.float32)[None, :]
        squares += x * x
        acc_a += wa.to(tl.float32)[None, :, :] * xg[:, None, :]
        acc_b += wb.to(tl.float32)[None, :, :] * xg[:, None, :]
        wa = _weight_tile(w_ptr, rows_a, live, k + BLOCK_K, d_model, stride_w)  # the next tile, in flight
        wb = _weight_tile(w_ptr, rows_b, live, k + BLOCK_K, d_model, stride_w)  # while this one is summed
    # the norm's 1/rms is one number for the row: it scales the sums instead of each input
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 1) / d_model + eps)  # [TOKENS]
    ya = tl.sum(acc_a, 2) * rstd[:, None]  # [TOKENS, PAIRS]
    yb = tl.sum(acc_b, 2) * rstd[:, None]
    if HAS_BIAS:
        ya += tl.load(b_ptr + rows_a, mask=live, other=0.0).to(tl.float32)[None, :]
        yb += tl.load(b_ptr + rows_b, mask=live, other=0.0).to(tl.float32)[None, :]
    ya = ya.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection's output, as stored
    yb = yb.to(out_ptr.dtype.element_ty).to(tl.float32)
    if ROPE:
        _rotate_and_store(ya, yb, t, live_t, j, live, grp, half, group * tokens, heads, kv_heads, out_ptr,
                          cos_ptr, sin_ptr, stride_c, slot_ptr, k_ptr, v_ptr, stride_kh, stride_ks, stride_vh,
                          stride_vs)
    else:
        tl.store(out_ptr + t[:, None] * stride_o + j[None, :], (ya / (1.0 + tl.exp(-ya)) * yb).to(
            out_ptr.dtype.element_ty), mask=live_t[:, None] & live[None, :])


@triton.jit
def _rotate_and_store(ya, yb, t, live_t, j, live, grp, half, stride_qh, heads, kv_heads, out_ptr, cos_ptr,
                      sin_ptr, stride_c, slot_ptr, k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs):
    """The q/k/v ending: head ``grp``'s outputs j and j + half (ya, yb [tokens t, pairs j], fp32)
    rotated if a q or k head, then stored: q at out [H, T, hd] (head stride ``stride_qh``),
    k and v at the cache slot ``slot_ptr[t]``."""
    rotate = grp < heads + kv_heads
    mask = live_t[:, None] & live[None, :]
    at_c = t[:, None] * stride_c + j[None, :]
    cos_a = tl.load(cos_ptr + at_c, mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(sin_ptr + at_c, mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(cos_ptr + at_c + half, mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(sin_ptr + at_c + half, mask=mask, other=0.0).to(tl.float32)
    ra = tl.where(rotate, ya * cos_a + yb * sin_a, ya).to(out_ptr.dtype.element_ty)
    rb = tl.where(rotate, yb * cos_b + ya * sin_b, yb).to(out_ptr.dtype.element_ty)
    slot = tl.load(slot_ptr + t, mask=live_t, other=0)[:, None]
    if grp < heads:
        at = out_ptr + grp * stride_qh + t[:, None] * (2 * half) + j[None, :]
    elif grp < heads + kv_heads:
        at = k_ptr + (grp - heads) * stride_kh + slot * stride_ks + j[None, :]
    else:
        at = v_ptr + (grp - heads - kv_heads) * stride_vh + slot * stride_vs + j[None, :]
    tl.store(at, ra, mask=mask)
    tl.store(at + half, rb, mask=mask)


@triton.jit
def matmul_add(a_ptr, w_ptr, b_ptr, r_ptr, out_ptr, n_rows, k_cols, stride_w, tokens, stride_a, stride_r,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
               TOKENS: tl.constexpr):
    """out[t, n] = r[t, n] + Σ_k W[n, k]·a[t, k] (+ bias[n]) for BLOCK_N rows n and each of the
    ``tokens`` rows t: o_proj or down_proj with its residual add, fp32 sums over BLOCK_K-wide tiles."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < n_rows
    t = tl.arange(0, TOKENS)
    live_t = t < tokens
    acc = tl.zeros((TOKENS, BLOCK_N, BLOCK_K), tl.float32)
    w = _weight_tile(w_ptr, n, live, tl.arange(0, BLOCK_K), k_cols, stride_w)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    for k0 in range(0, k_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + t[:, None] * stride_a + k[None, :], mask=live_t[:, None] & (k < k_cols)[None, :],
                    other=0.0).to(tl.float32)  # [TOKENS, BLOCK_K]
        acc += w.to(tl.float32)[None, :, :] * a[:, None, :]
        w = _weight_tile(w_ptr, n, live, k + BLOCK_K, k_cols, stride_w)
    y = tl.sum(acc, 2)  # [TOKENS, BLOCK_N]
    if HAS_BIAS:  # a linear with a bias rounds its output before the residual add
        y = (y + tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
        y = y.to(tl.float32)
    mask = live_t[:, None] & live[None, :]
    at = t[:, None] * stride_r + n[None, :]
    y += tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotate_rows(qkv_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, tokens, half, heads, kv_heads,
                stride_x, stride_c, stride_kh, stride_ks, stride_vh, stride_vs, HALF: tl.constexpr):
    """One program per (token t, head of the fused q/k/v output qkv [T, (H + 2·Hkv)·hd]): the
    head's two halves rotated (q and k) and stored as ``norm_pair_matmul``'s ending stores
    them, q at out [H, T, hd] (``Attention.attend``'s [Hkv, groups·T, hd]), k and v at the
    cache slot ``slot_ptr[t]``."""
    t = tl.program_id(0) + tl.arange(0, 1)
    grp = tl.program_id(1)
    j = tl.arange(0, HALF)
    live = j < half
    row = qkv_ptr + t[:, None] * stride_x + grp * 2 * half + j[None, :]
    ya = tl.load(row, mask=live[None, :], other=0.0).to(tl.float32)  # [1, HALF]
    yb = tl.load(row + half, mask=live[None, :], other=0.0).to(tl.float32)
    _rotate_and_store(ya, yb, t, t < tokens, j, live, grp, half, tokens * 2 * half, heads, kv_heads, out_ptr,
                      cos_ptr, sin_ptr, stride_c, slot_ptr, k_ptr, v_ptr, stride_kh, stride_ks, stride_vh,
                      stride_vs)
