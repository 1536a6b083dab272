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
    assert dequant.KINDS[kind.value] == name  # our ids are the format's
    raw = random_blocks(kind, shape, seed=sum(map(ord, name)) + shape[0])
    ours = dequant.dequantize_blocks(raw, kind.value, shape)
    theirs = dequantize(raw, kind)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == shape
    assert np.array_equal(ours, theirs)


def test_float32_is_read_as_it_is() -> None:
    values = np.random.default_rng(0).standard_normal((5, 32)).astype(np.float32)
    raw = values.view(np.uint8).reshape(-1)
    ours = dequant.dequantize_blocks(raw, GGMLQuantizationType.F32.value, (5, 32))
    assert np.array_equal(ours, values) and np.array_equal(ours, dequantize(raw.view(np.float32).reshape(5, 32),
                                                                          GGMLQuantizationType.F32))


def test_other_formats_are_left_to_gguf() -> None:
    for name in ("Q4_K", "Q6_K", "Q5_0", "F16", "BF16"):
        assert not dequant.supported(GGMLQuantizationType[name].value)
