"""A GGUF's 4- and 8-bit blocks repacked for ``forward.c``: each matrix row as pairs of
32-element blocks, ``w = d * u + m`` with ``u`` unsigned, the pair's bytes interleaved in
4-byte groups (block A, block B, A, B, …) so the dot product's 32-bit lanes alternate between
the two blocks. Exact: the same weights the file holds, only reordered.

- Q4_1 (``d``, ``m``, 16 bytes of nibbles): as they are.
- Q4_0 (``d``, nibbles ``q``, ``w = d * (q - 8)``): ``m = -8 d``.
- Q8_0 (``d``, signed bytes ``q``): ``u = q + 128``, ``m = -128 d``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML's type numbers
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
SUPPORTED = frozenset(_BLOCK_BYTES)

_J = np.arange(32)
_LANE = _J // 4
_BLOCK = _LANE % 2  # which block of the pair byte j of the packed nibbles comes from
_ELEMENT = (_LANE // 2) * 4 + _J % 4  # and which of its 16 nibble bytes
_J8 = np.arange(64)
_BLOCK8 = (_J8 // 4) % 2
_ELEMENT8 = ((_J8 // 4) // 2) * 4 + _J8 % 4  # element 0..31 of that block


@dataclass
class PackedMatrix:
    """One matrix for ``forward.c``'s ``QMatrix``: ``rows`` × ``cols`` weights."""

    rows: int
    cols: int
    nibbles: bool
    u: np.ndarray  # uint8 [rows, cols // 64, 32 or 64]
    d: np.ndarray  # float32 [rows, cols // 32]
    m: np.ndarray  # float32 [rows, cols // 32]

    @property
    def nbytes(self) -> int:
        return self.u.nbytes + self.d.nbytes + self.m.nbytes


def packable(kind: int, cols: int) -> bool:
    return kind in SUPPORTED and cols % 64 == 0


def pack(raw: np.ndarray, kind: int, rows: int, cols: int) -> PackedMatrix:
    """``raw``: the tensor's bytes as the file holds them, ``rows`` rows of ``cols // 32`` blocks."""
    nb = cols // 32
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, _BLOCK_BYTES[kind])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == Q8_0:
        q = blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128  # [rows, nb, 32]
        pairs = q.astype(np.uint8).reshape(rows, nb // 2, 2, 32)
        u = pairs[:, :, _BLOCK8, _ELEMENT8]
        return PackedMatrix(rows, cols, False, np.ascontiguousarray(u), d, -128.0 * d)
    if kind == Q4_1:
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = blocks[:, :, 4:]
    else:
        m = -8.0 * d
        nibbles = blocks[:, :, 2:]
    pairs = nibbles.reshape(rows, nb // 2, 2, 16)
    u = pairs[:, :, _BLOCK, _ELEMENT]
    return PackedMatrix(rows, cols, True, np.ascontiguousarray(u), d, np.ascontiguousarray(m))


def from_float(w: np.ndarray) -> PackedMatrix:
    """A float32 [rows, cols] matrix as 8-bit blocks of 32: ``u = round((w - m) / d)`` with
    ``m`` the block's least weight and ``d`` its range / 255 (for formats not repacked
    exactly: within d / 2 of each weight)."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32).astype(np.float32)
    m = blocks.min(-1)
    d = (blocks.max(-1) - m) / 255.0
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint((blocks - m[..., None]) / safe[..., None]), 0, 255).astype(np.uint8)
    pairs = q.reshape(rows, cols // 64, 2, 32)
    u = pairs[:, :, _BLOCK8, _ELEMENT8]
    return PackedMatrix(rows, cols, False, np.ascontiguousarray(u), d.astype(np.float32), m.astype(np.float32))


def dequantize(p: PackedMatrix) -> np.ndarray:
    """The float32 [rows, cols] weights a packed matrix holds (for checks)."""
    np_ = p.cols // 64
    if p.nibbles:
        lo, hi = p.u & 0x0F, p.u >> 4  # [rows, np, 32]
        u = np.zeros((p.rows, np_, 2, 32), np.float32)
        u[:, :, _BLOCK, _ELEMENT] = lo
        u[:, :, _BLOCK, _ELEMENT + 16] = hi
    else:
        u = np.zeros((p.rows, np_, 2, 32), np.float32)
        u[:, :, _BLOCK8, _ELEMENT8] = p.u
    u = u.reshape(p.rows, p.cols // 32, 32)
    return (p.d[..., None] * u + p.m[..., None]).reshape(p.rows, p.cols)
