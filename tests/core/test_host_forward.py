"""What the two CPU forwards outside torch share under our one step (runtime/host_forward.py):
the native one (runtime/native) and llama.cpp's (runtime/ggml_step.py). Greedy speculative
replies equal plain greedy ones on the same backend, a second turn reuses the cached prefix,
the picks of a forward's own rows are its own, batched decoding goes to our torch forward.
Each backend's tests skip with a reason where it cannot run (no C compiler; llama-cpp-python
not installed: the optional ``llamacpp`` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specmemo_core.runtime.ggml_step import available as llamacpp_available
from specmemo_core.runtime.native.build import available as native_available
from specmemo_core.runtime.tree import load_tree
from tests.core.test_sources import write_tiny_gguf

BACKENDS = [
    pytest.param("native", marks=pytest.mark.skipif(not native_available(), reason="no C compiler builds it")),
    pytest.param("llamacpp", marks=pytest.mark.skipif(not llamacpp_available(),
                                                      reason="llama-cpp-python is not installed (the llamacpp extra)")),
]


def host_engine(tmp_path: Path, backend: str, **kw):
    from specmemo_core.runtime.engine import Engine

    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, layers=2, quant="Q4_0", tied=True)
    return Engine.load(path, heads="random", backend=backend, **kw)


def _reply(engine, prompt, tree=None, n=40, decoder=None):
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig

    heads = engine.heads if tree is not None else None
    decoder = decoder or Decoder(engine.model, engine.model.new_cache(len(prompt) + n + 64), heads,
                                 load_tree(tree) if tree else None)
    return [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)) for t in s.token_ids], decoder


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", ["1-3-2", "chain-2", "medusa-64"])
def test_speculative_replies_are_the_backends_plain_greedy_replies(data_dir, tmp_path, backend, tree):
    engine = host_engine(tmp_path, backend)
    prompt = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    plain, _ = _reply(engine, prompt)
    spec, _ = _reply(engine, prompt, tree)
    assert spec == plain and len(plain) == 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_turn_reuses_the_cached_prefix_as_a_fresh_decoder_would(data_dir, tmp_path, backend):
    """The next turn shares the conversation so far: the cache keeps it (truncating what
    diverges) and decodes what a fresh cache decodes from the whole conversation."""
    engine = host_engine(tmp_path, backend)
    first = torch.randint(3, 200, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    reply, decoder = _reply(engine, first, "1-3-2", n=12)
    second = first + reply[:6] + [7, 8, 9]  # diverges from the cached reply after 6 tokens
    again, _ = _reply(engine, second, "1-3-2", n=12, decoder=decoder)
    fresh, _ = _reply(engine, second, "1-3-2", n=12)
    assert again == fresh


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_decoding_is_refused_and_the_server_reloads_on_our_forward(data_dir, tmp_path, backend):
    from specmemo_core.errors import SpecMemoError
    from specmemo_core.serving.served import serve_engine

    engine = host_engine(tmp_path, backend, tree="1-3-2")
    with pytest.raises(SpecMemoError, match="--backend torch"):
        engine.new_batch_decoder(64, slots=2)
    again = engine.on_torch()
    assert again.backend == "torch" and again.tree.name == engine.tree.name and again.precision == "int4"
    assert serve_engine(engine, capacity=64, slots=2).tree == "1-3-2"


@pytest.mark.parametrize("backend", BACKENDS)
def test_picks_of_the_forwards_rows_are_its_own_and_a_changed_row_is_scored_again(data_dir, tmp_path, backend):
    """``greedy_picks`` of what the forward returned (or rows equal to it) are the argmax of
    the backend's own logits; a tensor the caller changed since is scored by our LM head."""
    lm = host_engine(tmp_path, backend).model
    cache = lm.new_cache(64)
    tokens = torch.tensor([5, 9, 13, 2])
    positions, mask = cache.prepare(torch.arange(4))
    hidden = lm(tokens, positions, mask, cache)
    logits = lm.logits(hidden)
    assert torch.equal(lm.greedy_picks(hidden), logits.argmax(-1))
    assert torch.equal(lm.greedy_picks(hidden[2:3].clone()), logits[2:3].argmax(-1))  # equal rows, another tensor
    hidden[1] = hidden[1].flip(0)  # changed in place: no longer what the backend scored
    assert torch.equal(lm.greedy_picks(hidden), lm.lm_head(hidden).argmax(-1))
    assert not torch.equal(lm.logits(hidden)[1], logits[1])
