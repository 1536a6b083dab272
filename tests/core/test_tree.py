"""Speculation tree structure, names, files and SpecMemo pruning."""

from __future__ import annotations

import json

import pytest
import torch

from specmemo_core.errors import TreeError
from specmemo_core.runtime.tree import (
    MAX_TREE_NODES,
    MEDUSA_64_PATHS,
    Tree,
    load_tree,
    specmemo_prune_rates,
    specmemo_pruned_tree,
    tree_from_level_counts,
    tree_name,
)


def long(rows):
    return torch.tensor(rows, dtype=torch.long)


def check_structure(tree: Tree) -> None:
    """Invariants every tree must satisfy, checked from first principles."""
    n = tree.num_nodes
    parents, depths, mask = tree.parents, tree.depths, tree.attn_mask
    assert parents.shape == depths.shape == (n,)
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    assert parents[0] == -1 and depths[0] == 0
    for i in range(1, n):
        assert 0 <= parents[i] < i  # parents precede children
        assert depths[i] == depths[parents[i]] + 1
        ancestors = {i}
        j = i
        while j != 0:
            j = int(parents[j])
            ancestors.add(j)
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == ancestors
    assert torch.equal(mask.sum(1), depths + 1)
    assert torch.equal(mask, torch.tril(mask))
    # nodes sorted by (depth, path)
    keys = [(len(p), p) for p in tree.paths]
    assert keys == sorted(keys)
    # retrieve rows: valid root-to-leaf chains, one per leaf
    has_child = set(parents[1:].tolist())
    leaves = [i for i in range(n) if i not in has_child]
    assert tree.leaf_count == len(leaves) == tree.retrieve_indices.shape[0]
    assert tree.retrieve_indices.shape[1] == tree.depth + 1
    seen = []
    for row in tree.retrieve_indices.tolist():
        chain = [x for x in row if x != -1]
        assert row[len(chain):] == [-1] * (len(row) - len(chain))
        assert chain[0] == 0
        for parent, child in zip(chain, chain[1:]):
            assert parents[child] == parent
        seen.append(chain[-1])
    assert seen == leaves
    for d in range(1, tree.depth + 1):
        at_d = depths == d
        assert torch.all(tree.head_index[at_d] == d - 1)
        assert int(tree.rank[at_d].max()) + 1 == tree.topk_needed[d - 1]


def test_small_tree_by_hand():
    tree = Tree.from_paths([(1, 0), (0,), (0, 1), (1,), (0, 0)], name="small")
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    assert tree.num_nodes == 6 and tree.depth == 2
    assert torch.equal(tree.parents, long([-1, 0, 0, 1, 1, 2]))
    assert torch.equal(tree.depths, long([0, 1, 1, 2, 2, 2]))
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.attn_mask, expected_mask)
    assert torch.equal(tree.head_index, long([-1, 0, 0, 1, 1, 1]))
    assert torch.equal(tree.rank, long([-1, 0, 1, 0, 1, 0]))
    assert torch.equal(tree.retrieve_indices, long([[0, 1, 3], [0, 1, 4], [0, 2, 5]]))
    assert tree.leaf_count == 3 and tree.topk_needed == (2, 2)
    assert tree_name(tree) == "1-2-3"
    check_structure(tree)


def test_unbalanced_tree_pads_retrieve_rows():
    tree = Tree.from_paths([[0], [1], [0, 0]])
    assert tree.name == "1-2-1"
    assert torch.equal(tree.retrieve_indices, long([[0, 2, -1], [0, 1, 3]]))
    check_structure(tree)


def test_single_and_chain():
    single = load_tree("single")
    assert single.num_nodes == 1 and single.depth == 0 and tree_name(single) == "1"
    assert torch.equal(single.retrieve_indices, long([[0]]))
    assert single.topk_needed == ()
    chain = load_tree("chain-3")
    assert chain.paths == ((0,), (0, 0), (0, 0, 0))
    assert torch.equal(chain.retrieve_indices, long([[0, 1, 2, 3]]))
    assert chain.topk_needed == (1, 1, 1)
    check_structure(chain)


def test_medusa_64():
    tree = load_tree("medusa-64")
    assert len(MEDUSA_64_PATHS) == 63
    assert tree.num_nodes == 64 and tree.depth == 4
    assert tree_name(tree) == "1-10-28-23-2"
    assert tree.topk_needed == (10, 10, 10, 2)
    paths = {tuple(p) for p in MEDUSA_64_PATHS}
    independent_leaves = sum(
        1 for p in paths if not any(len(q) == len(p) + 1 and q[:-1] == p for q in paths)
    )
    assert tree.leaf_count == independent_leaves == 42
    check_structure(tree)


