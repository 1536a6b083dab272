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
import torch.nn.functional as F

from specmemo_core.planning.memory import ATTENTION_MAX_ROWS as MAX_ROWS
from specmemo_core.planning.memory import ATTENTION_SPLIT as SPLIT  # slots a program attends over:
# fixed, so sums keep their order for any span (the planner counts the workspace: memory.py)
from specmemo_core.runtime import kernel_probe

CHUNK = 64  # slots scored at once inside a program (SPLIT / CHUNK iterations)
MERGE_BLOCK = 16  # chunks merged at once by the second kernel
# rows a program of the second kernel merges (one number for every step, so a row's sums run in one
# order whatever rows its step has): on an H100 vicuna-7b's attention (32 layers) took 0.585 ms for a
# 64-node tree with 8 (0.600 with 4, 0.746 with one a program) and 0.385 for one token (0.408); the
# default model's 0.274 and 0.176 (0.295, 0.176). 16 rows of 64-wide heads broke Triton 3.6's compiler
MERGE_ROWS = 8
FAMILY, FALLBACK = "chunked attention", "attention runs through SDPA, slower for trees and grouped heads"
WARPS = 4  # warps a program of the first kernel
# stages of its slot loop's pipeline, by rows: 3 for a plain step's few, 2 for a tree's (on the
# H200 a 64-node tree's attention ran 0.90 -> 0.73 ms for 32 layers, a plain step's 0.357 -> 0.365
# with 2: docs/results/chunked_attention_h200/tuning/); the arithmetic is the same either way
STAGES_FEW_ROWS, STAGES_MANY_ROWS = 3, 2
# the largest head dim the kernels take (Llama's, Qwen's, Mistral's: 64 or 128): on an H100 an fp32
# step of 256-wide heads asked more shared memory than a block has (large_tiles_h100/FILES.md)
MAX_HEAD_DIM = 128


@functools.cache
def _kernels():
    """Triton and the two kernels, or None where Triton is not installed (CPU-only torch)."""
    try:
        import triton

        from specmemo_core.runtime.chunked_attention_kernels import attend_chunks, merge_chunks
    except ImportError:
        return None
    return triton, attend_chunks, merge_chunks


@functools.cache
def revision() -> str:
    """A short hash of this module's and its kernels' source (``kernel_probe.source_revision``)."""
    return kernel_probe.source_revision(__file__, "chunked_attention_kernels.py")


def supports(q: torch.Tensor, keys: torch.Tensor, cache_length: object) -> bool:
    """Whether ``attend`` runs this attention: an unbatched step (q [Hkv, rows, hd]) that ``fits``."""
    return q.dim() == 3 and fits(keys, cache_length, rows=q.shape[1], head_dim=q.shape[-1], device=q.device,
                                 dtype=q.dtype)


