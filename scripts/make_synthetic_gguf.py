"""Write a Llama-3-8B-shaped GGUF of random weights, to measure loading a large model.

    python scripts/make_synthetic_gguf.py /tmp/synth/llama3-8b-shaped.Q4_0.gguf [--kind Q4_0|Q8_0]

Shape and metadata are Llama-3-8B's (llama architecture, 32 layers, hidden 4096,
intermediate 14336, 32 heads, 8 key/value heads, vocabulary 128256, RoPE theta 500000,
untied LM head). Weights: every matrix is random Q4_0 (or Q8_0) blocks, made from random
block fields (``tools/synthetic_gguf.random_blocks``: random 4-bit codes, fp16 scales
chosen so the weights have a standard deviation of about 0.02); norms are ones. Q4_0:
4.52 GB, written in ~20 s on 2 cores a tensor at a time (peak RSS 0.93 GB).

Tokenizer: the default model's (SmolLM2: gpt2-style BPE of 49152 tokens and its merges,
ChatML chat template), padded with control tokens ``<|reserved_N|>`` to 128256 ids, as
Llama 3 reserves its unused ids. Llama 3's own vocabulary is not shipped with the app and
a made-up BPE would prove nothing more: what is measured is the weights.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from specmemo_core.storage.sources import ensure_default_model
from specmemo_core.tools.synthetic_gguf import LLAMA3_8B, UNIT_SCALE, TokenizerFields, random_blocks, write_llama_gguf

WEIGHT_SD = 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=("Q4_0", "Q8_0"), default="Q4_0")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    scale = UNIT_SCALE[args.kind] * WEIGHT_SD

    def matrix(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return random_blocks(args.kind, (shape[0], shape[1]), rng, scale)

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} tensors", end="", file=sys.stderr, flush=True)

    tokenizer = TokenizerFields.from_gguf(ensure_default_model()).padded(LLAMA3_8B.vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_llama_gguf(args.out, LLAMA3_8B, tokenizer, matrix, kind=args.kind, progress=progress)
    print(f"\nwrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
