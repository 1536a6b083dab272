"""The batched KV cache on small cases worked out by hand: each row its own length, mask and commit."""

import pytest
import torch

from specmemo_core.errors import ContextFullError
from specmemo_core.runtime.batch_cache import BatchKVCache


def _cache(rows=3, capacity=8):
    cache = BatchKVCache(1, 1, 1, capacity, rows=rows)
    for row in range(rows - 1):  # the last row holds no sequence
        cache.open_row(row)
    return cache


def _write(cache, values):
    """A forward of values [B, T] at each row's scratch slots (keys = values, values = -values)."""
    cache.prepare(torch.arange(values.shape[1]))
    kv = values.float()[:, None, :, None]  # [B, kvh=1, T, hd=1]
    cache.write(0, kv, -kv)
    cache.write_ids(values)


def test_rows_commit_their_own_counts_and_a_free_row_never_grows():
    cache = _cache()
    _write(cache, torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
    cache.commit_prefix(3)
    assert cache.lengths.tolist() == [3, 3, 0] and cache.length_t.tolist() == [3, 3, 0]
    _write(cache, torch.tensor([[10, 11, 12], [13, 14, 15], [16, 17, 18]]))  # a 3-node tree per row
    cache.commit_row(torch.tensor([[0, 2, 0], [0, 1, 2], [0, 1, 2]]), torch.tensor([2, 3, 3]))
    cache.settle([2, 3, 3])
    assert cache.lengths.tolist() == [5, 6, 0] and cache.length_t.tolist() == [5, 6, 0]
    assert cache.ids[0, :5].tolist() == [1, 2, 3, 10, 12]  # root, then node 2
    assert cache.ids[1, :6].tolist() == [4, 5, 6, 13, 14, 15]
    assert cache.k[0, 0, 0, :5, 0].tolist() == [1.0, 2.0, 3.0, 10.0, 12.0]
    assert cache.v[0, 1, 0, :6, 0].tolist() == [-4.0, -5.0, -6.0, -13.0, -14.0, -15.0]


def test_each_row_is_masked_to_its_own_length_and_its_ancestors():
    cache = _cache()
    _write(cache, torch.tensor([[1, 2], [3, 4], [5, 6]]))
    cache.commit_row(None, torch.tensor([2, 1, 2]))
    cache.settle([2, 1, 2])
    ancestors = torch.tensor([[True, False], [True, True]])  # root, one child
    positions, mask = cache.prepare(torch.tensor([0, 1]), ancestors, span=5)
    assert positions.tolist() == [[2, 3], [1, 2], [0, 1]]
    assert mask.int().tolist() == [
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]],  # row 0: 2 committed, then its tree at slots 2, 3
        [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],  # row 1: 1 committed
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]],  # the free row stays at length 0
    ]


def test_a_leaving_row_is_replaced_by_the_last_one_and_room_is_checked_per_row():
    cache = _cache(rows=2, capacity=4)
    cache.open_row(1)
    _write(cache, torch.tensor([[1, 2, 3], [4, 5, 6]]))
    cache.commit_row(None, torch.tensor([1, 3]))
    cache.settle([1, 3])
    with pytest.raises(ContextFullError, match="batch slot"):
        cache.ensure_room(2)  # row 1: 3 + 2 > 4
    cache.move_row(1, 0)
    assert cache.lengths.tolist() == [3, 0] and cache.live_host.tolist() == [True, False]
    assert cache.ids[0, :3].tolist() == [4, 5, 6] and cache.length_t.tolist() == [3, 0]
    view = cache.rows_view(0, 1)
    view.close_row(0)
    assert cache.lengths.tolist() == [0, 0] and not cache.live_host.any()  # a view shares the rows
