"""What several ``specmemo`` commands share: model options, the progress bar, checks made before loading."""

from __future__ import annotations

import argparse
import sys

import torch

from specmemo_core.errors import SpecMemoError, SplitError
from specmemo_core.runtime.decoding import GenerationConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StageProgress:
    """A tqdm bar per named stage on stderr, so a slow load never looks like a hang. Where
    stderr is not a terminal (a log file, a pipe, a script's capture) a bar's redraws would
    pile up as hundreds of carriage returns on one line: there each stage is one line."""

    def __init__(self, *, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.stage: str | None = None
        self.bar = None
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, stage: str, fraction: float) -> None:
        if stage != self.stage:
            self.close()
            self.stage = stage
            if not self.terminal:
                print(stage, file=self.stream, flush=True)
                return
            from tqdm import tqdm

            self.bar = tqdm(total=100, desc=stage, file=self.stream, leave=False,
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")
        if self.bar is not None:
            self.bar.n = int(round(100 * min(max(fraction, 0.0), 1.0)))
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "StageProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def device_default() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0 or absent: chosen from the cores this process may use and "
                        "how busy they are)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options of the commands that load a model and chat with it (chat, generate)."""
    p.add_argument("--model", default="default", help="'default', a .gguf file or a Hugging Face model folder")
    p.add_argument("--heads", default="auto",
                   help="'auto' (heads trained here by speed-up, else shipped ones), 'none', 'random', "
                        "or a heads folder/file")
    p.add_argument("--tree", default="auto",
                   help="'auto' (the planner's choice), or force a tree: a name (medusa-64, 1-10-16-17, "
                        "calibrated-N, …) or a JSON file")
    p.add_argument("--no-spec", action="store_true", help="plain greedy/sampled decoding, no speculation")
    p.add_argument("--dtype", "--precision", dest="dtype", choices=["auto", *sorted(DTYPES), "int8", "int4"],
                   default="auto",
                   help="'auto' (the planner's precision, as in the app and `plan`: int4 for a 4-bit GGUF on a CPU, "
                        "bf16 on a GPU and on a CPU with bf16 matrix units, else fp32), or force one")
    p.add_argument("--backend", choices=["auto", "torch", "native", "llamacpp"], default="auto",
                   help="what runs the model's forward: 'auto' (for a 4-bit GGUF on a CPU our C forward over its "
                        "blocks, 'native', built once with the system's C compiler, else llama.cpp where "
                        "llama-cpp-python is installed; elsewhere ours in torch), or force one")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N, mps (default: the best one found)")
    add_devices_arg(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--context", type=int, default=None,
                   help="KV cache size in tokens (default: the plan's; at most the model's trained context)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="static-shape decoding replayed as CUDA graphs (default: on for CUDA, off for CPU)")
    p.add_argument("--compile", action="store_true",
                   help="CUDA: compile the decoder layers with torch.compile (~10%% faster steps; the first reply "
                        "waits ~10 s while it compiles)")
    add_threads_arg(p)


def add_devices_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", default=None, metavar="N,N,…",
                   help="GPUs the model may split its layers over, by number (e.g. 0,1): a model no single card "
                        "holds runs split over them; default: one device (--device)")


def parse_devices(text: str | None) -> tuple[int, ...]:
    """``--devices`` as GPU numbers, each once and in order; None: not given. Checked before
    anything loads (``SplitError`` saying what to type)."""
    if text is None:
        return ()
    items = [item.strip().removeprefix("cuda:") for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        raise SplitError(f"--devices takes GPU numbers separated by commas, e.g. 0,1 (see `specmemo devices`); "
                         f"got {text!r}")
    numbers = tuple(int(item) for item in items)
    if len(set(numbers)) != len(numbers):
        raise SplitError(f"--devices names a GPU twice ({text!r}): name each card once, e.g. 0,1")
    return numbers


LONGEST_CONTEXT = 131_072  # tokens: the longest context of the models SpecMemo plans for (Llama 3.1, Qwen 2.5)


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """Checked before the model loads, so a typo costs no loading time."""
    if args.max_new_tokens < 1:
        raise SpecMemoError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.max_new_tokens >= LONGEST_CONTEXT:  # any model's context: refused before loading one
        raise SpecMemoError(f"--max-new-tokens {args.max_new_tokens} cannot fit any model's context (at most "
                            f"{LONGEST_CONTEXT} tokens, the prompt included); ask for fewer")
    if args.context is None:
        return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.context < 2:
        raise SpecMemoError(f"--context must be at least 2 tokens, got {args.context}")
    if args.max_new_tokens >= args.context:
        raise SpecMemoError(f"--max-new-tokens {args.max_new_tokens} cannot fit a context of {args.context} "
                            f"tokens (the prompt needs room too); ask for fewer, or raise --context")
    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
