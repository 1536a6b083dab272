"""Train draft heads on a frozen base model's features (self-distillation).

Head k learns the base model's own next-token distribution k + 1 places past the
current one: a soft-target cross-entropy against softmax(LM head(h_{g+k+1})), which for
greedy-distilled replies peaks at the target token but also ranks the runners-up — the
ranks a speculation tree spends its nodes on. Losses are weighted 0.8^k (as Medusa
does) so the nearer, more useful heads dominate.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specmemo_core.runtime.heads import DraftHeads, HeadsSpec, HydraHeads, new_heads
from specmemo_core.tools.train.features import IGNORE, Features

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 4000
    batch_size: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 50
    loss_decay: float = 0.8
    seed: int = 0
    checkpoint_every: int = 500
    # True: match the base model's own distribution (self-distillation); False: the
    # token in the data (for data the base model did not write itself).
    soft_targets: bool = True


def head_states(heads: DraftHeads, h: torch.Tensor, parents: torch.Tensor, embed: nn.Embedding) -> list[torch.Tensor]:
    """Every head's final hidden state [B, D] at base hidden h [B, D]; ``parents`` [B, K]
    are the true tokens along the path (the root's first), used by hydra heads."""
    if isinstance(heads, HydraHeads):
        return heads.chain(h, embed(parents))
    return [blocks(h) for blocks in heads.blocks]


Rope = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [T] -> cos, sin [T, hd]


def context_rows(heads: DraftHeads, feats: Features, rope: Rope, seq_ids: torch.Tensor,
                 device: str | torch.device, *, all_hidden: torch.Tensor | None = None,
                 embed: nn.Embedding | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Training rows of sequences ``seq_ids`` [n] and the context layer's output there [n, D].

    Each sequence runs whole (prompt included) through the context layer, as the decoder
    runs every committed token; a sequence's training rows are its last positions (the
    last prompt token and the reply), so they are the tail of its output. ``all_hidden``:
    ``feats.all_hidden`` already on ``device`` (copied once, not every step). ``embed``: the
    base model's token embedding, for a context layer that reads each position's next token.
    """
    all_hidden = feats.all_hidden if all_hidden is None else all_hidden
    bounds, rbounds = feats.seq_bounds[seq_ids], feats.row_bounds[seq_ids]
    lengths = (bounds[:, 1] - bounds[:, 0]).tolist()
    width = max(lengths)
    reads_next = heads.context.reads_next
    if reads_next and (embed is None or feats.all_next is None):
        raise ValueError("a context layer that reads next tokens needs the embedding and features with keep_all")
    x = torch.zeros(len(lengths), width, all_hidden.shape[1], device=device)
    following = torch.zeros(len(lengths), width, dtype=torch.long, device=device) if reads_next else None
    for j, (start, end) in enumerate(bounds.tolist()):
        x[j, : end - start] = all_hidden[start:end].to(device).float()
        if following is not None:
            following[j, : end - start] = feats.all_next[start:end].to(device)
    next_emb = embed(following).float() if following is not None else None
    cos, sin = rope(torch.arange(width, device=device))
    out = heads.context.forward_batch(x, cos.float(), sin.float(), next_emb)  # [B, W, D]
    rows, states = [], []
    for j, ((r0, r1), n) in enumerate(zip(rbounds.tolist(), lengths)):
        rows.append(torch.arange(r0, r1))
        states.append(out[j, n - (r1 - r0): n])
    return torch.cat(rows).to(device), torch.cat(states)


@torch.inference_mode()
def context_hidden(heads: DraftHeads, feats: Features, rope: Rope, device: str | torch.device,
                   seqs_per_batch: int = 32, embed: nn.Embedding | None = None) -> torch.Tensor:
    """The context layer's output at every training row [M, D] (for calibration)."""
    out = torch.empty(feats.hidden.shape, dtype=torch.float32)
    for b in range(0, feats.seq_bounds.shape[0], seqs_per_batch):
        rows, states = context_rows(heads, feats, rope, torch.arange(b, min(b + seqs_per_batch,
                                                                            feats.seq_bounds.shape[0])), device,
                                    embed=embed)
        out[rows.cpu()] = states.float().cpu()
    return out


def _sequence_batch(step: int, feats: Features, cfg: TrainConfig) -> torch.Tensor:
    """Sequences for one step, about ``batch_size`` training rows in all; deterministic."""
    s = feats.seq_bounds.shape[0]
    mean_rows = float((feats.row_bounds[:, 1] - feats.row_bounds[:, 0]).float().mean())
    per_step = max(1, min(s, round(cfg.batch_size / max(mean_rows, 1.0))))
    per_epoch = max(1, s // per_step)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
    return perm[i * per_step:(i + 1) * per_step]


def head_lm(heads: DraftHeads, k: int, lm_head: nn.Linear) -> nn.Linear:
    return heads.lm_heads[k] if heads.lm_heads is not None else lm_head


def _batch_indices(step: int, m: int, cfg: TrainConfig) -> torch.Tensor:
    """Deterministic for (seed, step), so a resumed run sees the same batches."""
    per_epoch = max(1, m // cfg.batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(m, generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
    return perm[i * cfg.batch_size:(i + 1) * cfg.batch_size]


def _lr(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class _Batch:
    """The training tensors on the device (``Features`` moved once)."""

    hidden: torch.Tensor  # [M, D]
    all_hidden: torch.Tensor | None
    targets: torch.Tensor  # [M, K]
    parents: torch.Tensor  # [M]
    teacher_rows: torch.Tensor  # [M, K]


def _resume(ckpt: Path | None, heads: nn.Module, opt: torch.optim.Optimizer, device: str | torch.device) -> int:
    """The step to start from: a checkpoint's, after loading it, else 0."""
    if ckpt is None or not ckpt.exists():
        return 0
    state = torch.load(ckpt, map_location=device, weights_only=True)
    heads.load_state_dict(state["heads"])
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def _save_checkpoint(ckpt: Path, heads: nn.Module, opt: torch.optim.Optimizer, done: int) -> None:
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    tmp = ckpt.with_suffix(".tmp")
    torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "step": done}, tmp)
    tmp.replace(ckpt)


def _step_loss(heads: DraftHeads, step: int, data: _Batch, *, feats: Features, spec: HeadsSpec,
               io: tuple[nn.Embedding, nn.Linear], cfg: TrainConfig, rope: Rope | None,
               device: str | torch.device) -> torch.Tensor:
    """The weighted distillation loss of one batch over every head."""
    embed, lm_head = io
    loss = torch.zeros((), device=device)
    if spec.has_context:
        idx, h = context_rows(heads, feats, rope, _sequence_batch(step, feats, cfg), device,
                              all_hidden=data.all_hidden, embed=embed)
    else:
        idx = _batch_indices(step, data.hidden.shape[0], cfg).to(device)
        h = data.hidden[idx].float()  # [B, D]
    states = head_states(heads, h, data.parents[idx], embed)  # K x [B, D]
    for k in range(spec.num_heads):
        ok = data.targets[idx, k] != IGNORE  # [B]
        if not ok.any():
            continue
        rows = idx[ok]
        student = head_lm(heads, k, lm_head)(states[k][ok]).float()  # [b, V]
        weight = cfg.loss_decay ** k
        if cfg.soft_targets:
            with torch.no_grad():
                teacher = F.softmax(lm_head(data.hidden[data.teacher_rows[rows, k]].float()).float(), dim=-1)  # [b, V]
            loss = loss + weight * -(teacher * F.log_softmax(student, dim=-1)).sum(-1).mean()
        else:
            loss = loss + weight * F.cross_entropy(student, data.targets[rows, k])
    return loss


def train_heads(
    feats: Features, spec: HeadsSpec, embed: nn.Embedding, lm_head: nn.Linear, cfg: TrainConfig, *,
    out_dir: Path | None = None, device: str | torch.device = "cpu",
    progress: Callable[[str, float], None] | None = None, log: Callable[[str], None] | None = None,
    rope: Rope | None = None,
) -> DraftHeads:
    """Train ``spec.num_heads`` heads; resumes from ``out_dir/checkpoint.pt`` if present.

    Heads with a context layer train on whole sequences (``feats`` built with
    ``keep_all``; ``rope`` gives the base model's rotary tables), the rest on positions."""
    if spec.has_context and (feats.all_hidden is None or rope is None):
        raise ValueError("heads with a context layer need features built with keep_all=True and a rope")
    torch.manual_seed(cfg.seed)
    heads = new_heads(spec).to(device).train()
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out_dir / CHECKPOINT_NAME if out_dir else None
    start = _resume(ckpt, heads, opt, device)
    if spec.context_next:  # read at every step: on the device once, as the hidden states are
        feats = dataclasses.replace(feats, all_next=feats.all_next.to(device))
    data = _Batch(feats.hidden.to(device), feats.all_hidden.to(device) if spec.has_context else None,
                  *(t.to(device) for t in (feats.targets, feats.parents, feats.teacher_rows)))
    io = (embed.to(device), lm_head.to(device))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else None
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        with autocast if autocast else torch.enable_grad():
            loss = _step_loss(heads, step, data, feats=feats, spec=spec, io=io, cfg=cfg, rope=rope, device=device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        done = step + 1
        if progress:
            progress("training heads", done / cfg.steps)
        if log and (done % 200 == 0 or done == cfg.steps):
            log(f"step {done}/{cfg.steps} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)")
        if ckpt is not None and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
            _save_checkpoint(ckpt, heads, opt, done)
    return heads.eval().requires_grad_(False)
