"""A GGUF's 4- and 8-bit blocks repacked for ``forward.c``: ``w = d * u + m`` per 32-element
block with ``u`` unsigned, ``lanes`` rows at a time (the kernel's vector width in 32-bit
lanes: 16 with AVX-512, else 8). For a group of ``lanes`` rows and one block, the bytes lie
as registers of ``lanes`` 4-byte lanes, lane ``l`` holding 4 consecutive elements of row
``l``; 4-bit blocks as 4 such registers whose low nibbles are elements 0-15 and high nibbles
16-31 (GGML's own nibble order). Rows are padded with zero weights to whole groups. Exact:
the same weights the file holds, only reordered.

- Q4_1 (``d``, ``m``, 16 bytes of nibbles): as they are.
- Q4_0 (``d``, nibbles ``q``, ``w = d * (q - 8)``): ``m = -8 d``.
- Q8_0 (``d``, signed bytes ``q``): ``u = q + 128``, ``m = -128 d``.
- Q4_K (super-blocks of 256: half floats ``d``, ``dmin``, 6-bit ``sc``, ``mn`` per 32, nibbles
  ``q``, ``w = d·sc·q − dmin·mn``): each 32 its own 4-bit block, ``d = d·sc``, ``m = −dmin·mn``
  rounded to half floats (within 2^-11 of each, the one change to the file's weights), its
  nibbles put in the order above.

``packed_bytes`` gives what any of them holds without packing it (the planner counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Q4_0, Q4_1, Q8_0, Q4_K = 2, 3, 8, 12  # GGML's type numbers
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, Q4_K: 144}
_BLOCK_WEIGHTS = {Q4_K: 256}  # the others: 32
SUPPORTED = frozenset(_BLOCK_BYTES)
NIBBLES = frozenset({Q4_0, Q4_1, Q4_K})  # held as 4-bit blocks; every other format as 8-bit ones


@dataclass
class PackedMatrix:
    """One matrix for ``forward.c``'s ``QMatrix``: ``rows`` × ``cols`` weights."""

    rows: int
    cols: int
    nibbles: bool
    lanes: int
    u: np.ndarray  # uint8 [groups, cols // 32, 4 or 8, lanes, 4]
    d: np.ndarray  # float16 [groups, cols // 32, lanes]
    m: np.ndarray  # float16 [groups, cols // 32, lanes]

    @property
    def nbytes(self) -> int:
        return self.u.nbytes + self.d.nbytes + self.m.nbytes


def packable(kind: int, cols: int) -> bool:
    return kind in SUPPORTED and cols % _BLOCK_WEIGHTS.get(kind, 32) == 0


