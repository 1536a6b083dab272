"""Head training on tiny models: alignment, a real learning check, calibration, pipeline."""

import json

import pytest
import torch

from specmemo_core.runtime.heads import HeadsSpec, load_heads, random_heads, save_heads
from specmemo_core.tools.train.calibrate import (
    calibrate, head_ranks, lookup_lengths, path_rates, tree_depths, tree_from_calibration, walked_tokens_per_step,
)
from specmemo_core.tools.train.distill import Sequences, is_held_out
from specmemo_core.tools.train.features import IGNORE, build_features
from specmemo_core.tools.train.pipeline import frozen_io
from specmemo_core.tools.train.trainer import TrainConfig, train_heads
from tests.tiny import tiny_hf_model, tiny_tokenizer


def test_targets_are_k_plus_2_ahead_and_parents_k_plus_1():
    hf = tiny_hf_model(seed=0)
    # two sequences: prompt [100..104] reply [200..209]; prompt [50, 51] reply [60, 61, 62]
    seqs = Sequences.from_pairs([(list(range(100, 105)), list(range(200, 210))), ([50, 51], [60, 61, 62])])
    f = build_features(hf, seqs, num_heads=3)
    tokens = seqs.tokens
    # training positions: last prompt token .. last token, per sequence
    assert f.hidden.shape[0] == (10 + 1) + (3 + 1)
    # first sequence, position of prompt token 104 (g=4): head 0 → 201 (t+2), head 2 → 203
    assert f.targets[0].tolist() == [201, 202, 203]
    assert f.parents[0].tolist() == [200, 201, 202]
    # last positions of seq 1 run past the end: masked
    assert f.targets[10].tolist() == [IGNORE] * 3
    assert f.targets[8].tolist() == [209, IGNORE, IGNORE]
    # second sequence starts at row 11 (token 51): head 0 → 61
    assert f.targets[11].tolist() == [61, 62, IGNORE]
    # the teacher row of head k is the training position g + k + 1
    assert f.teacher_rows[0].tolist() == [1, 2, 3]
    # hidden states are the base model's at those positions
    with torch.no_grad():
        ref = hf.model(tokens[None, :15]).last_hidden_state[0]
    assert torch.allclose(f.hidden[0].float(), ref[4], atol=2e-2)


def _pattern_features(hf, num_heads, keep_all=False):
    period = list(range(3, 12))
    pairs = [([1, 2], (period * 8)[s:s + 40]) for s in range(9)]
    return build_features(hf, Sequences.from_pairs(pairs), num_heads, store_dtype=torch.float32, keep_all=keep_all)


CONTEXT = {"context_mlp": 64, "context_heads": 4, "context_kv_heads": 2, "context_head_dim": 16}


@pytest.mark.parametrize("kind", ["medusa", "hydra", "hydra+context"])
def test_heads_learn_a_repeating_pattern(kind):
    """Untrained heads guess the base model's next token (wrong here); after a few
    hundred steps on a periodic sequence they must predict 2..4 tokens ahead."""
    from specmemo_core.tools.train.pipeline import base_rope

    hf = tiny_hf_model(seed=1)
    context = kind.endswith("+context")
    kind = kind.split("+")[0]
    feats = _pattern_features(hf, 3, keep_all=context)
    embed, lm_head = frozen_io(hf)
    spec = HeadsSpec(kind, 3, 1, 64, 300, False, **(CONTEXT if context else {}))
    rope = base_rope(hf.config)
    untrained = head_ranks(random_heads(3, 64, 300, kind=kind, scale=0.0), feats, embed, lm_head)
    heads = train_heads(feats, spec, embed, lm_head, TrainConfig(steps=300, batch_size=128, lr=3e-3, warmup=5,
                                                                         soft_targets=False), rope=rope)
    if context:
        assert heads.context.layer.self_attn.o_proj.weight.abs().sum() > 0  # the context layer trained too
    trained = head_ranks(heads, feats, embed, lm_head, rope=rope)
    before = (untrained[:, 0] == 0).float().mean().item()
    after = [(trained[trained[:, k] >= 0, k] == 0).float().mean().item() for k in range(3)]
    assert before < 0.3
    assert min(after) > 0.9, after


