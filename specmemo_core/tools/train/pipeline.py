"""``specmemo train-heads`` / ``calibrate`` end to end: data → features → heads → card.

Every stage writes its result into the output folder and is skipped when that result is
already there, so an interrupted run resumes where it stopped (training itself resumes
from its checkpoint).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from safetensors.torch import load_file, save_file

from specmemo_core.runtime.chat import end_of_turn_ids
from specmemo_core.storage.datasets import load_prompt_file, sharegpt_conversations
from specmemo_core.runtime.heads import DraftHeads, HeadsSpec, load_heads, save_heads
from specmemo_core.runtime.model import ModelSpec, rope_inverse_frequencies, rope_tables
from specmemo_core.storage.sources import LoadedModel, load_model
from specmemo_core.planning.planner import LOOKUP_GAIN, TREE_SIZES
from specmemo_core.runtime.tree import load_tree
from specmemo_core.tools.train.calibrate import (GrownDepths, calibrate, draft_states, grown_depths, head_ranks,
                                                 lookup_lengths, save_calibration)
from specmemo_core.tools.train.distill import Sequences, generate_replies, user_turns
from specmemo_core.tools.train.features import Features, build_features
from specmemo_core.tools.train.trainer import TrainConfig, train_heads

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class PipelineConfig:
    model: str = "default"
    kind: str = "hydra"
    num_heads: int = 4
    num_layers: int = 1
    context: bool = False  # hydra heads with a context layer (heads.py)
    context_next: bool = False  # the context layer also reads each position's next token (heads.py)
    train_prompts: int = 4000  # conversations
    turns: int = 1  # user turns answered per training conversation (multi-turn self-distillation)
    draft_vocab: int = 8192  # hydra: draft among the most frequent reply tokens (0: whole vocabulary)
    heldout_prompts: int = 300
    max_new_tokens: int = 256
    gen_batch: int = 256
    prompts_file: str | None = None  # JSONL (MT-Bench format); default: ShareGPT train split
    heldout_file: str | None = None
    train: TrainConfig = TrainConfig()


def hf_model_from(loaded: LoadedModel, device: str, dtype: torch.dtype) -> Any:
    """transformers' own model over the same weights (batched generation and features)."""
    from transformers import AutoModelForCausalLM

    from specmemo_core.storage.fast_tokenizer import transformers_config

    model = AutoModelForCausalLM.from_config(transformers_config(loaded.config), dtype=dtype)
    model.load_state_dict(loaded.state_dict, strict=False)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)


def trainer_dtype(device: str) -> torch.dtype:
    """What the base model runs in while heads are made: bf16 on a GPU, fp32 on a CPU."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def trainer_model(source: str, device: str, progress: Progress | None = None, *,
                  dtype: torch.dtype | None = None) -> tuple[LoadedModel, Any]:
    """The base model read in ``dtype`` (default: the trainer's, ``trainer_dtype``; a bf16 read
    halves the RAM of an fp32 one) and transformers' model over it on ``device``."""
    dtype = dtype or trainer_dtype(device)
    loaded = load_model(source, dtype=dtype, progress=progress)
    return loaded, hf_model_from(loaded, device, dtype)


def frozen_io(hf: Any) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    """fp32 copies of the input embedding and LM head (heads train and score in fp32)."""
    emb = hf.get_input_embeddings().weight.detach().float()
    head = hf.get_output_embeddings().weight.detach().float()
    lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False, device=head.device)
    lm_head.weight = torch.nn.Parameter(head, requires_grad=False)
    return torch.nn.Embedding.from_pretrained(emb, freeze=True), lm_head


def _conversations(cfg: PipelineConfig, held_out: bool) -> list[list[str]]:
    """User turns of the training (or held-out) conversations: ``cfg.turns`` per
    conversation for training; held-out ShareGPT stays on first turns, a held-out file
    keeps every turn it gives (second turns are where lookup chains pay)."""
    file = cfg.heldout_file if held_out else cfg.prompts_file
    limit = cfg.heldout_prompts if held_out else cfg.train_prompts
    turns = 1 if held_out else cfg.turns
    if file:  # a held-out file's conversations are answered turn by turn, as written
        return [t if held_out else t[:turns] for t in load_prompt_file(file)][:limit]
    return user_turns(sharegpt_conversations(), held_out, turns)[:limit]


