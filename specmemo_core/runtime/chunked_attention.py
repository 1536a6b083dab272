"""Attention of a decoding step over a static cache, split into fixed chunks of slots (Triton).

Why not SDPA: a decoding step has few query rows (one per tree node and query head), and
every SDPA backend gives a key/value head one thread block that walks the whole span
alone: with 32 heads, 32 of an H200's 132 SMs read the cache and a 64-node tree's
attention took 0.92 ms a step (1.66 ms once the tree crosses into a 2,048-slot span)
against 0.38 for one token. Here the span is cut into chunks of ``SPLIT`` slots, each chunk
of each head is its own program (so a 1,000-slot context of 32 heads is 256 programs),
and a second kernel merges the chunks' partial softmaxes. Chunks past the live end of
the cache (``length + T``, read from the device, so one captured graph serves every
length up to its span) return at once: the cost follows the conversation, not the span.

Exactness: the chunks' boundaries are fixed slot numbers (not derived from the span or
the number of rows), so a row's scores are summed in the same order whatever else the
step scores beside it; in fp32 the dot products are IEEE (no TF32).

Shapes: as ``Attention.attend``: Hkv key/value heads, each with its ``groups`` query heads
stacked along the row axis (row j·T + t is query head kv·groups + j at token t), hd
the head dim, C the cache's capacity, S the span the bias covers.
"""

from __future__ import annotations

import functools
import os

import torch

from specmemo_core.planning.memory import ATTENTION_MAX_ROWS as MAX_ROWS
from specmemo_core.planning.memory import ATTENTION_SPLIT as SPLIT  # slots a program attends over:
# fixed, so sums keep their order for any span (the planner counts the workspace: memory.py)

CHUNK = 64  # slots scored at once inside a program (SPLIT / CHUNK iterations)
MERGE_BLOCK = 16  # chunks merged at once by the second kernel


@functools.cache
def _triton():
    """Triton and the two kernels, or None where Triton is not installed (CPU-only torch)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def attend_chunks(q_ptr, k_ptr, v_ptr, bias_ptr, length_ptr, m_ptr, l_ptr, acc_ptr,
                      rows, new_tokens, scale, stride_qh, stride_qr, stride_kh, stride_ks,
                      stride_vh, stride_vs, stride_br,
                      HD: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                      CHUNK: tl.constexpr, IEEE: tl.constexpr):
        """One program: SPLIT slots of one key/value head for BLOCK_M of its rows; writes
        the chunk's row maxima m, sums l and unnormalised outputs acc (fp32)."""
        c, h, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        splits = tl.num_programs(0)
        end = tl.load(length_ptr) + new_tokens  # slots [0, end) may be visible
        r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
        live_rows = r < rows
        out = (h * splits + c) * rows + r  # [BLOCK_M] into m, l: [Hkv, splits, rows]
        d = tl.arange(0, HD)
        start = c * SPLIT
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HD), tl.float32)
        if start < end:
            q = tl.load(q_ptr + h * stride_qh + r[:, None] * stride_qr + d[None, :],
                        mask=live_rows[:, None], other=0.0)  # [BLOCK_M, HD]
            for lo in range(start, start + SPLIT, CHUNK):
                s = lo + tl.arange(0, CHUNK)
                live = s < end
                k = tl.load(k_ptr + h * stride_kh + s[None, :] * stride_ks + d[:, None],
                            mask=live[None, :], other=0.0)  # [HD, CHUNK]
                if IEEE:
                    scores = tl.dot(q, k, input_precision="ieee")
                else:
                    scores = tl.dot(q, k)
                bias = tl.load(bias_ptr + r[:, None] * stride_br + s[None, :],
                               mask=live_rows[:, None] & live[None, :], other=float("-inf"))
                scores = scores * scale + bias.to(tl.float32)  # [BLOCK_M, CHUNK]
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(scores - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + h * stride_vh + s[:, None] * stride_vs + d[None, :],
                            mask=live[:, None], other=0.0)  # [CHUNK, HD]
                if IEEE:
                    pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        tl.store(m_ptr + out, m_i, mask=live_rows)
        tl.store(l_ptr + out, l_i, mask=live_rows)
        tl.store(acc_ptr + out[:, None] * HD + d[None, :], acc, mask=live_rows[:, None])

    @triton.jit
    def merge_chunks(m_ptr, l_ptr, acc_ptr, out_ptr, rows, new_tokens, groups, splits, stride_ot,
                     HD: tl.constexpr, BLOCK: tl.constexpr):
        """One program per (key/value head, row): the chunks' partial softmaxes as one,
        written at the row's token and query head of the [T, H·hd] output."""
        h, r = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, HD)
        m = tl.full((1,), float("-inf"), tl.float32)
        for lo in range(0, splits, BLOCK):
            c = lo + tl.arange(0, BLOCK)
            m = tl.maximum(m, tl.max(tl.load(m_ptr + (h * splits + c) * rows + r, mask=c < splits,
                                             other=float("-inf")), 0))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros((1,), tl.float32)
        acc = tl.zeros((HD,), tl.float32)
        for lo in range(0, splits, BLOCK):
            c = lo + tl.arange(0, BLOCK)
            at = (h * splits + c) * rows + r  # [BLOCK]
            m_c = tl.load(m_ptr + at, mask=c < splits, other=float("-inf"))
            w = tl.where(m_c == float("-inf"), 0.0, tl.exp(m_c - m_safe))  # [BLOCK]
            total += tl.sum(w * tl.load(l_ptr + at, mask=c < splits, other=0.0), 0)
            part = tl.load(acc_ptr + at[:, None] * HD + d[None, :], mask=(w > 0)[:, None], other=0.0)
            acc += tl.sum(part * w[:, None], 0)
        t, j = r % new_tokens, r // new_tokens
        head = h * groups + j
        tl.store(out_ptr + t * stride_ot + head * HD + d, (acc / total).to(out_ptr.dtype.element_ty))

    return triton, attend_chunks, merge_chunks


