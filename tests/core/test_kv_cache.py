import pytest
import torch

from specmemo_core.errors import ContextFullError
from specmemo_core.runtime.kv_cache import KVCache


def _filled(capacity=10):
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=capacity)
    for layer in range(2):
        vals = torch.arange(6, dtype=torch.float32).view(1, 6, 1).expand(1, 6, 2) + 100 * layer
        cache.write(layer, vals, -vals)
    return cache


def test_commit_moves_accepted_nodes_into_place():
    cache = _filled()
    cache.commit(torch.tensor([0, 2, 5]))  # root, then nodes 2 and 5 of the tree
    assert cache.length == 3
    assert cache.k[0, 0, :3, 0].tolist() == [0.0, 2.0, 5.0]
    assert cache.k[1, 0, :3, 0].tolist() == [100.0, 102.0, 105.0]
    assert cache.v[1, 0, :3, 1].tolist() == [-100.0, -102.0, -105.0]


def test_write_returns_prefix_and_new_entries():
    cache = _filled()
    cache.commit_prefix(2)
    k, v = cache.write(0, torch.full((1, 3, 2), 7.0), torch.full((1, 3, 2), 8.0))
    assert k.shape == (1, 5, 2) and k[0, :, 0].tolist() == [0.0, 1.0, 7.0, 7.0, 7.0]


def test_overflow_is_a_clear_error():
    cache = _filled(capacity=6)
    cache.commit_prefix(5)
    with pytest.raises(ContextFullError, match="only 6 were allocated"):
        cache.ensure_room(2)


def test_truncate_and_reset():
    cache = _filled()
    cache.commit_prefix(4)
    cache.truncate(2)
    assert cache.length == 2
    with pytest.raises(ValueError):
        cache.truncate(3)
    cache.reset()
    assert cache.length == 0
