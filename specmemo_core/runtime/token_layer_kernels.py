"""The Triton kernels of ``token_layer`` (imported only where Triton is installed).

A one-token step's matmuls are matrix-vector products bound by reading the weight; these
read it once, with what cuBLAS would leave to kernels of their own (the norm before, the
rotary, cache write, SiLU or residual add after) done on the way in or out. Weights are
loaded to be evicted first: each is read once a step, and the activations and the cache
are what L2 should keep.
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
    one = tl.zeros((1,), tl.int32)  # the one token: row 0 of the shared ending's [rows, pairs] tiles
    _finish_pairs(ya[None, :], yb[None, :], one, one < 1, 1, j, live, rows_a, rows_b, grp, half, group, heads,
                  kv_heads, b_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, stride_kh, stride_ks,
                  stride_vh, stride_vs, ROPE, HAS_BIAS)


@triton.jit
def _finish_pairs(ya, yb, t, live_t, tokens, j, live, rows_a, rows_b, grp, half, group, heads, kv_heads, b_ptr,
                  out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr, stride_kh, stride_ks, stride_vh, stride_vs,
                  ROPE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The pair kernels' ending for tokens t [M] and pairs j [P]: ya, yb [M, P] (fp32 sums)
    plus bias, rounded as a projection's output is stored, then (ROPE) head ``grp`` rotated
    if a q or k head and stored — q at out [H, tokens, hd], k and v at each token's cache slot
    — or silu(a)·b stored at out [tokens, half]."""
    dtype = out_ptr.dtype.element_ty
    both = live_t[:, None] & live[None, :]
    if HAS_BIAS:
        ya += tl.load(b_ptr + rows_a, mask=live, other=0.0).to(tl.float32)[None, :]
        yb += tl.load(b_ptr + rows_b, mask=live, other=0.0).to(tl.float32)[None, :]
    ya = ya.to(dtype).to(tl.float32)
    yb = yb.to(dtype).to(tl.float32)
    if ROPE:
        rotate = grp < heads + kv_heads
        at = t[:, None] * group + j[None, :]  # [M, P] into the [tokens, hd] tables
        cos_a = tl.load(cos_ptr + at, mask=both, other=0.0).to(tl.float32)
        sin_a = tl.load(sin_ptr + at, mask=both, other=0.0).to(tl.float32)
        cos_b = tl.load(cos_ptr + at + half, mask=both, other=0.0).to(tl.float32)
        sin_b = tl.load(sin_ptr + at + half, mask=both, other=0.0).to(tl.float32)
        ra = tl.where(rotate, ya * cos_a + yb * sin_a, ya).to(dtype)
        rb = tl.where(rotate, yb * cos_b + ya * sin_b, yb).to(dtype)
        slot = tl.load(slot_ptr + t, mask=live_t, other=0)[:, None]  # [M, 1]
        if grp < heads:
            dst = out_ptr + (grp * tokens + t[:, None]) * group + j[None, :]
            tl.store(dst, ra, mask=both)
            tl.store(dst + half, rb, mask=both)
        elif grp < heads + kv_heads:
            dst = k_ptr + (grp - heads) * stride_kh + slot * stride_ks + j[None, :]
            tl.store(dst, ra, mask=both)
            tl.store(dst + half, rb, mask=both)
        else:
            dst = v_ptr + (grp - heads - kv_heads) * stride_vh + slot * stride_vs + j[None, :]
            tl.store(dst, ra, mask=both)
            tl.store(dst + half, rb, mask=both)
    else:
        tl.store(out_ptr + t[:, None] * half + j[None, :], (ya / (1.0 + tl.exp(-ya)) * yb).to(dtype), mask=both)


@triton.jit
def norm_pair_mm(x_ptr, g_ptr, w_ptr, b_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr,
                 tokens, d_model, half, group, eps, stride_w, stride_kh, stride_ks, stride_vh, stride_vs,
                 heads, kv_heads,
                 PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROPE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    """``norm_pair_matmul`` for ``tokens`` ≤ BLOCK_M rows x [tokens, D] at once (a tree's
    step): each weight tile is read once for every row, the sums by ``tl.dot`` (IEEE in fp32)
    over x·g rounded as the weights' dtype, each row's 1/rms scaling its sums after."""
    p = tl.program_id(0)
    per_group = tl.cdiv(half, PAIRS)
    grp = p // per_group
    j = (p % per_group) * PAIRS + tl.arange(0, PAIRS)
    live = j < half
    rows_a = grp * group + j
    rows_b = rows_a + half
    t = tl.arange(0, BLOCK_M)
    live_t = t < tokens
    squares = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    acc_a = tl.zeros((BLOCK_M, PAIRS), tl.float32)
    acc_b = tl.zeros((BLOCK_M, PAIRS), tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < d_model
        x = tl.load(x_ptr + t[:, None] * d_model + k[None, :], mask=live_t[:, None] & in_k[None, :],
                    other=0.0).to(tl.float32)
        squares += x * x
        xg = (x * tl.load(g_ptr + k, mask=in_k, other=0.0).to(tl.float32)[None, :]).to(w_ptr.dtype.element_ty)
        wa = _weight_tile(w_ptr, rows_a, live, k, d_model, stride_w)
        wb = _weight_tile(w_ptr, rows_b, live, k, d_model, stride_w)
        if IEEE:
            acc_a = tl.dot(xg, tl.trans(wa), acc_a, input_precision="ieee")
            acc_b = tl.dot(xg, tl.trans(wb), acc_b, input_precision="ieee")
        else:
            acc_a = tl.dot(xg, tl.trans(wa), acc_a)
            acc_b = tl.dot(xg, tl.trans(wb), acc_b)
    rstd = 1.0 / tl.sqrt(tl.sum(squares, 1) / d_model + eps)  # [BLOCK_M]
    _finish_pairs(acc_a * rstd[:, None], acc_b * rstd[:, None], t, live_t, tokens, j, live, rows_a, rows_b, grp,
                  half, group, heads, kv_heads, b_ptr, out_ptr, cos_ptr, sin_ptr, slot_ptr, k_ptr, v_ptr,
                  stride_kh, stride_ks, stride_vh, stride_vs, ROPE, HAS_BIAS)


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
def mm_add(a_ptr, w_ptr, b_ptr, r_ptr, out_ptr, tokens, n_rows, k_cols, stride_a, stride_w,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
           IEEE: tl.constexpr):
    """``matmul_add`` for ``tokens`` ≤ BLOCK_M rows: out[t, n] = r[t, n] + Σ_k a[t, k]·W[n, k]
    (+ bias[n]), each weight tile read once for every row, the sums by ``tl.dot``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < n_rows
    t = tl.arange(0, BLOCK_M)
    live_t = t < tokens
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k_cols, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + t[:, None] * stride_a + k[None, :], mask=live_t[:, None] & (k < k_cols)[None, :],
                    other=0.0)
        w = _weight_tile(w_ptr, n, live, k, k_cols, stride_w)
        if IEEE:
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if HAS_BIAS:  # a linear with a bias rounds its output before the residual add
        acc = (acc + tl.load(b_ptr + n, mask=live, other=0.0).to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
        acc = acc.to(tl.float32)
    both = live_t[:, None] & live[None, :]
    at = t[:, None] * n_rows + n[None, :]
    acc += tl.load(r_ptr + at, mask=both, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=both)
