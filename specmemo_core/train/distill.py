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

from ..chat import encode_conversation

Progress = Callable[[str, float], None]
HELD_OUT_PERCENT = 5


def is_held_out(index: int) -> bool:
    """Fixed split: about 5% of conversations, chosen by a hash of their index."""
    digest = hashlib.sha256(f"sharegpt-{index}".encode()).digest()
    return digest[0] * 100 // 256 < HELD_OUT_PERCENT


def first_prompts(conversations: Sequence[Sequence[dict[str, str]]], held_out: bool) -> list[str]:
    """The first human message of each conversation of the chosen split."""
    prompts = []
    for i, conv in enumerate(conversations):
        if is_held_out(i) != held_out:
            continue
        first = next((t.get("value", "") for t in conv if t.get("from") == "human"), "")
        if first and first.strip():
            prompts.append(first)
    return prompts


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
    hf_model: Any, tokenizer: Any, prompts: Sequence[str], max_prompt_tokens: int = 512,
    max_new_tokens: int = 256, batch_size: int = 64, stop_ids: Sequence[int] = (),
    progress: Progress | None = None,
) -> Sequences:
    """Greedy replies of ``hf_model`` (a transformers causal LM) to each prompt.

    Prompts longer than ``max_prompt_tokens`` after templating are skipped. Batches are
    sorted by length so little is padded; replies stop at the first stop token (kept,
    so heads learn to end turns too).
    """
    device = next(hf_model.parameters()).device
    encoded = [encode_conversation(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    encoded = sorted((e for e in encoded if len(e) <= max_prompt_tokens), key=len)
    pad = stop_ids[0] if stop_ids else 0
    pairs: list[tuple[list[int], list[int]]] = []
    for b in range(0, len(encoded), batch_size):
        batch = encoded[b:b + batch_size]
        width = max(len(e) for e in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(batch):  # left padding
            ids[i, width - len(e):] = torch.tensor(e)
            mask[i, width - len(e):] = 1
        with torch.inference_mode():
            out = hf_model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=pad, eos_token_id=list(stop_ids) or None,
            )[:, width:].cpu()
        for e, row in zip(batch, out.tolist()):
            reply = []
            for tok in row:
                reply.append(tok)
                if tok in stop_ids:
                    break
            pairs.append((e, reply))
        if progress:
            progress("generating replies", min(1.0, (b + batch_size) / len(encoded)))
    return Sequences.from_pairs(pairs)