def test_training_is_deterministic_and_resumes(tmp_path):
    hf = tiny_hf_model(seed=2)
    feats = _pattern_features(hf, 2)
    embed, lm_head = frozen_io(hf)
    spec = HeadsSpec("hydra", 2, 1, 64, 300, False)
    cfg = TrainConfig(steps=20, batch_size=64, checkpoint_every=10)
    a = train_heads(feats, spec, embed, lm_head, cfg)
    b = train_heads(feats, spec, embed, lm_head, cfg)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
    # stop at step 10, then resume from the checkpoint to step 20: same result
    train_heads(feats, spec, embed, lm_head, TrainConfig(steps=10, batch_size=64, checkpoint_every=10,
                                                         warmup=cfg.warmup), out_dir=tmp_path)
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert state["step"] == 10


def test_hydra_heads_round_trip(tmp_path):
    heads = random_heads(3, 64, 300, kind="hydra", num_layers=2, base_fingerprint="f")
    save_heads(heads, tmp_path)
    loaded = load_heads(tmp_path, 64, 300, "f")
    assert loaded.spec.kind == "hydra" and loaded.spec.num_layers == 2
    for x, y in zip(heads.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(x, y)


def test_calibration_paths_and_trees():
    ranks = torch.tensor([[0, 0, 1], [0, 1, -1], [0, 0, 0], [1, 0, 10], [10, 0, 0], [0, 0, 1]])
    rates = dict(path_rates(ranks))
    assert rates[(0,)] == pytest.approx(4 / 6)
    assert rates[(0, 0)] == pytest.approx(3 / 6)
    assert rates[(0, 0, 1)] == pytest.approx(2 / 6)
    assert (10,) not in rates and (1, 0, 10) not in rates
    record = calibrate(ranks, "medusa", trees=("chain-3",))
    assert record["topk_accuracy"][0][0] == pytest.approx(4 / 6, abs=1e-4)
    assert record["topk_accuracy"][0][1] == pytest.approx(5 / 6, abs=1e-4)
    # chain-3 = paths (0,), (0,0), (0,0,0): 1 + 4/6 + 3/6 + 1/6
    assert record["expected_accepted"]["chain-3"] == pytest.approx(1 + 8 / 6, abs=1e-4)
    tree = tree_from_calibration(record, 4)
    assert tree.paths == ((0,), (1,), (0, 0)) or tree.paths == ((0,), (0, 0), (0, 0, 1))
    assert tree.num_nodes == 4


def test_lookup_lengths_copy_what_followed_the_last_match_as_decoding_does():
    """Prompt 1 2 3 4, reply 1 2 3 9. The match ends with the root (the token about to
    be committed), and the chain guesses what comes after it."""
    seqs = Sequences.from_pairs([([1, 2, 3, 4], [1, 2, 3, 9])])
    two = lookup_lengths(seqs, 2)
    assert two.shape[0] == 5  # positions g = 3 (last prompt token) … 7
    assert two.tolist()[0] == 2  # g = 3, root 1: "1" was followed by 2 3, and the reply goes on 2 3
    assert two.tolist()[1] == 1  # g = 4, root 2: "1 2" was followed by 3 4; the reply says 3 9
    assert two.tolist()[3] == 0  # g = 6, root 9: never seen, nothing copied right
    assert two.tolist()[-1] == 0  # the last token: nothing left to guess


def test_tree_depths_are_the_longest_rank_prefix_in_the_tree():
    ranks = torch.tensor([[0, 0, -1], [1, 0, 0], [0, 1, 0], [10, 0, 0]])
    assert tree_depths(ranks, [(0,), (0, 0)]).tolist() == [2, 0, 1, 0]
    assert tree_depths(ranks, [(0,), (1,), (1, 0), (1, 0, 0)]).tolist() == [1, 3, 1, 0]


def test_a_walk_steps_over_what_each_step_accepted():
    """Prompt of 2, reply of 7 (positions g = 1 … 8). The prefill emits the reply's first
    token; steps start at g = 1 and g moves by what each step emits, capped at the end."""
    seqs = Sequences.from_pairs([([5, 6], [1, 2, 3, 4, 5, 6, 7])])
    reach = torch.tensor([3, 0, 0, 0, 1, 0, 0, 0])  # drafts accepted at g = 1 … 8
    # g=1: 4 tokens (reply 2..5) → g=5: 2 tokens → g=7: the reply ends: 6 tokens in 2 steps
    assert walked_tokens_per_step(reach, seqs) == pytest.approx(3.0)
    assert walked_tokens_per_step(torch.zeros(8, dtype=torch.long), seqs) == pytest.approx(1.0)
    # a position-weighted mean would say 1 + 4/8 = 1.5 here, and 2.0 above


def test_walked_lookup_tokens_per_step_is_what_the_decoder_measures():
    """On the model's own greedy reply the walk is the decoding itself: a lookup chain's
    walked tokens per step equals the decoder's, exactly."""
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.tree import load_tree
    from tests.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model(seed=4, vocab_size=12)  # a small vocabulary loops: the chain has runs to copy
    prompt = torch.randint(0, 12, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    config = GenerationConfig(max_new_tokens=60)
    plain = [t for s in Decoder(model, model.new_cache(128)).generate(prompt, config) for t in s.token_ids]
    steps = list(Decoder(model, model.new_cache(128), None, load_tree("lookup-8")).generate(prompt, config))
    decoded = steps[1:]  # the first is the prefill's token
    measured = sum(s.reply_tokens for s in decoded) / len(decoded)  # what ReplyStats and the benches report
    assert measured > 1.5  # the chain did copy runs
    seqs = Sequences.from_pairs([(prompt, plain)])
    assert walked_tokens_per_step(lookup_lengths(seqs, 8), seqs) == pytest.approx(measured)
    # step by step: each decoder step starts where the last one's tokens end and emits 1 + the
    # chain's reach there (the last step may be cut by max_new_tokens)
    reach, i = lookup_lengths(seqs, 8).tolist(), 0
    for step in decoded[:-1]:
        assert len(step.token_ids) == 1 + reach[i], i
        i += len(step.token_ids)
    assert len(decoded[-1].token_ids) <= 1 + reach[i]


def test_the_planner_takes_the_walked_tokens_per_step():
    from specmemo_core.planning.planner import LOOKUP_GAIN, tree_options

    ranks = torch.tensor([[0, 0, 1], [0, 1, -1], [0, 0, 0], [1, 0, 10], [10, 0, 0], [0, 0, 1]])
    seqs = Sequences.from_pairs([([1], [2, 3, 4, 5, 6])])  # six positions
    plain = calibrate(ranks, "medusa", trees=())
    walked = calibrate(ranks, "medusa", trees=(), sequences=seqs,
                       lookup={n: torch.zeros(6, dtype=torch.long) for n in LOOKUP_GAIN}, sizes=(4,))
    by_name = {o.name: o.expected_accepted for o in tree_options(walked)}
    assumed = {o.name: o.expected_accepted for o in tree_options(plain)}
    tree = tree_from_calibration(walked, 4)
    expected = walked_tokens_per_step(tree_depths(ranks, tree.paths), seqs)
    assert by_name["calibrated-4"] == pytest.approx(expected) and by_name["calibrated-4+lookup-3"] == pytest.approx(expected)
    assert by_name["lookup-3"] == 1.0  # the chain never hit
    assert assumed["calibrated-4+lookup-3"] == pytest.approx(assumed["calibrated-4"] + LOOKUP_GAIN[3])
    assert by_name["calibrated-8"] == assumed["calibrated-8"]  # not walked: the path rates


def test_held_out_split_is_fixed_and_small():
    held = [i for i in range(2000) if is_held_out(i)]
    assert 40 < len(held) < 160
    assert held == [i for i in range(2000) if is_held_out(i)]


@pytest.mark.parametrize("context", [False, True, "next"])
def test_pipeline_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, context):
    """train-heads on a tiny HF folder model: heads, calibration and card are written,
    and the engine decodes with them exactly as plain greedy."""
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.tools.train.pipeline import PipelineConfig, run_training

    monkeypatch.setenv("SPECMEMO_DATA_DIR", str(tmp_path / "data"))
    folder = tmp_path / "tiny-llama"
    tiny_hf_model(seed=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"turns": [f"Hello number {i}, how are you?", "Again, shorter."]})
                                  for i in range(12)))
    turns = 2 if context else 1  # the context layer also learns from second turns
    cfg = PipelineConfig(model=str(folder), kind="hydra", num_heads=3, context=bool(context),
                         context_next=context == "next", train_prompts=10, turns=turns,
                         heldout_prompts=4,
                         max_new_tokens=24, gen_batch=4, prompts_file=str(prompts), heldout_file=str(prompts),
                         train=TrainConfig(steps=30, batch_size=64))
    out = tmp_path / "heads"
    card = run_training(cfg, out, "cpu", log=lambda m: None)
    assert (out / "heads.safetensors").exists() and (out / "calibration.json").exists()
    assert card["kind"] == "hydra" and len(card["heldout_top1"]) == 3
    assert f"{10 * turns} replies" in card["data"]
    assert not (out / "checkpoint.pt").exists()
    engine = Engine.load(str(folder), heads=str(out), tree="calibrated-8")
    assert engine.tree.num_nodes <= 8
    assert (engine.heads.context is not None) == bool(context) and card["context_layer"] == bool(context)
    assert engine.heads.spec.context_next == (context == "next") == card["context_next"]
    plain = Engine.load(str(folder), heads="none")
    a = "".join(p.text for p in engine.new_session(512).send("Hello number 3"))
    b = "".join(p.text for p in plain.new_session(512).send("Hello number 3"))
    assert a == b
    if context is True:  # `specmemo calibrate --dtype`: fp32 reproduces the CPU's own calibration
        _check_recalibration(cfg, out, tmp_path / "again")


