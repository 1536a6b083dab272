"""The step's glue kernels (``runtime/step_kernels.py``) against the torch ops they stand for
(``SPECMEMO_STEP_KERNELS=0`` runs those): on the GPU where there is one, else in Triton's
interpreter on the CPU, in a process of their own."""

import pytest
import torch

from specmemo_core.runtime import step_kernels
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import draft_topk, random_heads
from specmemo_core.runtime.lookup import lookup_draft
from specmemo_core.runtime.model import attention_bias, rope_tables
from specmemo_core.runtime.model import step_tables as model_step_tables
from specmemo_core.runtime.split import LayerSplit, split_model
from specmemo_core.runtime.split_cache import SplitCache
from specmemo_core.runtime.static_decoding import StaticDecoder, StaticKVCache, new_static_cache
from specmemo_core.runtime.step import GreedyAcceptance, Verified, accepted_path
from specmemo_core.runtime.tree import load_tree
from tests.tiny import tiny_model
from tests.triton_kernels import DEVICE, assert_probe_falls_back, elsewhere, kernels, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed (a CPU-only torch): the GPU kernels cannot be run")


@elsewhere
def test_in_tritons_interpreter():
    run_in_interpreter(__file__, passed=26)


@elsewhere
def test_where_the_kernels_cannot_run_the_probe_says_why_and_torch_stays(caplog):
    assert_probe_falls_back(step_kernels._probe, caplog, says=("decoding-step glue kernels unavailable", "torch ops"))


@elsewhere
def test_where_the_tables_kernel_cannot_run_its_probe_says_why(caplog):
    assert_probe_falls_back(step_kernels._probe_tables, caplog, says=("rotary tables and bias kernel unavailable",
                                                                      "the tables are torch ops"))


@kernels
def test_the_probe_passes_where_the_kernels_run():
    assert step_kernels._probe(torch.device(DEVICE), torch.long) is True
    assert step_kernels._probe_tables(torch.device(DEVICE), torch.float32) is True


def _accept(model, tokens, hidden, buf, monkeypatch, on: bool):
    monkeypatch.setenv("SPECMEMO_STEP_KERNELS", "1" if on else "0")
    accepted = GreedyAcceptance().accept(model, Verified(tokens, hidden), buf)
    assert (accepted.path is not None) == on
    return (accepted.nodes, accepted.count, *accepted_path(Verified(tokens, hidden), accepted))


@kernels
@pytest.mark.parametrize("tree_name,rows,per_row", [
    ("medusa-64", 0, False), ("1-10-16-17+lookup-8", 0, False), ("1-3-2", 3, False), ("medusa-64", 4, True)])
def test_the_greedy_path_kernel_accepts_as_the_torch_ops(tree_name, rows, per_row, monkeypatch):
    """Random trees' drafts, most a copy of their parent's pick (long paths accepted, ties
    between paths): the accepted nodes, count, emitted tokens, bonus, last node and path
    hidden states as the torch ops give them; one sequence, a batch sharing the tree, a batch
    with a tree per row (``retrieve_indices`` [B, L, W], as grown trees have)."""
    model = tiny_model(seed=2, vocab_size=16, device=DEVICE)
    buf = load_tree(tree_name).buffers.to(DEVICE)
    n, g = buf.depths.shape[0], torch.Generator().manual_seed(len(tree_name) + rows)
    lead = (rows,) if rows else ()
    if per_row:  # each row its own order of the same paths: ties go to another path
        order = torch.stack([torch.randperm(buf.retrieve_indices.shape[0], generator=g) for _ in range(rows)])
        buf = type(buf)(**{**vars(buf), "retrieve_indices": buf.retrieve_indices[order.to(DEVICE)]})
    for trial in range(4):
        hidden = torch.randn(*lead, n, 64, generator=g).to(DEVICE)
        picks = model.greedy_picks(hidden)
        parents = buf.parents.clamp(min=0)
        copy = torch.rand(*lead, n, generator=g).to(DEVICE) < 0.8
        tokens = torch.where(copy, picks[..., parents], torch.randint(0, 16, (*lead, n), generator=g).to(DEVICE))
        got = _accept(model, tokens, hidden, buf, monkeypatch, on=True)
        want = _accept(model, tokens, hidden, buf, monkeypatch, on=False)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert int(want[1].max()) > 2  # some paths accepted far


