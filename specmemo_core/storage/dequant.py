"""De-quantizing GGUF's simple block formats with whole-tensor torch operations.

``gguf``'s reader de-quantizes every format correctly, in numpy, a group of rows at a
time: 1.5 s of CPU for the default model's Q4_1 weights on a 2-core laptop, a quarter
of a later start. The simple formats (a block of 32 weights: one fp16 scale, an fp16
minimum for the ``_1`` kinds, then 4- or 8-bit integers) are a few tensor operations
over the whole tensor at once, twice as fast and bit-identical to ``gguf``'s results
(``tests/core/test_dequant.py``). Every other format (K-quants, Q5, I-quants) still
goes through ``gguf``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

BLOCK = 32  # weights per block in every format below
# GGML type ids (the GGUF file format's, as gguf.GGMLQuantizationType numbers them) → name
KINDS = {0: "F32", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
# format name → bytes per block (scale, [minimum], quants)
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def supported(kind: int) -> bool:
    """GGML type id ``kind`` is read here (without importing gguf: 0.3 s of a start)."""
    return kind in KINDS


def dequantize_blocks(raw: np.ndarray, kind: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``shape`` from the raw bytes (uint8) of a tensor of GGML type ``kind`` (``supported``)."""
    name = KINDS[kind]
    if name == "F32":
        return np.ascontiguousarray(raw).reshape(-1).view(np.float32).reshape(shape)  # a view of the file
    with warnings.catch_warnings():  # the file is mapped read-only, and nothing here writes to it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1)).view(-1, BLOCK_BYTES[name])  # [B, bytes]
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [B, 1]
    out = torch.empty(blocks.shape[0], BLOCK)  # [B, 32] float32, filled in place: one pass each
    if name == "Q8_0":
        out.copy_(blocks[:, 2:].contiguous().view(torch.int8))
        return out.mul_(scale).reshape(shape).numpy()
    nibbles = blocks[:, 4:] if name == "Q4_1" else blocks[:, 2:]  # [B, 16]: weight i low, i+16 high
    out[:, :16].copy_(nibbles & 0x0F)
    out[:, 16:].copy_(nibbles >> 4)
    if name == "Q4_1":
        minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [B, 1]
        return out.mul_(scale).add_(minimum).reshape(shape).numpy()
    return out.sub_(8.0).mul_(scale).reshape(shape).numpy()