def fits(keys: torch.Tensor, cache_length: object, *, rows: int, head_dim: int, device: torch.device,
         dtype: torch.dtype) -> bool:
    """Whether ``attend`` runs an attention of ``rows`` query rows a key/value head in ``dtype``
    on ``device`` (asked without the queries: ``token_layer`` asks before it makes them): at
    most ``MAX_ROWS`` rows over a static cache (its length a tensor on the keys' device), a
    power-of-two head dim up to ``MAX_HEAD_DIM``, on a CUDA device with Triton installed (or in Triton's interpreter,
    ``TRITON_INTERPRET=1``, which runs the same kernels on a CPU: the tests do)."""
    on_gpu = device.type == "cuda"
    return (rows <= MAX_ROWS and isinstance(cache_length, torch.Tensor)
            and cache_length.device == keys.device and head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= MAX_HEAD_DIM
            and keys.stride(-1) == 1 and (on_gpu or os.environ.get("TRITON_INTERPRET") == "1")
            and _kernels() is not None
            and (not on_gpu or kernel_probe.runs_on(FAMILY, device, dtype, _probe)))


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels build and give SDPA's answer on ``device`` in ``dtype``
    (``kernel_probe``): ``attend`` on 2 key/value heads over 200 of 256 slots, for heads 64 and
    128 wide and 3 rows and 40 (the programs of a plain step and of a tree's, the tree's in blocks
    of 16, 32 and 64 rows: ``busy_rows`` picks by the GPU): the variants a model's steps build, so
    a GPU whose Triton cannot build one runs SDPA from the start instead of failing in a reply
    (Triton 3.6 could not build the merge's 16 rows of 64)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    worst = 0.0
    for hd in (64, 128):
        for rows, block_m in ((3, 16), (40, 16), (40, 32), (40, 64)):
            q, keys, values = (torch.randn(2, n, hd, generator=g).to(device, dtype) for n in (rows, 256, 256))
            bias = torch.zeros(rows, 256, device=device, dtype=dtype)
            bias[:, 200:] = float("-inf")
            try:
                got = attend(q, keys, values, bias, torch.tensor(200 - rows, device=device), new_tokens=rows,
                             groups=1, block_m=block_m)  # [rows, 2·hd]
            except Exception as e:  # noqa: BLE001 - any failure to build or launch means: use SDPA
                return kernel_probe.failed(FAMILY, device, e, FALLBACK)
            want = F.scaled_dot_product_attention(q[None], keys[None, :, :200], values[None, :, :200])[0]
            worst = max(worst, (got.float() - want.transpose(0, 1).reshape(rows, 2 * hd).float()).abs().max().item())
    return worst < 0.05 or kernel_probe.wrong(FAMILY, device, worst, FALLBACK)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
           cache_length: torch.Tensor, *, new_tokens: int, groups: int, split: int = SPLIT,
           warps: int = WARPS, stages: int | None = None,
           tail_bias: bool = True, pdl: tuple[int, int] = (0, 0), merge_rows: int | None = None,
           block_m: int = 0, partials: torch.dtype = torch.float32) -> torch.Tensor:
    """Softmax attention of q [Hkv, groups·T, hd] over the cache's slots [Hkv, C, hd] up to
    ``cache_length + new_tokens`` (a [] device tensor) with the additive ``bias`` [groups·T, S]
    (S ≤ C: the step's span): the output [T, H·hd], laid out for ``o_proj``. ``split``: slots
    a program attends over, a multiple of ``CHUNK``; ``warps``, ``stages``: the first kernel's
    launch (``stages`` None: by the rows, as ``STAGES_*`` say; given only to time the choice:
    ``scripts/time_step_parts.py``). ``tail_bias``: the bias is read only at slots from the
    cache's length on (every row sees the committed slots before it, as ``StaticKVCache.prepare``
    masks them); False reads it at every slot (only to time the difference). ``pdl``: the two
    kernels' programmatic dependent launch (``chunked_attention_kernels.dependent_launch``: 0
    none, 1 wait then let the next start, 2 let it start then wait; ``token_layer``'s steps).
    ``merge_rows``: rows a program of the merge takes (a power of two; None: ``MERGE_ROWS``).
    ``block_m``: rows a program of the first kernel scores at most (16, 32 or 64; 0: ``busy_rows``).
    ``partials``: the dtype of the chunks' unnormalised outputs between the two kernels (their maxima
    and sums stay fp32)."""
    triton, attend_chunks, merge_chunks = _kernels()
    hkv, rows, hd = q.shape
    span = bias.shape[-1]
    splits = triton.cdiv(span, split)
    block_m = block_rows(rows, block_m or busy_rows(rows, splits * hkv, kernel_probe.processors(q.device)))
    if stages is None:
        stages = STAGES_FEW_ROWS if rows <= 16 else STAGES_MANY_ROWS
    stages = fitting_stages(stages, block_m=block_m, head_dim=hd, element_size=q.element_size(),
                            shared_bytes=kernel_probe.shared_bytes(q.device))
    m = torch.empty(hkv, splits, rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(hkv, splits, rows, hd, dtype=partials, device=q.device)
    attend_chunks[(splits, hkv, triton.cdiv(rows, block_m))](
        q, keys, values, bias, cache_length, m, l, acc, rows, new_tokens, hd ** -0.5,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        bias.stride(0), HD=hd, BLOCK_M=block_m, SPLIT=split, CHUNK=CHUNK, IEEE=q.dtype == torch.float32,
        TAIL_BIAS=tail_bias, PDL=pdl[0], num_warps=warps, num_stages=stages, **pdl_option(pdl[0] > 0),
    )
    out = torch.empty(new_tokens, hkv * groups * hd, dtype=q.dtype, device=q.device)
    merge_rows = merge_rows or MERGE_ROWS
    merge_chunks[(hkv, triton.cdiv(rows, merge_rows))](
        m, l, acc, out, rows, new_tokens, groups, splits, out.stride(0), HD=hd, BLOCK=MERGE_BLOCK, ROWS=merge_rows,
        PDL=pdl[1], **pdl_option(pdl[1] > 0))
    return out


def busy_rows(rows: int, blocks: int, processors: int) -> int:
    """The most rows a program of ``attend``'s first kernel scores, for ``rows`` a key/value head
    and ``blocks`` (chunks × heads) on a GPU of ``processors`` SMs: the widest block (64, 32, 16)
    whose programs fill every SM, else 16 (0 processors, the interpreter: 64). Few heads' trees
    run few programs: on an H100 the default model's (3 heads) 20-node tree step took 1.068 ms with
    16 rows a program against 1.153 with 64 (96 programs against 24), its 64-node one 1.030 with 32
    (144) against 1.058 and 1.040 with 16; vicuna-7b's (32 heads, 256 programs of 64) 6.729 against
    6.777 with 32 and 6.742 with 16 (``docs/results/large_tiles_h100/busy_rows/``)."""
    if not processors:
        return 64
    return next((most for most in (64, 32) if blocks * -(-rows // most) >= processors), 16)


def block_rows(rows: int, most: int) -> int:
    """Rows a program of ``attend``'s first kernel scores: the tensor cores' least (16) up to ``most``
    (16, 32 or 64), as few blocks as hold ``rows`` within that."""
    return 16 if rows <= 16 or most == 16 else (32 if rows <= 32 or most == 32 else 64)


def fitting_stages(stages: int, *, block_m: int, head_dim: int, element_size: int, shared_bytes: int) -> int:
    """The most of ``stages`` whose keys and values ([CHUNK, hd] each a stage) fit ``shared_bytes``
    beside a program's queries [block_m, hd] and probabilities [block_m, CHUNK]
    (``kernel_probe.fitting_stages``), counting every stage (Triton may keep one fewer: a bound,
    not the figure): a plain step of 128-wide 16-bit heads counts ~100 KB with 3, about what most
    laptop GPUs give a block, and takes 2 there (on the H200 a plain step's attention ran 0.357 ms
    with 3, 0.365 with 2)."""
    fixed = block_m * (head_dim + CHUNK) * element_size
    return kernel_probe.fitting_stages(stages, stage_bytes=2 * CHUNK * head_dim * element_size,
                                       shared_bytes=shared_bytes - fixed)


def pdl_option(pdl: bool) -> dict[str, bool]:
    """A Triton launch's programmatic dependent launch option, given only when on (a Triton
    without it takes no such option): these kernels' and ``token_layer``'s."""
    return {"launch_pdl": True} if pdl else {}