@kernels
def test_the_move_kernel_commits_as_index_copy(monkeypatch):
    """A static cache's accepted entries (keys, values and token ids of every layer) move to the
    committed slots as the index_select and index_copy did, and its device length grows."""
    caches = []
    for on in (True, False):
        monkeypatch.setenv("SPECMEMO_STEP_KERNELS", "1" if on else "0")
        cache = StaticKVCache(3, 2, 24, 64, torch.float32, DEVICE)
        g = torch.Generator().manual_seed(1)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g))
        cache.ids.copy_(torch.randint(0, 99, (64,), generator=g))
        cache.commit_prefix(10)
        for nodes, count in (([0, 2, 3, 7, 0], 4), ([0, 1, 2, 3, 4], 5), ([0, 5, 0, 0, 0], 2)):
            cache.commit_row(torch.tensor(nodes, device=DEVICE), torch.tensor(count, device=DEVICE))
            cache.settle(count)
        caches.append(cache)
    for a, b in zip((caches[0].k, caches[0].v, caches[0].ids), (caches[1].k, caches[1].v, caches[1].ids)):
        assert torch.equal(a, b)
    assert int(caches[0].length_t) == caches[0].length == 21


@kernels
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else []))  # Triton's
@pytest.mark.parametrize("lead", [(1,), (3,), (70,), (2, 5)])  # interpreter sums bf16 tiles wrong (3.9: ~1e10 off)
def test_the_picks_kernel_gives_the_heads_argmax(lead, dtype, monkeypatch):
    """Hidden states and a head of -1, 0 and 1 (every logit an exact integer in fp32 and bf16:
    many ties), 1,000 rows (not a whole number of blocks), 96 columns: the same rows as
    argmax over the exact logits (ties to the lowest), beyond 64 tokens and for a batch; and
    ``CausalLM.greedy_picks`` through it gives what its blocks of matmuls give."""
    g = torch.Generator().manual_seed(sum(lead))
    hidden = torch.randint(-1, 2, (*lead, 96), generator=g).to(DEVICE, dtype)
    weight = torch.randint(-1, 2, (1000, 96), generator=g).to(DEVICE, dtype)
    weight[999] = weight[998] = hidden.reshape(-1, 96)[0]  # the first token's best: a tie at the last rows
    want = (hidden.double() @ weight.double().T).argmax(-1)
    assert step_kernels.takes_picks(hidden, weight)
    assert torch.equal(step_kernels.greedy_picks(hidden, weight), want)
    assert int(want.reshape(-1)[0]) == 998
    model = tiny_model(seed=3, vocab_size=300, device=DEVICE)
    states = torch.randn(*lead, 64, generator=g).to(DEVICE)
    monkeypatch.setenv("SPECMEMO_PICK_KERNEL", "0")
    assert not step_kernels.takes_picks(states, model.lm_head.weight)
    blocks = model.greedy_picks(states, rows=128)
    monkeypatch.setenv("SPECMEMO_PICK_KERNEL", "1")
    assert torch.equal(model.greedy_picks(states, rows=128), blocks)