def supports(q: torch.Tensor, keys: torch.Tensor, cache_length: object) -> bool:
    """Whether ``attend`` runs this attention: an unbatched step of at most ``MAX_ROWS`` rows
    over a static cache (its length a tensor on the keys' device), a power-of-two head dim,
    on a CUDA device with Triton installed (or in Triton's interpreter, ``TRITON_INTERPRET=1``,
    which runs the same kernels on a CPU: the tests do)."""
    hd = q.shape[-1]
    return (q.dim() == 3 and q.shape[1] <= MAX_ROWS and isinstance(cache_length, torch.Tensor)
            and cache_length.device == keys.device and hd & (hd - 1) == 0 and 16 <= hd <= 256
            and keys.stride(-1) == 1 and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
            and _triton() is not None)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
           cache_length: torch.Tensor, *, new_tokens: int, groups: int) -> torch.Tensor:
    """Softmax attention of q [Hkv, groups·T, hd] over the cache's slots [Hkv, C, hd] up to
    ``cache_length + new_tokens`` (a [] device tensor) with the additive ``bias`` [groups·T, S]
    (S ≤ C: the step's span): the output [T, H·hd], laid out for ``o_proj``."""
    triton, attend_chunks, merge_chunks = _triton()
    hkv, rows, hd = q.shape
    span = bias.shape[-1]
    splits = triton.cdiv(span, SPLIT)
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    m = torch.empty(hkv, splits, rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(hkv, splits, rows, hd, dtype=torch.float32, device=q.device)
    attend_chunks[(splits, hkv, triton.cdiv(rows, block_m))](
        q, keys, values, bias, cache_length, m, l, acc, rows, new_tokens, hd ** -0.5,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        bias.stride(0), HD=hd, BLOCK_M=block_m, SPLIT=SPLIT, CHUNK=CHUNK, IEEE=q.dtype == torch.float32,
    )
    out = torch.empty(new_tokens, hkv * groups * hd, dtype=q.dtype, device=q.device)
    merge_chunks[(hkv, rows)](m, l, acc, out, rows, new_tokens, groups, splits, out.stride(0),
                              HD=hd, BLOCK=MERGE_BLOCK)
    return out