def test_level_count_tree_1_10_16_17():
    tree = load_tree("1-10-16-17")
    assert tree.num_nodes == 44 and tree.level_counts == (1, 10, 16, 17)
    assert tree.name == "1-10-16-17" == tree_name(tree)
    check_structure(tree)
    index = {p: i + 1 for i, p in enumerate(tree.paths)}
    # depth 1: all ten ranks; depth 2: scores 1, 1/2, 1/3, ... down to 1/7
    assert [p for p in tree.paths if len(p) == 1] == [(r,) for r in range(10)]
    assert index[(0, 0)] == 11 and index[(0, 6)] == 17 and index[(6, 0)] == 26
    assert (0, 7) not in index and (1, 3) not in index  # score 1/8
    assert int(tree.parents[26]) == 7 and int(tree.rank[17]) == 6
    assert index[(0, 0, 0)] == 27 and int(tree.parents[27]) == 11
    last = tree.paths[-1]
    assert last == (4, 0, 0) and int(tree.parents[43]) == index[(4, 0)] == 24
    assert int(tree.head_index[43]) == 2 and int(tree.rank[43]) == 0
    assert tree.topk_needed == (10, 7, 6) and tree.leaf_count == 26


def test_level_counts_with_rank_scores():
    scores = [[0.6, 0.3, 0.1], [0.2, 0.7, 0.1]]  # head 2 prefers its rank 1
    tree = tree_from_level_counts([1, 2, 2], rank_scores=scores)
    assert tree.paths == ((0,), (1,), (0, 1), (1, 1))


@pytest.mark.parametrize(
    ("counts", "needle"),
    [([2, 10], "must start with 1"), ([1, 11], "1 to 10"), ([1, 2, 21], "1 to 20")],
)
def test_level_counts_errors(counts, needle):
    with pytest.raises(TreeError, match=needle):
        tree_from_level_counts(counts)


def test_from_paths_errors():
    with pytest.raises(TreeError, match=r"add path \[0, 1\]"):
        Tree.from_paths([[0], [0, 1, 2]])
    with pytest.raises(TreeError, match="listed twice"):
        Tree.from_paths([[0], [0]])
    with pytest.raises(TreeError, match="integers >= 0"):
        Tree.from_paths([[-1]])
    with pytest.raises(TreeError, match="integers >= 0"):
        Tree.from_paths([[0.5]])
    with pytest.raises(TreeError, match=f"at most {MAX_TREE_NODES}"):
        Tree.from_paths([[r] for r in range(MAX_TREE_NODES)])


def test_load_json_forms(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"paths": [[1, 0], [0], [1]]}))
    assert load_tree(f).paths == ((0,), (1,), (1, 0))
    f.write_text(json.dumps([[0], [0, 0]]))
    assert load_tree(str(f)).paths == ((0,), (0, 0))
    f.write_text(json.dumps({"parents": [-1, 0, 0, 2], "ranks": [0, 0, 3, 1]}))
    assert load_tree(f).paths == ((0,), (3,), (3, 1))
    f.write_text(json.dumps({"parents": [-1, 3, 0, 2]}))  # child listed before parent
    assert load_tree(f).paths == ((0,), (0, 0), (0, 0, 0))


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "cannot read it as JSON"),
        ('{"size": 3}', "expected a list of paths"),
        ("[[0], [0, 1, 1]]", r"add path \[0, 1\]"),
        ('[[0], ["a"]]', "integers >= 0"),
        ('{"parents": [-1, 2, 1]}', "cycle 1 -> 2 -> 1"),
        ('{"parents": [-1, 1]}', "node 1 is its own parent"),
        ('{"parents": [0, 0]}', "must start with -1"),
        (json.dumps({"parents": [-1] + [0] * 300}), f"at most {MAX_TREE_NODES}"),
        (json.dumps([[r] for r in range(300)]), f"at most {MAX_TREE_NODES}"),
    ],
)
def test_load_tree_file_errors(tmp_path, content, needle):
    f = tmp_path / "bad_tree.json"
    f.write_text(content)
    with pytest.raises(TreeError, match=needle) as info:
        load_tree(f)
    assert str(f) in str(info.value)


def test_load_tree_name_errors():
    with pytest.raises(TreeError, match=f"at most {MAX_TREE_NODES}"):
        load_tree("1-300")
    with pytest.raises(TreeError, match="1 to 50"):
        load_tree("1-5-51")
    with pytest.raises(TreeError, match="unknown tree 'medusa-65'.*medusa-64"):
        load_tree("medusa-65")
    with pytest.raises(TreeError, match="unknown tree"):
        load_tree("no/such/tree.json")


def test_prune_rates_match_paper_figure():
    assert specmemo_prune_rates(4) == pytest.approx([0.0, 0.9274, 0.9809, 0.9951], abs=1e-4)
    deeper = specmemo_prune_rates(6)
    assert deeper[:4] == specmemo_prune_rates(4)
    assert all(0 <= r <= 1 for r in deeper) and deeper == sorted(deeper)


def test_specmemo_pruned_tree():
    tree = specmemo_pruned_tree()
    assert tree.name == "1-10-7-1" and tree.level_counts == (1, 10, 7, 1)
    assert tree.paths[-1] == (0, 0, 0)
    check_structure(tree)
    trimmed = specmemo_pruned_tree(node_budget=15)
    assert trimmed.name == "1-10-4"
    assert [p for p in trimmed.paths if len(p) == 2] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert specmemo_pruned_tree(node_budget=1).name == "1"
    with pytest.raises(TreeError, match="at least 1"):
        specmemo_pruned_tree(node_budget=0)
