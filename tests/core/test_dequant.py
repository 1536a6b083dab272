"""The torch path for GGUF's simple block formats gives exactly gguf's own numbers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from specmemo_core.storage import dequant


def random_blocks(kind: GGMLQuantizationType, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Raw bytes of a tensor of ``shape`` in ``kind``: random quants, finite random fp16 scales."""
    rng = np.random.default_rng(seed)
    per = dequant.BLOCK_BYTES[kind.name]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // dequant.BLOCK, per), dtype=np.uint8)
    halves = 2 if kind.name == "Q4_1" else 1  # scale, and Q4_1's minimum
    values = (rng.standard_normal((blocks.shape[0], halves)) * 0.05).astype(np.float16)
    blocks[:, : 2 * halves] = values.view(np.uint8).reshape(blocks.shape[0], 2 * halves)
    return blocks.reshape(quant_shape_to_byte_shape(shape, kind))


@pytest.mark.parametrize("name", sorted(dequant.BLOCK_BYTES))
@pytest.mark.parametrize("shape", [(3, 64), (7, 96), (1, 32)])
def test_block_formats_match_gguf_bit_for_bit(name: str, shape: tuple[int, int]) -> None:
    kind = GGMLQuantizationType[name]
    raw = random_blocks(kind, shape, seed=hash((name, shape)) % 1000)
    ours = dequant.dequantize_blocks(raw, name, shape)
    theirs = dequantize(raw, kind)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == shape
    assert np.array_equal(ours, theirs)


def test_other_formats_are_left_to_gguf() -> None:
    assert not dequant.supported("Q4_K") and not dequant.supported("Q6_K") and not dequant.supported("F16")
