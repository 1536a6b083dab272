"""The chunked attention of a GPU step (``runtime/chunked_attention.py``) against SDPA: the
kernels on the GPU where there is one, else in Triton's interpreter on the CPU (a process of
their own: Triton reads ``TRITON_INTERPRET`` as it is imported, and the rest of the suite
must run without it)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from specmemo_core.runtime import chunked_attention
from specmemo_core.runtime.model import CausalLM, attention_bias
from specmemo_core.runtime.static_decoding import StaticKVCache
from tests.tiny import tiny_hf_model
from tests.triton_kernels import DEVICE, assert_probe_falls_back, elsewhere, kernels, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed (a CPU-only torch): the GPU kernel cannot be run")


@elsewhere
def test_in_tritons_interpreter():
    run_in_interpreter(__file__, passed=16)


@elsewhere
def test_where_the_kernels_cannot_run_the_probe_says_why_and_sdpa_stays(caplog):
    assert_probe_falls_back(chunked_attention._probe, caplog, says=("chunked attention unavailable", "SDPA"))


@kernels
def test_the_probe_passes_where_the_kernels_run():
    assert chunked_attention._probe(torch.device(DEVICE), torch.float32) is True


def _tree_bias(length: int, tokens: int, span: int, groups: int, seed: int) -> torch.Tensor:
    """The [groups·T, span] additive bias of a random tree of ``tokens`` nodes after ``length`` slots."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, tokens)]
    anc = torch.eye(tokens, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] |= anc[p]
    rel = torch.arange(span)[None] - length
    mask = (rel < 0) | ((rel >= 0) & (rel < tokens) & anc[:, rel[0].clamp(0, tokens - 1)])
    return torch.zeros(tokens, span).masked_fill_(~mask, float("-inf")).repeat(groups, 1)


@kernels
@pytest.mark.parametrize("hkv,groups,tokens,hd,length,span,tail_bias", [
    (2, 1, 1, 64, 300, 512, True),  # a plain step, chunks past the end skipped
    (3, 3, 5, 64, 200, 256, True),  # grouped heads (SmolLM2's 9 over 3), a small tree
    (2, 2, 20, 32, 129, 256, True),  # a tree across a chunk boundary
    (2, 2, 20, 32, 129, 256, False),  # the same, its bias read at every slot (as timed against)
    (1, 1, 3, 16, 0, 128, True),  # the first forward of an empty cache
])
@pytest.mark.parametrize("block_m", [0, 16])  # 0: as the rows and the SMs say; 16: a tree's rows in blocks of 16
def test_matches_sdpa_and_ignores_slots_past_the_end(hkv, groups, tokens, hd, length, span, tail_bias, block_m):
    g = torch.Generator().manual_seed(hkv * 100 + tokens)
    capacity = span + 64
    keys = torch.randn(hkv, capacity, hd, generator=g).to(DEVICE)
    values = torch.randn(hkv, capacity, hd, generator=g).to(DEVICE)
    keys[:, length + tokens:] = float("nan")  # never read: past the live end
    values[:, length + tokens:] = float("nan")
    q = torch.randn(hkv, groups * tokens, hd, generator=g).to(DEVICE)
    bias = _tree_bias(length, tokens, span, groups, seed=tokens).to(DEVICE)
    got = chunked_attention.attend(q, keys, values, bias, torch.tensor(length, device=DEVICE),
                                   new_tokens=tokens, groups=groups, tail_bias=tail_bias, block_m=block_m)  # [T, H·hd]
    end = length + tokens
    want = F.scaled_dot_product_attention(q[None], keys[None, :, :end], values[None, :, :end],
                                          attn_mask=bias[:, :end])[0]  # [Hkv, g·T, hd]
    want = want.unflatten(-2, (groups, tokens)).movedim(-2, -4).reshape(tokens, hkv * groups * hd)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