@kernels
@pytest.mark.parametrize("cols,k,dtype", [(5000, 10, torch.float32), (8192, 3, torch.bfloat16)])
def test_the_top_k_kernel_gives_torchs_top_k(cols, k, dtype):
    """Distinct largest values: the same indices and values in the same order as torch.topk,
    through a drafting vocabulary's ids, and log-probabilities as log_softmax gives them; equal
    values by their lowest index first."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(3, cols, generator=g).clamp(max=2.0)
    for row in x:  # the k largest at random places, 0.25 apart (distinct in bf16 too)
        row[torch.randperm(cols, generator=g)[:k]] = 3.0 + 0.25 * torch.arange(k).float()
    x = x.to(DEVICE, dtype)
    ids = torch.randperm(60000, generator=g)[:cols].to(DEVICE)
    assert step_kernels.takes_top_k(x, k)
    values, index = step_kernels.top_k(x, k, ids=ids)
    want = x.float().topk(k, dim=-1)
    assert torch.equal(index, ids[want.indices]) and torch.equal(values, want.values)
    scores, _ = draft_topk(x, k, 512, log_softmax=True)
    assert (scores - torch.log_softmax(x.float(), -1).topk(k, dim=-1).values).abs().max().item() < 1e-5
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=DEVICE, dtype=dtype)
    assert step_kernels.top_k(ties, 4)[1].tolist() == [[1, 2, 4, 0]]


@kernels
@pytest.mark.parametrize("tree_name,dtype,draft_vocab", [
    ("medusa-64", torch.float32, 200), ("1-3-2+lookup-3", torch.float32, 0)]
    + ([("medusa-64", torch.bfloat16, 200)] if DEVICE == "cuda" else []))  # the interpreter's bf16 sums: see above
def test_the_draft_kernels_draft_the_torch_levels(tree_name, dtype, draft_vocab, monkeypatch):
    """Hydra heads drafting one sequence's static tree (four levels, up to 30 nodes a level;
    through a drafting vocabulary and through the whole LM head): the heads' states, each
    level's gathers, matmul, SiLU and residual in one kernel and the top-k written into the
    children's tokens, draft every node's token as the torch ops do; a batch keeps the torch ops."""
    model = tiny_model(seed=4, vocab_size=300, device=DEVICE).to(dtype)
    heads = random_heads(4, 64, 300, seed=6, scale=0.5, kind="hydra", draft_vocab=draft_vocab).to(DEVICE, dtype)
    heads.use_draft_vocab(model.lm_head.weight)
    buf = load_tree(tree_name).buffers.to(DEVICE)
    embed, heads_nodes = model.draft_embedding(), buf.depths.shape[0] - buf.lookup
    g = torch.Generator().manual_seed(7)
    for trial in range(3):
        hidden = torch.randn(64, generator=g).to(DEVICE, dtype)
        root = torch.tensor(trial + 3, device=DEVICE)
        monkeypatch.setenv("SPECMEMO_STEP_KERNELS", "1")
        assert heads._drafts_in_kernels(hidden, buf, embed)
        got = heads.draft(hidden, root, buf, embed, model.lm_head)[:heads_nodes]
        monkeypatch.setenv("SPECMEMO_STEP_KERNELS", "0")
        want = heads.draft(hidden, root, buf, embed, model.lm_head)[:heads_nodes]
        if dtype == torch.float32:
            assert torch.equal(got, want), (got, want)
        else:  # the states' sums run in another order: equal bf16 logits may swap siblings (H100: 5 of 64)
            assert (got == want).float().mean().item() >= 0.75, (got, want)
    monkeypatch.setenv("SPECMEMO_STEP_KERNELS", "1")
    assert not heads._drafts_in_kernels(hidden[None].expand(2, 64), buf, embed)
    assert len(set(want.tolist())) > heads_nodes // 4  # the levels drafted many distinct tokens


@kernels
@pytest.mark.parametrize("half,tokens,span,groups,dtype,scale", [
    (32, 64, 1024, 3, torch.float32, 1.0), (64, 5, 300, 1, torch.bfloat16, 0.5), (16, 1, 128, 4, torch.float32, 1.0)])
def test_the_tables_kernel_gives_the_rotary_tables_and_bias(half, tokens, span, groups, dtype, scale):
    """Positions up to 30,000 (large angles), a random mask: the rotary tables as ``rope_tables``
    gives them (on a GPU the same bits: CUDA's cosine and sine, as torch's; the interpreter's are
    numpy's, an ulp apart at some angles) and the bias exactly as ``attention_bias``, repeated
    for each group; ``CausalLM.forward`` takes it for a step of one sequence."""
    g = torch.Generator().manual_seed(half + tokens)
    inv = (1.0 / (10000 ** (torch.arange(half).float() / half))).to(DEVICE)
    positions = torch.randint(0, 30000, (tokens,), generator=g).to(DEVICE)
    mask = (torch.rand(tokens, span, generator=g) < 0.7).to(DEVICE)
    spec = tiny_model(seed=1, vocab_size=16, device="cpu").spec
    spec = type(spec)(**{**vars(spec), "num_heads": groups * 2, "num_kv_heads": 2})
    assert step_kernels.takes_tables(positions, mask, inv)
    cos, sin, bias = model_step_tables((inv, scale), positions, mask, spec, dtype)
    want_cos, want_sin = rope_tables(inv, scale, positions, dtype)
    assert torch.equal(bias, attention_bias(mask, spec, dtype))
    for got, want in ((cos, want_cos), (sin, want_sin)):
        if DEVICE == "cuda":
            assert torch.equal(got, want)
        else:
            assert (got.float() - want.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 8e-3)
    assert not step_kernels.takes_tables(positions[None], mask[None], inv)  # a batch: the torch ops


@kernels
@pytest.mark.parametrize("tree,context", [("1-3-2+lookup-3", False), ("dynamic-8+lookup-3", False),
                                          ("1-3-2+lookup-3", True)])
def test_steps_with_the_kernels_decode_as_plain_greedy(tree, context):
    """fp32, greedy: hydra heads drafting over a drafting vocabulary (the top-k kernel), the
    greedy path, lookup and move kernels in every step, a static tree and a grown one, and
    heads whose context layer is fused as the engine fuses it on a GPU (its steps then
    through ``token_layer``): the tokens of plain greedy decoding."""
    model = tiny_model(seed=11, vocab_size=40, device=DEVICE)
    prompt = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = [t for s in Decoder(model, model.new_cache(128)).generate(prompt, GenerationConfig(max_new_tokens=30))
             for t in s.token_ids]
    heads = random_heads(4, 64, 40, seed=5, scale=0.5, kind="hydra", draft_vocab=24,
                         context=(128, 4, 2, 16) if context else None).to(DEVICE)
    heads.use_draft_vocab(model.lm_head.weight)
    if context:
        assert heads.context.fuse()
    static = StaticDecoder(model, new_static_cache(model, 128), heads, load_tree(tree))
    steps = list(static.generate(prompt, GenerationConfig(max_new_tokens=30)))
    assert [t for s in steps for t in s.token_ids] == plain
    assert max(s.accepted for s in steps) > 1


@kernels
@pytest.mark.parametrize("capacity,rows", [(300, 0), (2500, 0), (300, 3)])
def test_the_lookup_kernel_drafts_the_torch_chain(capacity, rows, monkeypatch):
    """Sequences that repeat themselves (matches of 1–3 tokens, near the start, across the
    kernel's 1,024-position blocks, running into the root, none at all, an empty cache): the
    chain ``lookup_draft`` gives through the torch ops; one sequence and a batch."""
    g = torch.Generator().manual_seed(capacity + rows)
    for trial in range(12):
        lead = (rows,) if rows else ()
        ids = torch.randint(0, 4 if trial % 3 else 50, (*lead, capacity), generator=g)
        length = torch.randint(0, capacity - 8, lead, generator=g) if trial else torch.zeros(lead, dtype=torch.long)
        root = torch.randint(0, 4, lead, generator=g)
        chains = []
        for on in ("1", "0"):
            monkeypatch.setenv("SPECMEMO_STEP_KERNELS", on)
            chains.append(lookup_draft(ids.to(DEVICE), length.to(DEVICE), root.to(DEVICE), 8))
        assert torch.equal(*chains), (trial, chains)


@kernels
@pytest.mark.parametrize("tree", ["1-3-2+lookup-4", "dynamic-8+lookup-3"])
def test_a_batch_with_the_kernels_decodes_each_sequence_as_alone(tree):
    """fp32, greedy, three sequences at their own lengths in one batch: the greedy path and
    lookup kernels over [B, ·] rows (a grown tree: a layout per row), the drafting top-k over
    a drafting vocabulary; each sequence's tokens are its plain greedy ones alone."""
    model = tiny_model(seed=11, vocab_size=40, device=DEVICE)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (5, 20, 12)]
    alone = [[t for s in Decoder(model, model.new_cache(128)).generate(p, GenerationConfig(max_new_tokens=16))
              for t in s.token_ids] for p in prompts]
    heads = random_heads(4, 64, 40, seed=5, scale=0.5, kind="hydra", draft_vocab=24).to(DEVICE)
    heads.use_draft_vocab(model.lm_head.weight)
    batch = BatchDecoder(model, slots=3, capacity=128, heads=heads, tree=load_tree(tree))
    for i, prompt in enumerate(prompts):
        batch.add(i, prompt, max_new_tokens=16)
    outs, most = {i: [] for i in range(3)}, 1
    while batch.active:
        for i, tokens in batch.step().items():
            outs[i] += tokens
            most = max(most, len(tokens) - 1)
    assert [outs[i] for i in range(3)] == alone and most > 1


@kernels
def test_a_split_model_with_the_kernels_decodes_as_plain_greedy():
    """The layers split in two segments on one device (each its own static cache, each moved by
    ``move_entries``): a tree with a lookup chain gives plain greedy decoding's tokens."""
    model = tiny_model(seed=11, vocab_size=40, layers=4, device=DEVICE)
    prompt = torch.randint(0, 40, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = [t for s in Decoder(model, model.new_cache(128)).generate(prompt, GenerationConfig(max_new_tokens=24))
             for t in s.token_ids]
    split_model(model, LayerSplit.even((DEVICE, DEVICE), 4))
    heads = random_heads(4, 64, 40, seed=5, scale=0.5, kind="hydra", draft_vocab=24).to(DEVICE)
    heads.use_draft_vocab(model.lm_head.weight)
    static = StaticDecoder(model, new_static_cache(model, 128), heads, load_tree("1-3-2+lookup-3"))
    assert isinstance(static.cache, SplitCache)
    steps = list(static.generate(prompt, GenerationConfig(max_new_tokens=24)))
    assert [t for s in steps for t in s.token_ids] == plain and max(s.accepted for s in steps) > 1
