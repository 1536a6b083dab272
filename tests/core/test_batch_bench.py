"""``specmemo bench --batch``'s own code on a tiny random model: the queries as concurrent
requests through batch decoders, batched speculation replying exactly as batched plain."""

import pytest
import torch

from specmemo_core.cli import main
from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.timing import StepTiming
from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.runtime.decoding import GenerationConfig
from specmemo_core.runtime.engine import Engine, resolve_tree
from specmemo_core.runtime.heads import random_heads
from specmemo_core.storage.sources import ModelIdentity
from specmemo_core.runtime.batch import BatchDecoder
from specmemo_core.tools.batch_bench import Requests, batch_runner, format_batch_table, parse_batches, run_batch_bench
from specmemo_core.tools.bench import planner_choice, turn_prompt
from tests.tiny import tiny_hf_model, tiny_model, tiny_tokenizer

QUERIES = ["Hello, how are you today?", "Tell me about the quick brown fox.", "Speculative decoding drafts tokens.",
           "Memory budgets: weights, heads, KV cache."]


def test_batched_plain_and_speculation_on_the_planners_tree_for_each_batch_size():
    torch.set_num_threads(1)
    model, tok = tiny_model(seed=3, vocab_size=300), tiny_tokenizer(300)
    engine = Engine(model, tok, tiny_hf_model(seed=3, vocab_size=300).config, ModelIdentity("tiny", "0"),
                    random_heads(5, 64, 300, seed=4, scale=0.5), None)
    prompts = [encode_conversation(tok, [{"role": "user", "content": q}], {}) for q in QUERIES]
    free_nodes = StepTiming(1.0, 1.0, 64, 0.0)  # trees cost nothing extra: the planner picks one at every size

    def tree_for(b):
        chosen = planner_choice(engine, "fp32", 16, timing=free_nodes, batch=b)
        return resolve_tree(chosen.tree, engine.heads_folder) if chosen.tree else None

    out = run_batch_bench(model, engine.heads, Requests.alone(prompts), batches=[1, 3], tree_for=tree_for,
                          config=GenerationConfig(max_new_tokens=16), repeats=2)
    assert list(out) == ["1", "3"]
    for entry in out.values():
        assert entry["plain"]["tree"] is None and entry["speculative"]["tree"] is not None
        for name in ("plain", "speculative"):
            assert entry[name]["replies"] == 4 and entry[name]["identical_to_plain"] == 4
            assert entry[name]["new_tokens"] == 4 * 16 and len(entry[name]["tokens_per_s_passes"]) == 2
            assert entry[name]["tokens_per_s"]["min"] > 0
        assert entry["plain"]["tokens_per_sequence_step"] == pytest.approx(1.0, abs=0.1)
        assert entry["speedup"] > 0
    assert "speculative" in format_batch_table(out)


def test_a_conversation_is_a_client_whose_next_turn_carries_the_reply_it_got():
    torch.set_num_threads(1)
    model, tok = tiny_model(seed=3, vocab_size=300), tiny_tokenizer(300)
    heads = random_heads(5, 64, 300, seed=4, scale=0.5)
    convs = [QUERIES[:2], QUERIES[2:], QUERIES[:1]]
    config = GenerationConfig(max_new_tokens=12)
    requests = Requests.of_conversations(tok, convs, history=True, max_new_tokens=12)
    assert requests.turns == (2, 2, 1)
    tree = resolve_tree("1-3-2+lookup-4", None)
    replies = {}
    for name, b, t in (("plain", 1, None), ("plain", 2, None), ("speculative", 2, tree)):
        decoder = BatchDecoder(model, slots=b, capacity=requests.longest + 12 + 9, heads=heads, tree=t)
        replies[name, b] = batch_runner(decoder, requests, config)().replies
    assert replies["plain", 1] == replies["plain", 2] == replies["speculative", 2]  # who shares the batch changes nothing
    got = replies["plain", 2]
    assert len(got) == 5 and all(len(r) == 12 for r in got)
    # turn 2 of client 0 is the reply to its conversation so far, turn 1's reply included
    second = turn_prompt(tok, convs[0], [got[0]])
    assert len(second) <= requests.longest
    assert any(second[i:i + 12] == got[0] for i in range(len(second)))  # the reply's own ids
    alone = BatchDecoder(model, slots=1, capacity=requests.longest + 13)
    assert batch_runner(alone, Requests.alone([second]), config)().replies == [got[1]]
    without_history = batch_runner(alone, Requests.alone([turn_prompt(tok, convs[0][1:], [])]), config)().replies
    assert without_history != [got[1]]  # the history reached the model


def test_batch_sizes_are_checked_before_anything_loads(capsys):
    assert parse_batches("1,2,4,8,16") == [1, 2, 4, 8, 16]
    for bad in ("", "0,2", "2,2", "a"):
        with pytest.raises(SpecMemoError, match="--batch"):
            parse_batches(bad)
    assert main(["bench", "--batch", "1,1"]) == 2
    assert "--batch" in capsys.readouterr().err