def _check_recalibration(cfg, out, again):
    """calibrate_folder over a copy of the heads without their held-out replies: in fp32 it
    distills the same replies and writes the same calibration; the base model follows dtype."""
    import shutil

    from specmemo_core.tools.train.pipeline import calibrate_folder, trainer_model

    again.mkdir()
    for name in ("heads.safetensors", "card.json"):
        shutil.copy(out / name, again / name)
    calibrate_folder(again, cfg, "cpu", dtype=torch.float32)
    first, second = (json.loads((d / "calibration.json").read_text()) for d in (out, again))
    assert second["topk_accuracy"] == first["topk_accuracy"]
    assert second["expected_accepted"] == first["expected_accepted"]
    _, hf = trainer_model(cfg.model, "cpu", dtype=torch.bfloat16)
    assert next(hf.parameters()).dtype == torch.bfloat16


def test_multi_turn_distillation_answers_each_turn_with_the_models_own_replies():
    """Turn 2's prompt is the templated conversation with the model's own first reply,
    so a second-turn sequence starts with the whole first-turn sequence's text."""
    from specmemo_core.runtime.chat import encode_conversation
    from specmemo_core.tools.train.distill import generate_replies

    torch.manual_seed(0)
    model, tok = tiny_hf_model(seed=3), tiny_tokenizer()
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    convs = [["Hello, how are you?", "Say it again."], ["The quick brown fox."], ["Memory budgets?", "And trees?"]]
    seqs = generate_replies(model, tok, convs, max_new_tokens=12, batch_size=2, stop_ids=[stop])
    assert len(seqs.starts) == 5  # every user turn answered
    pairs = [(seqs.tokens[s:r].tolist(), seqs.tokens[r:e].tolist())
             for s, r, e in zip(seqs.starts, seqs.reply_starts, seqs.ends)]
    firsts = {tuple(p): reply for p, reply in pairs}
    for conv in (convs[0], convs[2]):
        first_prompt = encode_conversation(tok, [{"role": "user", "content": conv[0]}])
        reply = firsts[tuple(first_prompt)]
        text = tok.decode([t for t in reply if t != stop], skip_special_tokens=True)
        second_prompt = encode_conversation(tok, [{"role": "user", "content": conv[0]},
                                                  {"role": "assistant", "content": text},
                                                  {"role": "user", "content": conv[1]}])
        assert tuple(second_prompt) in firsts  # the second turn was asked with the model's own reply
        assert len(second_prompt) > len(first_prompt) + len(reply) - 1