@kernels
def test_16_bit_partials_between_the_kernels_keep_a_trees_output():
    """A tree's attention with its chunks' partial outputs in 16 bits (``partials``; fp16 here: the
    interpreter has no bf16 sums) against fp32 ones: within 16-bit rounding; fp32 is the default."""
    g = torch.Generator().manual_seed(3)
    keys, values = (torch.randn(2, 320, 64, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(2, 2 * 20, 64, generator=g).to(DEVICE)
    bias = _tree_bias(129, 20, 256, 2, seed=20).to(DEVICE)
    length = torch.tensor(129, device=DEVICE)
    run = functools.partial(chunked_attention.attend, q, keys, values, bias, length, new_tokens=20, groups=2)
    full, half = run(), run(partials=torch.float16)
    assert torch.equal(full, run(partials=torch.float32))
    assert not torch.equal(full, half)  # the partials were rounded
    assert ((half - full).abs().max() / full.abs().max()).item() < 2e-3


def test_a_tree_of_few_heads_takes_narrower_blocks_of_rows_to_fill_the_gpu():
    """``busy_rows`` on an H100's 132 SMs, 8 chunks of a 1,024-slot span: the default model's 3
    heads score a 20-node tree (60 rows a head) 16 rows a program (96 programs; 64 rows: 24), its
    64-node tree (192 rows) 32 (144 programs), vicuna-7b's 32 heads 64 (256); a plain step's few
    rows take 16 whatever the rule, and Triton's interpreter (no SMs) keeps 64."""
    pick = lambda rows, heads, sms=132: chunked_attention.block_rows(  # noqa: E731
        rows, chunked_attention.busy_rows(rows, 8 * heads, sms))
    assert (pick(60, 3), pick(192, 3), pick(64, 32), pick(3, 3), pick(192, 3, sms=0)) == (16, 32, 64, 16, 64)


@elsewhere
@pytest.mark.parametrize("partials", ["*bf16", "*fp32"])
def test_a_trees_attention_builds_for_hopper(partials):
    """The two kernels as a 7B tree step launches them (bf16, 128-wide heads, 64 rows a program, chunks of
    128 slots, PDL), the partial outputs between them in 16 bits (``Launch.attention_partials16``) or
    fp32, built for sm_90 by Triton's compiler and ptxas on this CPU."""
    from specmemo_core.runtime import chunked_attention_kernels as cak
    from tests.triton_kernels import compile_for_hopper

    sums = {"length_ptr": "*i64", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": partials}
    built = compile_for_hopper(cak.attend_chunks, types=dict(sums, scale="fp32"), stages=2, constexprs=dict(
        HD=128, BLOCK_M=64, SPLIT=128, CHUNK=64, IEEE=False, TAIL_BIAS=True, PDL=1))
    assert "griddepcontrol.wait" in built.asm["ptx"]
    built = compile_for_hopper(cak.merge_chunks, types=sums, constexprs=dict(HD=128, BLOCK=16, ROWS=8, PDL=1))
    assert "griddepcontrol.wait" in built.asm["ptx"]


def test_the_stages_fit_a_blocks_shared_memory():
    """A plain step of 128-wide bf16 heads counts ~100 KB with 3 stages: it keeps them on an H100
    (227 KB a block) and takes 2 on a laptop GPU (99 KB); a tree's 2 fit both; fp32 on the
    laptop: 1."""
    for shared, plain, tree in ((227 << 10, 3, 2), (99 << 10, 2, 2)):
        assert chunked_attention.fitting_stages(3, block_m=16, head_dim=128, element_size=2, shared_bytes=shared) == plain
        assert chunked_attention.fitting_stages(2, block_m=64, head_dim=128, element_size=2, shared_bytes=shared) == tree
    assert chunked_attention.fitting_stages(3, block_m=16, head_dim=128, element_size=4, shared_bytes=99 << 10) == 1


@kernels
def test_a_rows_output_is_the_same_bits_whatever_rows_the_step_has_beside_it():
    """The root of a 7-node tree (it sees the committed slots and itself) gets exactly what a
    one-token step gives it: the merge sums each row in one order (how greedy speculative replies
    stay plain greedy's in fp32), wherever its rows fall among a merge program's ``MERGE_ROWS``
    (here rows 0 and 7 of 14, against 0 and 1 of 2). (Steps past 16 rows score in larger tiles:
    the interpreter's matmul then rounds otherwise; the GPU's own tests check greedy replies.)"""
    g = torch.Generator().manual_seed(7)
    hkv, groups, hd, length, span = 2, 2, 32, 129, 256
    keys, values = (torch.randn(hkv, span + 64, hd, generator=g).to(DEVICE) for _ in range(2))
    tree_q = torch.randn(hkv, groups, 7, hd, generator=g).to(DEVICE)
    outs = []
    for tokens in (1, 7):
        q = tree_q[:, :, :tokens].reshape(hkv, groups * tokens, hd)
        bias = _tree_bias(length, tokens, span, groups, seed=3).to(DEVICE)
        out = chunked_attention.attend(q, keys, values, bias, torch.tensor(length, device=DEVICE),
                                       new_tokens=tokens, groups=groups)  # [T, H·hd]
        outs.append(out[0])
    assert torch.equal(outs[0], outs[1])


@kernels
def test_a_tree_forward_attends_as_sdpa():
    """A tiny model's tree forward over a static cache: chunked (as a GPU step runs) and SDPA agree."""
    hf = tiny_hf_model(seed=3)
    model = CausalLM.from_state_dict(hf.config, hf.state_dict(), device=DEVICE)
    s = model.spec
    outs = []
    for chunked in (True, False):
        cache = StaticKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 256, torch.float32, DEVICE)
        prompt = torch.arange(40, device=DEVICE) % s.vocab_size
        positions, mask = cache.prepare(torch.arange(40, device=DEVICE), None, 256)
        model(prompt, positions, mask, cache)  # 40 rows × groups: SDPA (more rows than a tree) or not
        cache.commit_prefix(40)
        anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=DEVICE)
        positions, mask = cache.prepare(torch.tensor([0, 1, 1, 2], device=DEVICE), anc, 128)
        x = model.model.embed_tokens(torch.tensor([5, 6, 7, 8], device=DEVICE))
        cos, sin = model.rope(positions)
        bias = attention_bias(mask, s, torch.float32)
        layer = model.model.layers[0]
        q, k, v = layer.regions.project(layer, x, cos, sin)
        assert chunked_attention.supports(q.reshape(s.num_kv_heads, -1, s.head_dim), cache.k[0], cache.live_length)
        outs.append(layer.self_attn.attend(q, k, v, bias, cache, chunked))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
