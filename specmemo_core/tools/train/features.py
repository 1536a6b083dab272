"""Training features: the frozen base model's hidden states over distilled sequences.

Position g (a global index into ``Sequences.tokens``) is a *training position* if it
lies in a reply region or is the last prompt token. Its hidden state h_g is what the
heads read at decode time; head k's target is the token k + 2 places on, and its
*parent* token (what a hydra head also reads) the token k + 1 places on. Positions whose
target falls past the end of the sequence are masked with -100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from specmemo_core.tools.train.distill import Sequences

IGNORE = -100


@dataclass(frozen=True)
class Features:
    hidden: torch.Tensor  # [M, D] base hidden state at each training position
    targets: torch.Tensor  # [M, K] token at g + k + 2, IGNORE past the end
    parents: torch.Tensor  # [M, K] token at g + k + 1 (hydra input), 0 past the end
    teacher_rows: torch.Tensor  # [M, K] row of ``hidden`` at g + k + 1 (its LM-head
    # distribution is the base model's own for the target), -1 where not stored
    # For heads with a context layer, which reads every position of a sequence (prompt
    # included): the hidden state at every global index g, and per sequence its [start,
    # end) in g and its [first, last + 1) training rows (rows are grouped by sequence).
    all_hidden: torch.Tensor | None = None  # [G, D]
    seq_bounds: torch.Tensor | None = None  # [S, 2]
    row_bounds: torch.Tensor | None = None  # [S, 2]
    all_next: torch.Tensor | None = None  # [G] the token after each position (a context layer may read it;
    # at a sequence's last position, no target depends on it)

    @property
    def num_heads(self) -> int:
        return self.targets.shape[1]


def training_positions(seqs: Sequences) -> torch.Tensor:
    """Global indices g of all training positions, sequence by sequence [M]."""
    parts = [torch.arange(int(r) - 1, int(e)) for r, e in zip(seqs.reply_starts, seqs.ends)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def build_features(
    hf_model: Any, seqs: Sequences, num_heads: int, *, store_dtype: torch.dtype = torch.bfloat16,
    batch_size: int = 32, progress: Callable[[str, float], None] | None = None, keep_all: bool = False,
) -> Features:
    """Run the frozen base model (a transformers causal LM, batched, right-padded) once
    over every sequence and keep the final-normed hidden states of training positions
    (``keep_all``: of every position too, for heads with a context layer)."""
    positions = training_positions(seqs)  # [M]
    row_of = torch.full((seqs.tokens.numel(),), -1, dtype=torch.long)
    row_of[positions] = torch.arange(positions.numel())
    hidden = torch.empty(positions.numel(), hf_model.config.hidden_size, dtype=store_dtype)
    all_hidden = (torch.zeros(seqs.tokens.numel(), hf_model.config.hidden_size, dtype=store_dtype)
                  if keep_all else None)
    device = next(hf_model.parameters()).device
    spans = list(zip(seqs.starts.tolist(), seqs.reply_starts.tolist(), seqs.ends.tolist()))
    order = sorted(range(len(spans)), key=lambda i: spans[i][2] - spans[i][0])
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            batch = [spans[i] for i in order[b:b + batch_size]]
            width = max(e - s for s, _, e in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, (s, _, e) in enumerate(batch):
                ids[j, : e - s] = seqs.tokens[s:e]
                mask[j, : e - s] = 1
            out = hf_model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            out = out.to(store_dtype).cpu()  # [B, W, D]
            for j, (s, r, e) in enumerate(batch):
                hidden[row_of[r - 1]: row_of[e - 1] + 1] = out[j, r - 1 - s: e - s]
                if all_hidden is not None:
                    all_hidden[s:e] = out[j, : e - s]
            if progress:
                progress("hidden states", min(1.0, (b + batch_size) / len(order)))
    seq_end = torch.repeat_interleave(seqs.ends, seqs.ends - seqs.reply_starts + 1)  # [M]
    offsets = torch.arange(num_heads)[None, :]  # [1, K]
    tgt_idx = positions[:, None] + offsets + 2  # [M, K]
    valid = tgt_idx < seq_end[:, None]
    targets = torch.where(valid, seqs.tokens[tgt_idx.clamp(max=seqs.tokens.numel() - 1)], IGNORE)
    parents = torch.where(valid, seqs.tokens[(tgt_idx - 1).clamp(max=seqs.tokens.numel() - 1)], 0)
    teacher_rows = torch.where(valid, row_of[(tgt_idx - 1).clamp(max=seqs.tokens.numel() - 1)], -1)
    if not keep_all:
        return Features(hidden, targets, parents, teacher_rows)
    counts = seqs.ends - seqs.reply_starts + 1
    row_end = torch.cumsum(counts, 0)
    seq_bounds = torch.stack((seqs.starts, seqs.ends), 1)
    row_bounds = torch.stack((row_end - counts, row_end), 1)
    following = torch.cat((seqs.tokens[1:], seqs.tokens[:1]))
    return Features(hidden, targets, parents, teacher_rows, all_hidden, seq_bounds, row_bounds, following)
