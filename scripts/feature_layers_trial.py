"""Trial for issue 22 (better drafters): do hydra heads guess better when their context
layer also reads hidden states from inside the base model (EAGLE-3's fused low/mid/high
features), not only its final one?

Every variant trains the shipped recipe (hydra, 4 heads, 1 layer each, a context layer,
soft targets, the same distilled replies, batches and steps). A variant "a+b" feeds the
context layer ``h + W [norm(h_a); norm(h_b)]`` at each position, where h is the final
(normed) state, h_l the residual stream after base layer l, and W starts at zero (so it
starts as the shipped recipe). Each is then scored on the held-out mix as ``specmemo
calibrate`` scores heads: top-1 per head (given a right parent) and walked tokens per step
of calibrated and grown trees, with and without a lookup chain.

    python scripts/feature_layers_trial.py --out DIR --variants base,15,4+15 --steps 3000

DIR keeps the distilled replies (distill.safetensors, heldout.safetensors), so a second run
with other variants skips generating them; results go to DIR/trial.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specmemo_core.runtime.heads import HeadsSpec, new_heads
from specmemo_core.runtime.model import RMSNorm
from specmemo_core.planning.planner import TREE_SIZES
from specmemo_core.runtime.tree import load_tree
from specmemo_core.tools.train.calibrate import calibrate, grown_depths, head_ranks, lookup_lengths
from specmemo_core.tools.train.distill import Sequences
from specmemo_core.tools.train.features import IGNORE, Features, build_features
from specmemo_core.tools.train.pipeline import (PipelineConfig, _context_shape, _distilled, base_rope, frequent_tokens,
                                                frozen_io, trainer_model)
from specmemo_core.tools.train.trainer import TrainConfig, _lr, _sequence_batch, head_states


class Fusion(nn.Module):
    """``h + W [norm(h_a); norm(h_b); ...]``: the context layer's input from inner base layers."""

    def __init__(self, d: int, n: int, eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(d, eps) for _ in range(n))
        self.proj = nn.Linear(n * d, d, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, h: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
        """h [..., D], inner [..., n, D] → [..., D]."""
        parts = [norm(inner[..., i, :]) for i, norm in enumerate(self.norms)]
        return h + self.proj(torch.cat(parts, dim=-1))


TOKEN = 10_000  # not a layer: the next token's embedding


@torch.inference_mode()
def inner_states(hf, seqs: Sequences, wanted: list[int], emb: nn.Embedding, batch_size: int = 32) -> torch.Tensor:
    """At every position [G, n, D] (bf16), for each of ``wanted``: the residual stream after
    that base layer, or for ``TOKEN`` the next token's embedding (zero at a sequence's end)."""
    out = torch.zeros(seqs.tokens.numel(), len(wanted), hf.config.hidden_size, dtype=torch.bfloat16)
    layers = [(i, l) for i, l in enumerate(wanted) if l != TOKEN]
    if TOKEN in wanted:
        nxt = torch.cat((seqs.tokens[1:], seqs.tokens[:1]))
        col = emb(nxt.to(emb.weight.device)).to(torch.bfloat16).cpu()
        col[seqs.ends - 1] = 0
        out[:, wanted.index(TOKEN)] = col
    if not layers:
        return out
    device = next(hf.parameters()).device
    spans = list(zip(seqs.starts.tolist(), seqs.ends.tolist()))
    order = sorted(range(len(spans)), key=lambda i: spans[i][1] - spans[i][0])
    cols = [i for i, _ in layers]
    for b in range(0, len(order), batch_size):
        batch = [spans[i] for i in order[b:b + batch_size]]
        width = max(e - s for s, e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, (s, e) in enumerate(batch):
            ids[j, : e - s] = seqs.tokens[s:e]
            mask[j, : e - s] = 1
        hs = hf.model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True).hidden_states
        stacked = torch.stack([hs[l] for _, l in layers], dim=2).to(torch.bfloat16).cpu()  # [B, W, n, D]
        for j, (s, e) in enumerate(batch):
            out[s:e, cols] = stacked[j, : e - s]
    return out


def fused_rows(heads, fusion, feats: Features, inner, rope, seq_ids, device):
    """Training rows of sequences ``seq_ids`` and the context layer's output there (as
    ``trainer.context_rows``, with the fused input)."""
    bounds, rbounds = feats.seq_bounds[seq_ids], feats.row_bounds[seq_ids]
    lengths = (bounds[:, 1] - bounds[:, 0]).tolist()
    width = max(lengths)
    x = torch.zeros(len(lengths), width, feats.all_hidden.shape[1], device=device)
    xi = torch.zeros(len(lengths), width, *inner.shape[1:], device=device) if fusion is not None else None
    for j, (start, end) in enumerate(bounds.tolist()):
        x[j, : end - start] = feats.all_hidden[start:end].float()
        if xi is not None:
            xi[j, : end - start] = inner[start:end].float()
    if fusion is not None:
        x = fusion(x, xi)
    cos, sin = rope(torch.arange(width, device=device))
    out = heads.context.forward_batch(x, cos.float(), sin.float())
    rows, states = [], []
    for j, ((r0, r1), n) in enumerate(zip(rbounds.tolist(), lengths)):
        rows.append(torch.arange(r0, r1))
        states.append(out[j, n - (r1 - r0): n])
    return torch.cat(rows).to(device), torch.cat(states)


def on(device, feats: Features) -> Features:
    return dataclasses.replace(feats, hidden=feats.hidden.to(device), all_hidden=feats.all_hidden.to(device),
                               targets=feats.targets.to(device), parents=feats.parents.to(device),
                               teacher_rows=feats.teacher_rows.to(device))


def train(spec, fusion_layers, feats, inner, embed, lm_head, rope, cfg: TrainConfig, device, eps):
    torch.manual_seed(cfg.seed)
    heads = new_heads(spec).to(device).train()
    fusion = Fusion(spec.hidden_size, len(fusion_layers), eps).to(device) if fusion_layers else None
    params = list(heads.parameters()) + (list(fusion.parameters()) if fusion is not None else [])
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda" else None
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        with autocast if autocast else torch.enable_grad():
            idx, h = fused_rows(heads, fusion, feats, inner, rope, _sequence_batch(step, feats, cfg), device)
            states = head_states(heads, h, feats.parents[idx], embed)
            loss = torch.zeros((), device=device)
            for k in range(spec.num_heads):
                ok = feats.targets[idx, k] != IGNORE
                rows = idx[ok]
                student = lm_head(states[k][ok]).float()
                with torch.no_grad():
                    teacher = F.softmax(lm_head(feats.hidden[feats.teacher_rows[rows, k]].float()).float(), dim=-1)
                loss = loss + cfg.loss_decay ** k * -(teacher * F.log_softmax(student, dim=-1)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % 500 == 0 or step + 1 == cfg.steps:
            print(f"  step {step + 1}/{cfg.steps} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return heads.eval().requires_grad_(False), (fusion.eval().requires_grad_(False) if fusion else None), \
        time.perf_counter() - t0


@torch.inference_mode()
def score(heads, fusion, feats: Features, inner, heldout: Sequences, embed, lm_head, rope, device) -> dict:
    states = torch.empty(feats.hidden.shape, dtype=torch.float32, device=device)
    for b in range(0, feats.seq_bounds.shape[0], 32):
        rows, s = fused_rows(heads, fusion, feats, inner, rope, torch.arange(b, min(b + 32, feats.seq_bounds.shape[0])),
                             device)
        states[rows] = s.float()
    ranks = head_ranks(heads, feats, embed, lm_head, device=device, hidden=states)
    grown = lambda n: grown_depths(heads, feats, embed, lm_head, load_tree(f"dynamic-{n}").growth, device=device,
                                   hidden=states).cpu()
    record = calibrate(ranks.cpu(), "hydra", sequences=heldout, lookup={8: lookup_lengths(heldout, 8)},
                       sizes=[n for n in TREE_SIZES if n in (8, 16, 32, 48, 64)], grown=grown)
    return {"top1": [a[0] for a in record["topk_accuracy"]], "top5": [a[4] for a in record["topk_accuracy"]],
            "tokens_per_step": record["tokens_per_step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variants", default="base,15,4+15", help="comma-separated: base, shipped, or inner layers joined by +")
    p.add_argument("--prompts", type=int, default=4000)
    p.add_argument("--prompts-file", default="assets/prompts/heads_training.jsonl.gz")
    p.add_argument("--heldout-file", default="assets/prompts/heads_heldout.jsonl.gz")
    p.add_argument("--heldout-prompts", type=int, default=400)
    p.add_argument("--reply-tokens", type=int, default=256)
    p.add_argument("--heldout-reply-tokens", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    loaded, hf = trainer_model("default", a.device)
    cfg = PipelineConfig(context=True, train_prompts=a.prompts, prompts_file=a.prompts_file, heldout_file=a.heldout_file,
                         heldout_prompts=a.heldout_prompts, max_new_tokens=a.reply_tokens, gen_batch=a.gen_batch)
    train_seqs = _distilled(a.out, hf, loaded, cfg, False, None)
    heldout = _distilled(a.out, hf, loaded, dataclasses.replace(cfg, max_new_tokens=a.heldout_reply_tokens), True, None)
    print(f"replies: {len(train_seqs.starts)} train ({train_seqs.reply_tokens} tokens), {len(heldout.starts)} held out "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    # an inner layer l, or TOKEN: the embedding of the token after each position (known for
    # every committed position: the root follows the last)
    variants = [[] if v in ("base", "shipped") else [TOKEN if x == "tok" else int(x) for x in v.split("+")]
                for v in a.variants.split(",")]
    wanted = sorted({l for v in variants for l in v})
    feats = on(a.device, build_features(hf, train_seqs, 4, keep_all=True))
    hfeats = on(a.device, build_features(hf, heldout, 4, keep_all=True))
    emb = hf.get_input_embeddings()
    inner_t = inner_states(hf, train_seqs, wanted, emb).to(a.device) if wanted else None
    inner_h = inner_states(hf, heldout, wanted, emb).to(a.device) if wanted else None
    print(f"features ({time.perf_counter() - t0:.0f} s)", flush=True)
    vocab = loaded.config.vocab_size
    spec = HeadsSpec("hydra", 4, 1, loaded.config.hidden_size, vocab, False, loaded.identity.name,
                     loaded.identity.fingerprint, **_context_shape(cfg, loaded.config), draft_vocab=8192)
    embed, lm_head = (m.to(a.device) for m in frozen_io(hf))
    rope = base_rope(loaded.config)
    rope_dev = lambda pos: tuple(t.to(a.device) for t in rope(pos.cpu()))  # noqa: E731
    eps = loaded.config.rms_norm_eps
    results_path = a.out / "trial.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    tcfg = TrainConfig(steps=a.steps, batch_size=a.batch_size)
    for name, layers in zip(a.variants.split(","), variants):
        print(f"variant {name}", flush=True)
        if name == "shipped":  # the shipped heads, scored the same way (trained on 8,000 replies)
            from specmemo_core.runtime.heads import load_heads
            shipped = load_heads("assets/heads/SmolLM2-135M-Instruct", spec.hidden_size, vocab, device=a.device)
            shipped.use_draft_vocab(lm_head.weight)
            results[name] = score(shipped, None, hfeats, None, heldout, embed, lm_head, rope_dev, a.device)
            results_path.write_text(json.dumps(results, indent=1))
            print(f"  shipped: top1 {results[name]['top1']} {results[name]['tokens_per_step']}", flush=True)
            continue
        pick = [wanted.index(l) for l in layers]
        inner_tv = inner_t[:, pick] if layers else None
        inner_hv = inner_h[:, pick] if layers else None
        heads, fusion, secs = train(spec, layers, feats, inner_tv, embed, lm_head, rope_dev, tcfg, a.device, eps)
        heads.vocab_ids.copy_(frequent_tokens(train_seqs, vocab, 8192).to(a.device))
        heads.use_draft_vocab(lm_head.weight)
        res = score(heads, fusion, hfeats, inner_hv, heldout, embed, lm_head, rope_dev, a.device)
        res.update(steps=a.steps, prompts=len(train_seqs.starts), train_s=round(secs, 1),
                   params=sum(p.numel() for p in heads.parameters()) + (sum(p.numel() for p in fusion.parameters())
                                                                        if fusion else 0))
        results[name] = res
        results_path.write_text(json.dumps(results, indent=1))
        tps = res["tokens_per_step"]
        print(f"  {name}: top1 {res['top1']} calibrated-48+lookup-8 {tps.get('calibrated-48+lookup-8')} "
              f"dynamic-48+lookup-8 {tps.get('dynamic-48+lookup-8')} calibrated-64 {tps.get('calibrated-64')} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
