"""Self-distillation data: ShareGPT prompts answered by the frozen base model itself.

Heads must learn what *this* model will say, not what ShareGPT's humans said, so the
training replies are the base model's own greedy continuations through its chat
template. Conversations are split into train and held-out sets by a hash of their index
in the (fixed, pinned) data file, so held-out conversations are never trained on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specmemo_core.runtime.chat import encode_conversation

Progress = Callable[[str, float], None]
HELD_OUT_PERCENT = 5


def is_held_out(index: int) -> bool:
    """Fixed split: about 5% of conversations, chosen by a hash of their index."""
    digest = hashlib.sha256(f"sharegpt-{index}".encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def user_turns(conversations: Sequence[Sequence[dict[str, str]]], held_out: bool,
               max_turns: int = 1) -> list[list[str]]:
    """The first ``max_turns`` human messages of each conversation of the chosen split
    (conversations whose first human message is empty are dropped)."""
    out = []
    for i, conv in enumerate(conversations):
        if is_held_out(i) != held_out:
            continue
        turns = [t.get("value", "") for t in conv if t.get("from") == "human"][:max_turns]
        turns = turns[: next((k for k, t in enumerate(turns) if not t.strip()), len(turns))]
        if turns:
            out.append(turns)
    return out


@dataclass(frozen=True)
class Sequences:
    """Token sequences (prompt + reply) concatenated: ``tokens[starts[i]:ends[i]]`` is
    sequence i and its reply begins at ``reply_starts[i]``."""

    tokens: torch.Tensor  # [total] long
    starts: torch.Tensor  # [S] long
    reply_starts: torch.Tensor  # [S] long
    ends: torch.Tensor  # [S] long

    @property
    def reply_tokens(self) -> int:
        return int((self.ends - self.reply_starts).sum())

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens, "starts": self.starts, "reply_starts": self.reply_starts, "ends": self.ends}

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor]) -> "Sequences":
        return cls(d["tokens"], d["starts"], d["reply_starts"], d["ends"])

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[list[int], list[int]]]) -> "Sequences":
        tokens, starts, reply_starts, ends, pos = [], [], [], [], 0
        for prompt, reply in pairs:
            starts.append(pos)
            reply_starts.append(pos + len(prompt))
            tokens += prompt + reply
            pos += len(prompt) + len(reply)
            ends.append(pos)
        as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return cls(as_long(tokens), as_long(starts), as_long(reply_starts), as_long(ends))


def generate_replies(
    hf_model: Any, tokenizer: Any, conversations: Sequence[Sequence[str]], *, max_prompt_tokens: int = 1024,
    max_new_tokens: int = 256, batch_size: int = 64, stop_ids: Sequence[int] = (),
    progress: Progress | None = None,
) -> Sequences:
    """Greedy replies of ``hf_model`` (a transformers causal LM) to every user turn of
    each conversation, one sequence per reply.

    Turn r's prompt is the whole conversation so far through the chat template, with the
    model's own earlier replies, as a chat with this model would be: the heads then also
    learn from long contexts and from replies that rework an earlier reply (MT-Bench's
    second turns). A conversation whose templated prompt exceeds ``max_prompt_tokens``
    stops there. Batches are sorted by length so little is padded; replies stop at the
    first stop token (kept, so heads learn to end turns too).
    """
    device = next(hf_model.parameters()).device
    histories: list[list[dict[str, str]]] = [[] for _ in conversations]
    pad = stop_ids[0] if stop_ids else 0
    pairs: list[tuple[list[int], list[int]]] = []
    rounds = max((len(c) for c in conversations), default=0)
    for r in range(rounds):
        todo = []
        for i, conv in enumerate(conversations):
            if r < len(conv) and len(histories[i]) == 2 * r:  # still going: every earlier turn answered
                messages = histories[i] + [{"role": "user", "content": conv[r]}]
                ids = encode_conversation(tokenizer, messages)
                if len(ids) <= max_prompt_tokens:
                    todo.append((i, messages, ids))
        todo.sort(key=lambda item: len(item[2]))
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            for (i, messages, ids), reply in zip(batch, _greedy_batch(hf_model, [e for _, _, e in batch], pad,
                                                                       max_new_tokens, stop_ids, device)):
                pairs.append((ids, reply))
                text = tokenizer.decode([t for t in reply if t not in stop_ids], skip_special_tokens=True)
                histories[i] = messages + [{"role": "assistant", "content": text}]
            if progress:
                progress(f"generating replies (turn {r + 1}/{rounds})", min(1.0, (b + batch_size) / len(todo)))
    return Sequences.from_pairs(pairs)


def _greedy_batch(hf_model: Any, encoded: Sequence[list[int]], pad: int, max_new_tokens: int,
                  stop_ids: Sequence[int], device: torch.device) -> list[list[int]]:
    """One left-padded batched ``generate``; each reply cut after its first stop token."""
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e):] = torch.tensor(e)
        mask[i, width - len(e):] = 1
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad, eos_token_id=list(stop_ids) or None,
        )[:, width:].cpu()
    replies = []
    for row in out.tolist():
        reply = []
        for tok in row:
            reply.append(tok)
            if tok in stop_ids:
                break
        replies.append(reply)
    return replies
