"""``specmemo`` command line: chat, generate (more subcommands join as they are built)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .chat import ChatSession
from .decoding import GenerationConfig
from .errors import SpecMemoError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StageProgress:
    """A tqdm bar per named stage on stderr, so a slow load never looks like a hang."""

    def __init__(self) -> None:
        self.stage: str | None = None
        self.bar = None

    def __call__(self, stage: str, fraction: float) -> None:
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage = stage
            self.bar = tqdm(total=100, desc=stage, file=sys.stderr, leave=False,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")
        self.bar.n = int(round(100 * min(max(fraction, 0.0), 1.0)))
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@dataclass
class ReplyStats:
    """Totals over one reply, for --json and the status line."""

    new_tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # verify steps after the prefill
    drafted: int = 0  # tokens those steps emitted before stop cuts
    text: str = ""
    step_times: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {"text": self.text, "new_tokens": self.new_tokens, "seconds": round(self.seconds, 4),
                "tokens_per_s": round(self.tokens_per_s, 3), "mean_accepted": round(self.mean_accepted, 4),
                "steps": self.steps}


def stream_reply(session: ChatSession, text: str, config: GenerationConfig,
                 on_text: Callable[[str], None] | None = None,
                 cancel: threading.Event | None = None) -> ReplyStats:
    """Send one message and collect statistics from the decoder's steps."""
    stats = ReplyStats()
    start = time.perf_counter()
    for piece in session.send(text, config, cancel):
        step = piece.step
        stats.new_tokens += len(step.token_ids)
        if step.accepted and not step.prefill:
            stats.steps += 1
            stats.drafted += step.accepted
            stats.step_times.append(step.forward_s)
        if piece.text and on_text:
            on_text(piece.text)
        stats.text += piece.text
    stats.seconds = time.perf_counter() - start
    return stats


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a .gguf file or a Hugging Face model folder")
    p.add_argument("--heads", default="auto", help="'auto' (shipped heads), 'none', 'random', or a heads folder/file")
    p.add_argument("--tree", default="medusa-64", help="tree name (medusa-64, 1-10-16-17, …) or JSON file")
    p.add_argument("--no-spec", action="store_true", help="plain greedy/sampled decoding, no speculation")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--context", type=int, default=4096, help="KV cache size in tokens")
    p.add_argument("--system", default=None, help="system prompt")


def _engine(args: argparse.Namespace):
    from .engine import Engine

    progress = StageProgress()
    try:
        return Engine.load(args.model, heads="none" if args.no_spec else args.heads,
                           tree=None if args.no_spec else args.tree,
                           dtype=DTYPES[args.dtype], device=args.device, progress=progress)
    finally:
        progress.close()


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _engine(args)
    session = engine.new_session(args.context, args.system, speculate=not args.no_spec)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    echo = None if args.json else (lambda s: print(s, end="", flush=True))
    stats = stream_reply(session, args.prompt, config, echo)
    if args.json:
        print(json.dumps(stats.as_dict()))
    else:
        print(f"\n[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
              f"{stats.mean_accepted:.2f} tokens/step]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _engine(args)
    session = engine.new_session(args.context, args.system, speculate=not args.no_spec)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    mode = f"speculative, tree {engine.tree.name}" if engine.speculative and not args.no_spec else "plain decoding"
    print(f"SpecMemo chat — {engine.identity.name} ({mode}). Empty line or Ctrl-D quits; Ctrl-C stops a reply.",
          file=sys.stderr)
    while True:
        try:
            text = input("\nyou> ")
        except EOFError:
            break
        if not text.strip():
            break
        print("bot> ", end="", flush=True)
        cancel = threading.Event()
        try:
            stats = stream_reply(session, text, config, lambda s: print(s, end="", flush=True), cancel)
        except KeyboardInterrupt:
            cancel.set()
            print("\n[stopped]", file=sys.stderr)
            continue
        except SpecMemoError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            continue
        print(f"\n[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, "
              f"{stats.mean_accepted:.2f} tokens/step]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmemo", description="Local chat with memory-aware speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="multi-turn chat in the terminal")
    _add_model_args(chat)
    chat.set_defaults(func=cmd_chat)
    gen = sub.add_parser("generate", help="one reply to one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--json", action="store_true", help="print one JSON object with the reply and its speed")
    _add_model_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecMemoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
