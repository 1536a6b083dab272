import json

import pytest
import torch
from safetensors.torch import save_file

from specmemo_core.errors import HeadsError
from specmemo_core.runtime.heads import HeadsSpec, MedusaHeads, chunked_topk, load_heads, random_heads, save_heads


def test_each_head_owns_its_parameters():
    heads = MedusaHeads(HeadsSpec("medusa", 3, 2, 16, 50, False))
    ptrs = [p.data_ptr() for p in heads.parameters()]
    assert len(ptrs) == len(set(ptrs)) == 3 * 2 * 2


def test_untrained_head_copies_the_base_lm_head():
    heads = MedusaHeads(HeadsSpec("medusa", 2, 1, 16, 50, False))
    lm = torch.nn.Linear(16, 50, bias=False)
    x = torch.randn(16)
    assert torch.allclose(heads.logits(x, lm)[1], lm(x), atol=1e-6)
    assert torch.equal(heads.hidden(x)[1], x)


def test_round_trip_and_identity(tmp_path):
    heads = random_heads(4, 16, 50, seed=3, base_name="m", base_fingerprint="abc")
    path = save_heads(heads, tmp_path / "h")
    loaded = load_heads(path.parent, 16, 50, base_fingerprint="abc")
    for (k, a), (k2, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    with pytest.raises(HeadsError, match="made for another model"):
        load_heads(path, 16, 50, base_fingerprint="zzz")
    with pytest.raises(HeadsError, match="hidden size 16"):
        load_heads(path, 32, 50)


def _medusa_folder(tmp_path, heads=2, layers=1, hidden=16, vocab=50):
    tensors = {}
    for h in range(heads):
        for b in range(layers):
            tensors[f"{h}.{b}.linear.weight"] = torch.randn(hidden, hidden)
            tensors[f"{h}.{b}.linear.bias"] = torch.randn(hidden)
        tensors[f"{h}.{layers}.weight"] = torch.randn(vocab, hidden)
    (tmp_path / "config.json").write_text(json.dumps(
        {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": "x"}))
    return tensors


def test_medusa_format_safetensors_and_pt(tmp_path):
    tensors = _medusa_folder(tmp_path)
    save_file(tensors, str(tmp_path / "medusa_lm_head.safetensors"))
    heads = load_heads(tmp_path, 16, 50)
    assert heads.spec.own_lm_heads and heads.num_heads == 2
    assert torch.equal(heads.lm_heads[1].weight, tensors["1.1.weight"])
    (tmp_path / "medusa_lm_head.safetensors").unlink()
    torch.save(tensors, tmp_path / "medusa_lm_head.pt")
    assert torch.equal(load_heads(tmp_path, 16, 50).blocks[0][0].linear.bias, tensors["0.0.linear.bias"])


class _Evil:
    def __reduce__(self):
        return (open, ("/tmp/specmemo-pwned", "w"))


def test_pickled_code_is_refused_not_run(tmp_path):
    import os
    _medusa_folder(tmp_path)
    torch.save({"0.0.linear.weight": _Evil()}, tmp_path / "medusa_lm_head.pt")
    if os.path.exists("/tmp/specmemo-pwned"):
        os.remove("/tmp/specmemo-pwned")
    with pytest.raises(HeadsError, match="pickled code is never executed"):
        load_heads(tmp_path, 16, 50)
    assert not os.path.exists("/tmp/specmemo-pwned")


def test_not_a_heads_file(tmp_path):
    bad = tmp_path / "heads.safetensors"
    bad.write_bytes(b"not safetensors at all")
    with pytest.raises(HeadsError, match="unreadable heads file"):
        load_heads(tmp_path, 16, 50)
    with pytest.raises(HeadsError, match="heads not found"):
        load_heads(tmp_path / "missing", 16, 50)


@pytest.mark.parametrize("context_next", [False, True])
def test_context_layer_round_trip(tmp_path, context_next):
    heads = random_heads(2, 16, 50, seed=4, kind="hydra", context=(16, 2, 1, 8), base_fingerprint="abc",
                         context_next=context_next)
    loaded = load_heads(save_heads(heads, tmp_path / "h"), 16, 50, base_fingerprint="abc")
    assert loaded.spec == heads.spec and loaded.context is not None
    for (name, a), (_, b) in zip(heads.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_context_layer_needs_hydra_and_an_attention_shape():
    with pytest.raises(HeadsError, match="context layer"):
        HeadsSpec("medusa", 2, 1, 16, 50, False, context_mlp=16, context_heads=2, context_kv_heads=1,
                  context_head_dim=8)
    with pytest.raises(HeadsError, match="context layer"):
        HeadsSpec("hydra", 2, 1, 16, 50, False, context_mlp=16)
    with pytest.raises(HeadsError, match="give the heads a context layer"):
        HeadsSpec("hydra", 2, 1, 16, 50, False, context_next=True)


def _with_draft_vocab(ids: list[int], vocab: int = 300):
    from specmemo_core.runtime.heads import new_heads

    base = random_heads(4, 64, vocab, seed=5, scale=0.5, kind="hydra")
    spec = HeadsSpec("hydra", 4, 1, 64, vocab, False, draft_vocab=len(ids))
    heads = new_heads(spec)
    heads.load_state_dict({**base.state_dict(), "vocab_ids": torch.tensor(ids)})
    return heads


def test_random_heads_draft_among_distinct_random_tokens():
    heads = random_heads(4, 64, 300, kind="hydra", draft_vocab=40)
    ids = heads.vocab_ids.tolist()
    assert len(set(ids)) == 40 and ids == sorted(ids) and ids[-1] < 300 and ids != list(range(40))
    lm_head = torch.randn(300, 64)
    heads.use_draft_vocab(lm_head)
    assert torch.equal(heads.vocab_head.weight, lm_head[ids])


def test_draft_vocab_round_trip_and_limits(tmp_path):
    heads = _with_draft_vocab([7, 3, 250, 11])
    save_heads(heads, tmp_path / "h")
    back = load_heads(tmp_path / "h", 64, 300)
    assert back.spec.draft_vocab == 4 and back.vocab_ids.tolist() == [7, 3, 250, 11]
    with pytest.raises(HeadsError, match="drafting vocabulary"):
        HeadsSpec("medusa", 4, 1, 64, 300, False, draft_vocab=8)
    with pytest.raises(HeadsError, match="drafting vocabulary"):
        HeadsSpec("hydra", 4, 1, 64, 300, False, draft_vocab=301)
    save_heads(_with_draft_vocab([7, 3, 299, 300 + 5]), tmp_path / "bad")
    with pytest.raises(HeadsError, match="outside the model's vocabulary"):
        load_heads(tmp_path / "bad", 64, 300)


def test_drafts_stay_in_the_vocabulary_and_decoding_stays_exact():
    """Heads drafting through a vocabulary cut propose only its tokens; greedy output is
    still plain greedy's, token for token (the base model verifies everything)."""
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.tree import load_tree
    from tests.tiny import tiny_model

    torch.set_num_threads(1)
    model = tiny_model(seed=7)
    prompt = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = [t for s in Decoder(model, model.new_cache(400)).generate(prompt, GenerationConfig(max_new_tokens=60))
             for t in s.token_ids]
    allowed = sorted(set(plain))[:40] + list(range(0, 300, 7))  # some of the right tokens, many others
    heads = _with_draft_vocab(sorted(set(allowed)))
    heads.use_draft_vocab(model.lm_head.weight)
    tree = load_tree("1-10-16-17")
    drafted = heads.draft(torch.randn(64), 5, tree.buffers, model.model.embed_tokens, model.lm_head)
    assert set(drafted[1:].tolist()) <= set(allowed)
    decoder = Decoder(model, model.new_cache(400), heads, tree)
    steps = list(decoder.generate(prompt, GenerationConfig(max_new_tokens=60)))
    assert [t for s in steps for t in s.token_ids] == plain
    assert max(s.accepted for s in steps) > 1


@pytest.mark.parametrize("shape, k, chunk", [((8, 8192), 8, 512), ((3, 4, 49152), 10, 1024), ((1, 8192), 8, 256),
                                              ((2, 1000), 3, 512), ((2, 1024), 600, 512)])
def test_chunked_topk_is_topk(shape, k, chunk):
    """The two-stage drafting top-k (a GPU's, run here on the CPU) gives torch.topk's values
    and indices, best first, for rows a chunk divides and for rows it leaves whole."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(k))
    want = x.topk(k, dim=-1)
    values, indices = chunked_topk(x, k, chunk=chunk)
    assert torch.equal(values, want.values)
    assert torch.equal(indices, want.indices)
