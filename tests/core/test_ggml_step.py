"""The base model's forward through llama.cpp (runtime/ggml_step.py) under our one step: a
tree's nodes in one llama.cpp sequence per leaf see exactly their ancestors; what it shares
with the native forward (greedy speculative replies equal plain ones, …) is in
test_host_forward.py. The decoding tests need llama-cpp-python (the optional ``llamacpp``
extra) and are skipped with a reason without it."""

from __future__ import annotations


import pytest
import torch

from specmemo_core.runtime.ggml_step import available, tree_sequences
from specmemo_core.runtime.tree import load_tree
from tests.core.test_host_forward import host_engine
from tests.core.test_sources import write_tiny_gguf

needs_llamacpp = pytest.mark.skipif(not available(), reason="llama-cpp-python is not installed (the llamacpp extra)")


@pytest.mark.parametrize("name", ["single", "chain-3", "1-3-2", "1-10-16-17", "medusa-64"])
def test_each_node_sees_exactly_its_ancestors_through_its_first_sequence(name):
    """llama.cpp lets a query see the cells holding its first sequence id (and no later
    position): for every pair of nodes that is the tree's ancestor mask."""
    buffers = load_tree(name).buffers
    mask, depths = buffers.attn_mask, buffers.depths.tolist()
    sequences = tree_sequences(mask)
    n = mask.shape[0]
    assert len(sequences) == n and all(sequences)
    for i in range(n):
        for j in range(n):  # positions are length + depth: a cell at a deeper position is unseen
            seen = sequences[i][0] in sequences[j] and depths[j] <= depths[i]
            assert seen == bool(mask[i, j]), (name, i, j)
    if n > 1:
        leaves = {s for seq in sequences for s in seq}
        assert 0 not in leaves and len(leaves) == sum(int(mask[:, j].sum()) == 1 for j in range(n))


@needs_llamacpp
def test_a_4_bit_file_on_a_cpu_is_planned_onto_llamacpp_where_no_native_forward_builds(data_dir, tmp_path,
                                                                                      monkeypatch):
    """Without a C compiler that builds the native forward (``false`` stands for one that
    fails), a 4-bit file on a CPU goes to llama.cpp, unless torch is asked for."""
    from dataclasses import replace

    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, load_planned
    from specmemo_core.runtime.native import build

    path = write_tiny_gguf(tmp_path / "q4.gguf", hidden=64, quant="Q4_1", tied=True)
    choices = PlanChoices(turns=1, reply_tokens=8, speculate=False)
    monkeypatch.setenv("CC", "false")
    build.library.cache_clear()
    try:
        auto = load_planned(path, heads="none", choices=choices, device=cpu_device(), data_folder=tmp_path,
                            wait_for_timing=False)
    finally:
        build.library.cache_clear()
    assert (auto.engine.backend, auto.engine.precision, type(auto.engine.model).__name__) == \
        ("llamacpp", "int4", "LlamaCppLM")
    forced = load_planned(path, heads="none", choices=replace(choices, backend="torch"), device=cpu_device(),
                          data_folder=tmp_path, wait_for_timing=False)
    assert forced.engine.backend == "torch" and type(forced.engine.model).__name__ == "CausalLM"


@pytest.mark.parametrize(("quant", "precision", "says"), [("F32", None, "runs 4-bit GGUFs"),
                                                          ("Q4_0", "fp32", "not fp32: choose int4")])
def test_what_llamacpp_cannot_run_is_refused_with_what_to_do(data_dir, tmp_path, quant, precision, says):
    """Before llama-cpp-python is even needed: a file that is not 4-bit, or another precision."""
    from specmemo_core.errors import SpecMemoError
    from specmemo_core.runtime.engine import Engine

    path = write_tiny_gguf(tmp_path / f"{quant}.gguf", hidden=64, quant=quant)
    with pytest.raises(SpecMemoError, match=says) as info:
        Engine.load(path, heads="none", backend="llamacpp", precision=precision)
    assert "torch backend" in str(info.value)


@needs_llamacpp
@pytest.mark.parametrize("length", [4, 20])
def test_a_prompt_chunk_read_for_its_last_row_scores_no_other_row_from_eight_tokens_on(data_dir, tmp_path, length):
    """A ``last_only`` chunk of ``SPLIT_PREFILL`` tokens or more runs all but its last token
    with no output (llama.cpp then scores no other row with its LM head); its last row's
    hidden state and pick are those of the chunk read whole, and its cache the same length."""
    from specmemo_core.runtime.ggml_step import SPLIT_PREFILL

    lm = host_engine(tmp_path, "llamacpp").model
    tokens = torch.randint(3, 200, (length,), generator=torch.Generator().manual_seed(2))
    whole_cache, split_cache = lm.new_cache(64), lm.new_cache(64)
    positions, mask = whole_cache.prepare(torch.arange(length))
    whole = lm(tokens, positions, mask, whole_cache)
    whole_pick = lm.greedy_picks(whole[-1:])
    last = lm(tokens, positions, mask, split_cache, last_only=True)
    outputs = sum(bool(lm.ll.llama_get_logits_ith(split_cache.ctx, i)) for i in range(2))
    assert outputs == (1 if length >= SPLIT_PREFILL else 2)  # a batch index past the last output gives none
    assert torch.equal(last[:-1], torch.zeros(length - 1, whole.shape[-1]))
    torch.testing.assert_close(last[-1], whole[-1], atol=1e-3, rtol=1e-3)
    assert torch.equal(lm.greedy_picks(last[-1:]), whole_pick)
