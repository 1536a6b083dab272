"""``specmemo eval-acceptance``: tokens per step (beside what the verifications accepted) and speed
of trees vs plain greedy.

Every conversation is run once with plain decoding and once per tree, turn by turn in
one session (so later turns see earlier replies, as in a chat). A tree's reply must be
token-for-token the plain reply (greedy); the report counts the turns where it is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from specmemo_core.runtime.chat import ChatSession, end_of_turn_ids
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.heads import DraftHeads
from specmemo_core.runtime.model import CausalLM
from specmemo_core.runtime.tree import Tree


@dataclass(frozen=True)
class RunResult:
    replies: list[list[int]]
    new_tokens: int
    steps: int  # verify steps (prefills excluded)
    step_tokens: int  # tokens those steps gave the replies (``Step.reply_tokens``)
    decode_seconds: float  # time in verify steps
    seconds: float  # wall time, prefills included
    first_token_s: tuple[float, ...] = ()  # per reply: its prefill and first pick (time to first token)
    prefilled: int = 0  # prompt tokens run (what a cache already held is not run again)
    accepted_tokens: int = 0  # tokens those steps' verifications accepted, past the replies' ends too

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def run_conversations(
    model: CausalLM, tokenizer: Any, config: Any, conversations: Sequence[Sequence[str]], *,
    heads: DraftHeads | None, tree: Tree | None, max_new_tokens: int, capacity: int = 4096,
    on_turn: Callable[[], None] | None = None, graphs: bool = False, capture_stream: Any = None,
    overlap: bool | None = None,
) -> RunResult:
    """``graphs``: decode with static shapes (``static_decoding``; CUDA graphs on a GPU,
    captured on ``capture_stream``: pass one stream to every run of a process, see
    ``Engine.graph_capture_stream``); ``overlap``: ``StaticDecoder.overlap``."""
    scratch = tree.num_nodes if tree is not None else 1
    if graphs:
        from specmemo_core.runtime.static_decoding import StaticDecoder, new_static_cache

        decoder: Decoder = StaticDecoder(model, new_static_cache(model, capacity + scratch), heads, tree, graphs=True,
                                         capture_stream=capture_stream, overlap=overlap)
    else:
        decoder = Decoder(model, model.new_cache(capacity + scratch), heads, tree)
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    stops = end_of_turn_ids(tokenizer, config)
    if graphs:
        decoder.capture(prefill=True)  # CUDA graphs are made before the clock starts, not in the turns
    replies: list[list[int]] = []
    new_tokens = steps = step_tokens = accepted_tokens = prefilled = 0
    decode_s = 0.0
    first_token_s: list[float] = []
    start = time.perf_counter()
    for turns in conversations:
        # one decoder for all: its buffers (and CUDA graphs) are made once, and a conversation
        # keeps what it shares with the last one's cache (the chat template's system prompt),
        # as llama.cpp's generate keeps its longest common prefix from one prompt to the next
        session = ChatSession(decoder, tokenizer, stops)
        for turn in turns:
            ids: list[int] = []
            for piece in session.send(turn, gen):
                ids.extend(piece.step.token_ids)
                if piece.step.prefill:
                    first_token_s.append(piece.step.forward_s)
                    prefilled += piece.step.tree_nodes  # a prefill's Step counts the tokens it ran
                if piece.step.accepted and not piece.step.prefill:
                    steps += 1
                    step_tokens += piece.step.reply_tokens
                    accepted_tokens += piece.step.accepted
                    decode_s += piece.step.forward_s
            replies.append(ids)
            new_tokens += len(ids)
            if on_turn:
                on_turn()
    return RunResult(replies, new_tokens, steps, step_tokens, decode_s, time.perf_counter() - start,
                     tuple(first_token_s), prefilled, accepted_tokens)


def eval_acceptance(
    model: CausalLM, tokenizer: Any, config: Any, conversations: Sequence[Sequence[str]], *,
    heads: DraftHeads, trees: Sequence[Tree], max_new_tokens: int = 128,
    progress: Callable[[str, float], None] | None = None,
) -> dict[str, dict[str, float]]:
    """{name: {mean_accepted, tokens_per_s, identical_turns, turns, ...}}, "plain" first."""
    total_turns = sum(len(c) for c in conversations)
    runs = [("plain", None, None)] + [(t.name, heads, t) for t in trees]
    report: dict[str, dict[str, float]] = {}
    baseline: RunResult | None = None
    for i, (name, h, tree) in enumerate(runs):
        done = [0]

        def tick() -> None:
            done[0] += 1
            if progress:
                progress(f"{name} ({i + 1}/{len(runs)})", done[0] / total_turns)

        result = run_conversations(model, tokenizer, config, conversations, heads=h, tree=tree,
                                   max_new_tokens=max_new_tokens, on_turn=tick)
        baseline = baseline or result
        identical = sum(a == b for a, b in zip(baseline.replies, result.replies))
        report[name] = {
            "tokens_per_step": round(result.tokens_per_step, 4),
            "mean_accepted": round(result.mean_accepted, 4),
            "tokens_per_s": round(result.tokens_per_s, 3),
            "speedup_vs_plain": round(result.tokens_per_s / baseline.tokens_per_s, 3),
            "identical_turns": identical, "turns": total_turns, "new_tokens": result.new_tokens,
            "tree_nodes": tree.num_nodes if tree is not None else 1,
        }
    return report