def packed_bytes(kind: int, rows: int, cols: int, lanes: int) -> int:
    """The bytes ``pack`` (or ``from_float``, for a format it does not repack) holds a ``rows`` ×
    ``cols`` matrix of GGML type ``kind`` in: rows padded to groups of ``lanes``, each block of
    32 its 16 or 32 bytes and two half floats."""
    groups = -(-rows // lanes)
    return groups * lanes * (cols // 32) * ((16 if kind in NIBBLES else 32) + 4)


def _groups(a: np.ndarray, lanes: int) -> np.ndarray:
    """[rows, ...] padded with zeros to whole groups: [groups, lanes, ...]."""
    pad = -a.shape[0] % lanes
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
    return a.reshape(-1, lanes, *a.shape[1:])


def _scales(v: np.ndarray, lanes: int) -> np.ndarray:
    """[rows, nb] half floats -> [groups, nb, lanes]."""
    return np.ascontiguousarray(_groups(v.astype(np.float16), lanes).transpose(0, 2, 1))


def _registers(u: np.ndarray, lanes: int) -> np.ndarray:
    """[rows, nb, 16 or 32] bytes -> [groups, nb, 4 or 8, lanes, 4]."""
    rows, nb, n = u.shape
    g = _groups(u, lanes).reshape(-1, lanes, nb, n // 4, 4)
    return np.ascontiguousarray(g.transpose(0, 2, 3, 1, 4))


def pack(raw: np.ndarray, kind: int, rows: int, cols: int, lanes: int) -> PackedMatrix:
    """``raw``: the tensor's bytes as the file holds them, ``rows`` rows of ``cols // 32`` blocks
    (``cols // 256`` super-blocks for Q4_K)."""
    if kind == Q4_K:
        return _pack_q4_k(np.ascontiguousarray(raw).reshape(rows, cols // 256, _BLOCK_BYTES[Q4_K]), cols, lanes)
    nb = cols // 32
    blocks = np.ascontiguousarray(raw).reshape(rows, nb, _BLOCK_BYTES[kind])
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]  # half floats: m = -8 d and -128 d are exact too
    if kind == Q8_0:
        u = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return PackedMatrix(rows, cols, False, lanes, _registers(u, lanes), _scales(d, lanes),
                            _scales(-128.0 * d, lanes))
    if kind == Q4_1:
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
        nibbles = blocks[:, :, 4:]
    else:
        m = -8.0 * d
        nibbles = blocks[:, :, 2:]
    return PackedMatrix(rows, cols, True, lanes, _registers(nibbles, lanes), _scales(d, lanes), _scales(m, lanes))


def _pack_q4_k(blocks: np.ndarray, cols: int, lanes: int) -> PackedMatrix:
    """Q4_K super-blocks [rows, cols // 256, 144] as 4-bit blocks of 32 (module doc)."""
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [rows, S, 1]
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[..., 4:16]  # 8 six-bit scales and mins, packed in 12 bytes
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], -1)  # [rows, S, 8]
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    q = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 runs of 32 bytes: low nibbles one 32, high the next
    u = np.stack([q & 0x0F, q >> 4], axis=3).reshape(rows, cols // 32, 32)  # each 32's values, in order
    nibbles = (u[..., :16] | (u[..., 16:] << 4)).astype(np.uint8)  # element i and i + 16 share a byte
    scale = (d * sc).reshape(rows, cols // 32)
    least = (-dmin * mn).reshape(rows, cols // 32)
    return PackedMatrix(rows, cols, True, lanes, _registers(nibbles, lanes), _scales(scale, lanes),
                        _scales(least, lanes))


def from_float(w: np.ndarray, lanes: int) -> PackedMatrix:
    """A float32 [rows, cols] matrix as 8-bit blocks of 32: ``u = round((w - m) / d)`` with
    ``m`` the block's least weight and ``d`` its range / 255, both as half floats (for formats
    not repacked exactly: within d / 2 of each weight, and m's own rounding)."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32).astype(np.float32)
    m = blocks.min(-1).astype(np.float16)
    d = ((blocks.max(-1) - m.astype(np.float32)) / 255.0).astype(np.float16)
    safe = np.where(d > 0, d, 1.0).astype(np.float32)
    q = np.clip(np.rint((blocks - m[..., None].astype(np.float32)) / safe[..., None]), 0, 255).astype(np.uint8)
    return PackedMatrix(rows, cols, False, lanes, _registers(q, lanes), _scales(d, lanes), _scales(m, lanes))


def dequantize(p: PackedMatrix) -> np.ndarray:
    """The float32 [rows, cols] weights a packed matrix holds (for checks)."""
    g, nb, n, lanes, _ = p.u.shape
    regs = p.u.transpose(0, 3, 1, 2, 4).reshape(g * lanes, nb, n * 4)  # [rows, nb, 16 or 32] bytes
    if p.nibbles:
        regs = np.concatenate([regs & 0x0F, regs >> 4], axis=-1)  # elements 0-15, then 16-31
    d = p.d.transpose(0, 2, 1).reshape(g * lanes, nb, 1).astype(np.float32)
    m = p.m.transpose(0, 2, 1).reshape(g * lanes, nb, 1).astype(np.float32)
    return (d * regs.astype(np.float32) + m).reshape(g * lanes, p.cols)[:p.rows]