def test_user_turns_keep_the_split_and_the_order():
    from specmemo_core.tools.train.distill import is_held_out, user_turns

    convs = [[{"from": "human", "value": f"q{i}a"}, {"from": "gpt", "value": "x"},
              {"from": "human", "value": f"q{i}b"}, {"from": "human", "value": f"q{i}c"}] for i in range(300)]
    convs[5] = [{"from": "human", "value": "  "}]
    train = user_turns(convs, held_out=False, max_turns=2)
    held = user_turns(convs, held_out=True, max_turns=1)
    assert all(len(t) == 2 for t in train) and all(len(t) == 1 for t in held)
    assert len(train) + len(held) == 299  # the empty conversation is dropped
    assert held == [[f"q{i}a"] for i in range(300) if is_held_out(i) and i != 5]


@pytest.mark.parametrize("context", [False, True, "next"])
def test_grown_depths_are_what_the_decoder_accepts_on_a_grown_tree(context):
    """On the model's own greedy reply, each decoder step on a grown tree accepts exactly
    the calibration's grown depth where that step starts (hydra heads, with and without
    a context layer, and one reading next tokens), so the walked figure of ``dynamic-N`` is
    the decoder's own."""
    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.runtime.tree import load_tree
    from specmemo_core.tools.train.calibrate import grown_depths
    from specmemo_core.tools.train.pipeline import base_rope
    from tests.tiny import tiny_model

    hf = tiny_hf_model(seed=4, vocab_size=12)
    model = tiny_model(seed=4, vocab_size=12)
    ctx = (64, 4, 2, 16) if context else None
    heads = random_heads(4, 64, 12, seed=3, scale=0.5, kind="hydra", context=ctx, context_next=context == "next")
    prompt = torch.randint(0, 12, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    config = GenerationConfig(max_new_tokens=60)
    plain = [t for s in Decoder(model, model.new_cache(128)).generate(prompt, config) for t in s.token_ids]
    tree = load_tree("dynamic-8")
    decoded = list(Decoder(model, model.new_cache(128 + tree.num_nodes), heads, tree).generate(prompt, config))[1:]
    seqs = Sequences.from_pairs([(prompt, plain)])
    feats = build_features(hf, seqs, 4, store_dtype=torch.float32, keep_all=bool(context))
    embed, lm_head = frozen_io(hf)
    reach = grown_depths(heads, feats, embed, lm_head, tree.growth, rope=base_rope(hf.config)).tolist()
    assert max(len(s.token_ids) for s in decoded) > (1 if context else 2)  # grown drafts were accepted
    i = 0
    for step in decoded[:-1]:
        assert len(step.token_ids) == 1 + reach[i], i
        i += len(step.token_ids)
    assert walked_tokens_per_step(torch.tensor(reach), seqs) == pytest.approx(
        sum(len(s.token_ids) for s in decoded[:-1]) / len(decoded[:-1]), rel=0.1)