def read_sequences(path: Path) -> Sequences:
    """Replies kept by ``_sequences`` (distill.safetensors / heldout.safetensors)."""
    return Sequences.from_dict({k: v.long() for k, v in load_file(str(path)).items()})


def _sequences(path: Path, make: Callable[[], Sequences]) -> Sequences:
    if path.exists():
        return read_sequences(path)
    seqs = make()
    tmp = path.with_suffix(".tmp")
    save_file({k: v.to(torch.int32) for k, v in seqs.to_dict().items()}, str(tmp))
    tmp.replace(path)
    return seqs


def _distilled(folder: Path, hf: Any, loaded: LoadedModel, cfg: PipelineConfig, held_out: bool,
               progress: Progress | None) -> Sequences:
    """The model's own replies to the training (or held-out) conversations, generated once
    and kept in ``folder`` (distill.safetensors / heldout.safetensors)."""
    stops = sorted(end_of_turn_ids(loaded.tokenizer, loaded.config))
    name = "heldout.safetensors" if held_out else "distill.safetensors"
    return _sequences(folder / name, lambda: generate_replies(
        hf, loaded.tokenizer, _conversations(cfg, held_out), max_new_tokens=cfg.max_new_tokens,
        batch_size=cfg.gen_batch, stop_ids=stops, progress=progress))


def _context_shape(cfg: PipelineConfig, config: Any) -> dict[str, int]:
    """A context layer with the base model's attention shape and an MLP as wide as D."""
    if not cfg.context:
        return {}
    spec = ModelSpec.from_config(config)
    return {"context_mlp": spec.hidden_size, "context_heads": spec.num_heads,
            "context_kv_heads": spec.num_kv_heads, "context_head_dim": spec.head_dim, "context_next": cfg.context_next}


