"""Issue 22, offline: what a second lookup chain rooted k tokens down the heads' accepted path could add.

Reads the held-out replies a calibration decoded (``heldout.safetensors`` in a heads folder after
``specmemo calibrate``) and walks greedy decoding over them as the calibration does
(``calibrate.walked_tokens_per_step``): a step at position g reaches max(the grown tree's accepted depth
d, the root's chain), and with the oracle also k + the chain drafted at g + k wherever d ≥ k — as if a
second chain hung from the right depth-k node (an upper bound: a tree would have to guess that node).
Prints one JSON object of walked tokens per step.

    python scripts/second_chain_oracle.py HEADS_FOLDER
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specmemo_core.tools.train.calibrate import lookup_lengths, walked_tokens_per_step
from specmemo_core.tools.train.distill import Sequences
from specmemo_core.tools.train.pipeline import heldout_drafts, read_sequences, trainer_model


def shifted(values: torch.Tensor, seqs: Sequences, k: int) -> torch.Tensor:
    """``values`` (one row per reply position, ``walked_tokens_per_step``'s order) k positions on, within each
    reply (0 past its end)."""
    out, first = torch.zeros_like(values), 0
    for r, e in zip(seqs.reply_starts.tolist(), seqs.ends.tolist()):
        m = e - r + 1
        out[first:first + m - k] = values[first + k:first + m]
        first += m
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded, hf = trainer_model("default", "cpu", None, dtype=torch.float32)
    seqs = read_sequences(args.heads / "heldout.safetensors")
    grown = heldout_drafts(args.heads, loaded, hf, seqs, device="cpu").grown("cpu")
    out = {}
    for n, count in ((32, 32), (40, 24), (48, 16)):
        depth, chain = grown(n), lookup_lengths(seqs, count)
        reach = torch.maximum(depth, chain)
        out[f"dynamic-{n}+lookup-{count}"] = walked_tokens_per_step(reach, seqs)
        for k in (1, 2):
            second = torch.where(depth >= k, k + shifted(chain, seqs, k), torch.zeros_like(depth))
            out[f"dynamic-{n}+lookup-{count}, a second chain at depth {k} (oracle)"] = walked_tokens_per_step(
                torch.maximum(reach, second), seqs)
    print(json.dumps({k: round(v, 4) for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
