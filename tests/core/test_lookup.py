import pytest
import torch

from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.errors import TreeError
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.lookup import lookup_candidates, lookup_draft
from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model


def _reference(seq: list[int], root: int, count: int, max_ngram: int = 3) -> list[int] | None:
    """The rule in plain Python: the longest (then latest) earlier match of the last
    1..max_ngram tokens of seq + [root]; what followed it, repeating with its period."""
    full = seq + [root]
    end = len(seq)  # the root's index
    best = None
    for n in range(max_ngram, 0, -1):
        if n > len(full):
            continue
        for p in range(end - 1, n - 2, -1):
            if full[p - n + 1:p + 1] == full[end - n + 1:end + 1]:
                best = p
                break
        if best is not None:
            break
    if best is None:
        return None
    period = end - best
    return [full[best + 1 + j % period] for j in range(count)]


def test_lookup_copies_what_followed_the_longest_latest_match():
    ids = torch.zeros(32, dtype=torch.long)
    seq = [5, 1, 2, 3, 9, 8, 7, 2, 3, 4, 6, 1]  # "2 3" twice; "1 2 3" once, earlier
    ids[: len(seq)] = torch.tensor(seq)
    # root 2 after "... 6 1": the suffix "1 2" matches at index 2 (length 2) → copy 3 9 8 7
    assert lookup_draft(ids, len(seq), 2, 4).tolist() == [3, 9, 8, 7]
    # root 3 after "... 2" (seq + [2] then root 3): longest match "1 2 3"? build it
    seq2 = seq + [2]
    ids[: len(seq2)] = torch.tensor(seq2)
    assert lookup_draft(ids, len(seq2), 3, 3).tolist() == [9, 8, 7]  # "1 2 3" (3 tokens) beats the later "2 3"


def test_lookup_repeats_a_loop_past_the_root():
    ids = torch.zeros(16, dtype=torch.long)
    seq = [4, 7, 1, 2, 1, 2, 1]
    ids[: len(seq)] = torch.tensor(seq)
    # root 2: the loop "1 2" continues 1 2 1 2 … beyond the committed tokens
    assert lookup_draft(ids, len(seq), 2, 5).tolist() == [1, 2, 1, 2, 1]


@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_the_plain_python_rule_on_random_sequences(seed):
    gen = torch.Generator().manual_seed(seed)
    capacity = 64
    for length in (1, 2, 5, 20, 63):
        ids = torch.randint(0, 4 + seed, (capacity,), generator=gen)  # slots past length: scratch
        root = int(torch.randint(0, 4 + seed, (1,), generator=gen))
        want = _reference(ids[:length].tolist(), root, 6)
        got = lookup_draft(ids, torch.tensor(length), torch.tensor(root), 6).tolist()
        if want is not None:
            assert got == want, (length, ids[:length].tolist(), root)
        assert len(got) == 6


def test_tree_names_with_a_lookup_chain():
    tree = load_tree("1-10-16-17+lookup-8")
    assert (tree.num_nodes, tree.depth, tree.width, tree.lookup) == (52, 3, 9, 8)
    buf = tree.buffers
    chain = list(range(44, 52))
    assert buf.retrieve_indices[-1].tolist() == [0] + chain
    assert buf.parents[44:].tolist() == [0] + chain[:-1]
    assert buf.depths[44:].tolist() == list(range(1, 9))
    # a chain node sees the root and the chain nodes before it, no head node
    assert buf.attn_mask[47].nonzero().flatten().tolist() == [0, 44, 45, 46, 47]
    assert buf.level_starts == load_tree("1-10-16-17").buffers.level_starts  # heads draft as before
    alone = load_tree("lookup-5")
    assert (alone.num_nodes, alone.paths, alone.depth) == (6, (), 0)
    with pytest.raises(TreeError, match="at most"):
        load_tree("medusa-64+lookup-200")


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("tree_name", ["lookup-6", "1-10-16-17+lookup-8", "chain-3+lookup-2"])
def test_greedy_with_a_lookup_chain_equals_plain_greedy(tree_name, static):
    """Exact output whatever the lookup copies, in both decoders; the tiny model's greedy
    output falls into a loop, which the chain must then accept many tokens at a time."""
    torch.set_num_threads(1)
    model = tiny_model(seed=11, vocab_size=16)
    prompt = torch.randint(0, 16, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    config = GenerationConfig(max_new_tokens=120)
    plain = [t for s in Decoder(model, model.new_cache(400)).generate(prompt, config) for t in s.token_ids]
    tree = load_tree(tree_name)
    heads = random_heads(4, 64, 16, seed=5, scale=0.5, kind="hydra") if tree.paths else None
    decoder = (StaticDecoder(model, new_static_cache(model, 400), heads, tree, graphs=True) if static
               else Decoder(model, model.new_cache(400), heads, tree))
    steps = list(decoder.generate(prompt, config))
    assert [t for s in steps for t in s.token_ids] == plain
    decode = [s for s in steps if not s.prefill]
    # plain would give 1 a step, random heads alone ~2; a loop fills most of the chain
    assert sum(s.accepted for s in decode) / len(decode) > 0.6 * (tree.lookup + 1)
    assert decoder.cache.ids[: decoder.cache.length].tolist() == decoder.history  # ids follow the cache


def test_candidates_are_drafts_that_disagree_on_their_first_token():
    """"7 8" was followed by 1 2 3 once and by 4 5 6 later; the sequence now ends in 7 and
    its root is 8: the first draft is the latest match's, the second the other's; where
    every match agrees, the second repeats the first."""
    seq = [9, 7, 8, 1, 2, 3, 0, 7, 8, 4, 5, 6, 0, 7]
    ids = torch.tensor(seq + [0] * 6)[None]
    out = lookup_candidates(ids, torch.tensor([len(seq)]), torch.tensor([8]), 3, chains=3)[0]
    assert out[0].tolist() == [4, 5, 6] == lookup_draft(ids[0], len(seq), 8, 3).tolist()
    assert out[1].tolist() == [1, 2, 3]
    assert out[2].tolist() == out[1].tolist()  # no third guess: it repeats the second
    agree = [9, 7, 8, 1, 2, 3, 0, 7, 8, 1, 2, 5, 0, 7]
    ids = torch.tensor(agree + [0] * 6)[None]
    out = lookup_candidates(ids, torch.tensor([len(agree)]), torch.tensor([8]), 3)[0]
    assert out[0].tolist() == [1, 2, 5] and out[1].tolist() == [1, 2, 5]
