"""The torch path for GGUF's simple block formats gives exactly gguf's own numbers."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specmemo_core.storage import dequant
from specmemo_core.tools.synthetic_gguf import random_blocks


@pytest.mark.parametrize("name", sorted(dequant.BLOCK_BYTES))
@pytest.mark.parametrize("shape", [(3, 64), (7, 96), (1, 32)])
def test_block_formats_match_gguf_bit_for_bit(name: str, shape: tuple[int, int]) -> None:
    kind = GGMLQuantizationType[name]
    assert dequant.KINDS[kind.value] == name  # our ids are the format's
    raw = random_blocks(name, shape, np.random.default_rng(sum(map(ord, name)) + shape[0]))
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