def frequent_tokens(seqs: Sequences, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` most frequent reply tokens (ties by id), most frequent first: the
    heads' drafting vocabulary."""
    spans = [seqs.tokens[a:b] for a, b in zip(seqs.reply_starts.tolist(), seqs.ends.tolist())]
    counts = torch.bincount(torch.cat(spans), minlength=vocab_size) if spans else torch.zeros(vocab_size)
    return torch.sort(counts, descending=True, stable=True).indices[:count]


def base_rope(config: Any) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The base model's rotary tables as a function of positions (float32)."""
    inv_freq, scale = rope_inverse_frequencies(config)
    return lambda positions: rope_tables(inv_freq, scale, positions, torch.float32)


def run_training(cfg: PipelineConfig, out: Path, device: str, progress: Progress | None = None,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    loaded, hf = trainer_model(cfg.model, device, progress)
    t0 = time.perf_counter()
    train_seqs = _distilled(out, hf, loaded, cfg, False, progress)
    log(f"distilled {len(train_seqs.starts)} replies, {train_seqs.reply_tokens} tokens ({time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    feats = build_features(hf, train_seqs, cfg.num_heads, progress=progress, keep_all=cfg.context)
    log(f"features: {feats.hidden.shape[0]} positions ({time.perf_counter() - t0:.0f} s)")
    vocab = loaded.config.vocab_size
    draft_vocab = min(cfg.draft_vocab, vocab) if cfg.kind == "hydra" else 0
    spec = HeadsSpec(cfg.kind, cfg.num_heads, cfg.num_layers, loaded.config.hidden_size, vocab,
                     False, loaded.identity.name, loaded.identity.fingerprint, **_context_shape(cfg, loaded.config),
                     draft_vocab=draft_vocab)
    embed, lm_head = frozen_io(hf)
    t0 = time.perf_counter()
    heads = train_heads(feats, spec, embed, lm_head, cfg.train, out_dir=out, device=device, progress=progress,
                        log=log, rope=base_rope(loaded.config))
    train_s = time.perf_counter() - t0
    if draft_vocab:
        heads.vocab_ids.copy_(frequent_tokens(train_seqs, vocab, draft_vocab))
    save_heads(heads.float(), out, dtype=torch.bfloat16)
    del feats
    heldout = _distilled(out, hf, loaded, cfg, True, progress)
    record = run_calibration(out, loaded, hf, cfg, device=device, progress=progress, heldout=heldout)
    card = {
        "model": loaded.identity.name, "model_fingerprint": loaded.identity.fingerprint,
        "kind": cfg.kind, "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "context_layer": cfg.context,
        "context_next": cfg.context_next,
        "data": f"{Path(cfg.prompts_file).name if cfg.prompts_file else 'ShareGPT V3 (train split)'}, "
                f"up to {cfg.turns} user turn(s) per conversation, {len(train_seqs.starts)} replies, "
                f"{train_seqs.reply_tokens} tokens self-distilled (greedy, ≤{cfg.max_new_tokens} new tokens)",
        "train": asdict(cfg.train), "seed": cfg.train.seed, "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "hardware": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
        "heldout_top1": [acc[0] for acc in record["topk_accuracy"]],
        "expected_accepted": record["expected_accepted"],
    }
    (out / "card.json").write_text(json.dumps(card, indent=1))
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():
        ckpt.unlink()  # training finished: the heads file is the result
    return card


@dataclass(frozen=True)
class HeldoutDrafts:
    """What a calibration reads from held-out replies: the heads of a folder, the replies'
    features, the base model's embedding and LM head, and the heads' draft states at every
    position (computed once, for the fixed and the grown trees)."""

    heads: DraftHeads
    feats: Features
    embed: nn.Embedding
    lm_head: nn.Linear
    hidden: torch.Tensor

    def grown(self, device: str) -> GrownDepths | None:
        return grown_calibration(self.heads, self.feats, self.embed, self.lm_head, device=device, hidden=self.hidden)


def heldout_drafts(folder: Path, loaded: LoadedModel, hf: Any, heldout: Sequences, *, device: str,
                   progress: Progress | None = None) -> HeldoutDrafts:
    heads = load_heads(folder, loaded.config.hidden_size, loaded.config.vocab_size, loaded.identity.fingerprint,
                       device=device)
    feats = build_features(hf, heldout, heads.num_heads, progress=progress, keep_all=heads.spec.has_context)
    embed, lm_head = frozen_io(hf)
    hidden = draft_states(heads, feats, base_rope(loaded.config), device, embed)
    return HeldoutDrafts(heads, feats, embed, lm_head, hidden)


def run_calibration(folder: Path, loaded: LoadedModel, hf: Any, cfg: PipelineConfig, *, device: str,
                    progress: Progress | None, heldout: Sequences) -> dict[str, Any]:
    d = heldout_drafts(folder, loaded, hf, heldout, device=device, progress=progress)
    ranks = head_ranks(d.heads, d.feats, d.embed, d.lm_head, device=device, hidden=d.hidden)
    record = calibrate(ranks, d.heads.spec.kind, sequences=heldout,
                       lookup={n: lookup_lengths(heldout, n) for n in LOOKUP_GAIN}, sizes=TREE_SIZES,
                       grown=d.grown(device))
    save_calibration(record, folder)
    return record


def calibrate_folder(folder: Path, cfg: PipelineConfig, device: str, progress: Progress | None = None, *,
                     dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``specmemo calibrate``: held-out replies (reused if present) → calibration.json, with the
    base model in ``dtype`` (default: the trainer's; fp32 on a GPU reproduces a CPU's replies)."""
    loaded, hf = trainer_model(cfg.model, device, progress, dtype=dtype)
    heldout = _distilled(folder, hf, loaded, cfg, True, progress)
    return run_calibration(folder, loaded, hf, cfg, device=device, progress=progress, heldout=heldout)


def grown_calibration(heads: DraftHeads, feats: Features, embed: nn.Embedding, lm_head: nn.Linear, *, device: str,
                      hidden: torch.Tensor) -> GrownDepths | None:
    """``calibrate``'s grown trees: ``dynamic-n``'s accepted depths at every held-out row,
    over the draft states ``hidden``; None for medusa heads, and None for a size whose
    grown tree the heads cannot draft (``Tree.fits_heads``)."""
    if heads.spec.kind != "hydra":
        return None

    def depths(n: int) -> torch.Tensor | None:
        tree = load_tree(f"dynamic-{n}")
        if not tree.fits_heads(heads):
            return None
        return grown_depths(heads, feats, embed, lm_head, tree.growth, device=device, hidden=hidden)

    return depths
