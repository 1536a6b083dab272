"""The two Triton kernels of ``chunked_attention`` (imported only where Triton is installed).

Their parameters are positional pointers, sizes and strides, as Triton kernels take them
(``scripts/check_code_shape.py`` leaves ``@triton.jit`` functions' parameter counts alone).
"""

import triton
import triton.language as tl

try:  # programmatic dependent launch (Hopper on): a kernel's programs start while the one before drains
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: ``chunked_attention`` and ``token_layer`` launch without it
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """A kernel's programmatic dependent launch (``chunked_attention.attend``'s ``pdl``): 0 none; 1 wait for
    the kernel before, then let the next one start (a chain of such kernels runs one ahead);
    2 let the next one start, then wait (a chain of them all launches at once)."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def attend_chunks(q_ptr, k_ptr, v_ptr, bias_ptr, length_ptr, m_ptr, l_ptr, acc_ptr,
                  rows, new_tokens, scale, stride_qh, stride_qr, stride_kh, stride_ks,
                  stride_vh, stride_vs, stride_br,
                  HD: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                  CHUNK: tl.constexpr, IEEE: tl.constexpr, TAIL_BIAS: tl.constexpr, PDL: tl.constexpr):
    """One program: SPLIT slots of one key/value head for BLOCK_M of its rows; writes
    the chunk's row maxima m, sums l and unnormalised outputs acc (fp32). Every row sees
    the committed slots (before the cache's length): with TAIL_BIAS the bias is read only
    at the step's own slots (length and after), where the tree's mask differs by row. PDL:
    launched while the kernel before drains; it waits for it before touching memory."""
    dependent_launch(PDL)
    c, h, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(0)
    length = tl.load(length_ptr)
    end = length + new_tokens  # slots [0, end) may be visible
    first_biased = length if TAIL_BIAS else 0  # the bias is read from this slot on
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    live_rows = r < rows
    out = (h * splits + c) * rows + r  # [BLOCK_M] into m, l: [Hkv, splits, rows]
    d = tl.arange(0, HD)
    start = c * SPLIT
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    if start < end:
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HD), tl.float32)
        q = tl.load(q_ptr + h * stride_qh + r[:, None] * stride_qr + d[None, :],
                    mask=live_rows[:, None], other=0.0)  # [BLOCK_M, HD]
        for lo in range(start, start + SPLIT, CHUNK):
            s = lo + tl.arange(0, CHUNK)
            live = s < end
            k = tl.load(k_ptr + h * stride_kh + s[:, None] * stride_ks + d[None, :],
                        mask=live[:, None], other=0.0)  # [CHUNK, HD]
            v = tl.load(v_ptr + h * stride_vh + s[:, None] * stride_vs + d[None, :],
                        mask=live[:, None], other=0.0)  # [CHUNK, HD], in flight with k
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            bias = tl.load(bias_ptr + r[:, None] * stride_br + s[None, :],  # 0 where not read
                           mask=live_rows[:, None] & (live & (s >= first_biased))[None, :], other=0.0)
            scores = tl.where(live[None, :], scores * scale + bias.to(tl.float32), float("-inf"))  # [BLOCK_M, CHUNK]
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        tl.store(l_ptr + out, l_i, mask=live_rows)
        tl.store(acc_ptr + out[:, None] * HD + d[None, :], acc.to(acc_ptr.dtype.element_ty), mask=live_rows[:, None])
    tl.store(m_ptr + out, m_i, mask=live_rows)  # -inf alone past the end: merge_chunks skips it


@triton.jit
def merge_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, rows, new_tokens, groups, splits, stride_ot,
                 HD: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    """One program per (key/value head, ROWS of its rows): each row's chunks' partial softmaxes
    as one, written at the row's token and query head of the [T, H·hd] output. A row's sums run
    in the same order whichever of the ROWS it is (one layout, each row's fiber alike), so a
    row's output does not depend on how many rows the step has."""
    dependent_launch(PDL)
    h, rb = tl.program_id(0), tl.program_id(1)
    r = rb * ROWS + tl.arange(0, ROWS)  # [ROWS]
    live_r = r < rows
    d = tl.arange(0, HD)
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    for lo in range(0, splits, BLOCK):
        c = lo + tl.arange(0, BLOCK)
        at = (h * splits + c)[None, :] * rows + r[:, None]  # [ROWS, BLOCK]
        m = tl.maximum(m, tl.max(tl.load(m_ptr + at, mask=live_r[:, None] & (c < splits)[None, :],
                                         other=float("-inf")), 1))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HD), tl.float32)
    for lo in range(0, splits, BLOCK):
        c = lo + tl.arange(0, BLOCK)
        at = (h * splits + c)[None, :] * rows + r[:, None]  # [ROWS, BLOCK]
        m_c = tl.load(m_ptr + at, mask=live_r[:, None] & (c < splits)[None, :], other=float("-inf"))
        w = tl.where(m_c == float("-inf"), 0.0, tl.exp(m_c - m_safe[:, None]))  # [ROWS, BLOCK]
        total += tl.sum(w * tl.load(l_ptr + at, mask=w > 0, other=0.0), 1)
        part = tl.load(acc_ptr + at[:, :, None] * HD + d[None, None, :], mask=(w > 0)[:, :, None],
                       other=0.0).to(tl.float32)
        acc += tl.sum(part * w[:, :, None], 1)
    t, j = r % new_tokens, r // new_tokens
    head = h * groups + j
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * HD + d[None, :],
             (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=live_r[:, None])
