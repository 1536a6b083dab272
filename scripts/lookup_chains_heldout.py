"""Issue 22 item 3, offline: what a second lookup chain that disagrees with the first would add.

Reads the held-out replies the calibration decodes (``specmemo calibrate`` keeps them as
``heldout.safetensors``: ``tokens`` with ``starts``, ``reply_starts`` and ``ends`` per
sequence, the model's own greedy replies). At every reply position the root is the
reply's next token and the conversation before it is committed; ``lookup_candidates``
drafts ``--count`` tokens in one chain (today's ``lookup-N``) and in two chains that
disagree on their first token. A chain's accepted tokens are its longest prefix that
equals the reply's continuation. Prints one JSON object: mean accepted drafts per
position for one chain and for the better of two, and how often the second chain wins.

    python scripts/lookup_chains_heldout.py HELDOUT.safetensors [--count 8]
"""

from __future__ import annotations

import argparse
import json

import torch
from safetensors.torch import load_file

from specmemo_core.runtime.lookup import lookup_candidates


def accepted(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """Longest prefix of each draft [..., K] equal to ``truth`` [..., K] (a -1 never matches)."""
    return (drafts == truth).long().cumprod(dim=-1).sum(dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("heldout")
    parser.add_argument("--count", type=int, default=8)
    args = parser.parse_args()
    data = load_file(args.heldout)
    tokens = data["tokens"].long()
    one = two = second_wins = positions = 0
    for start, reply, end in zip(data["starts"].tolist(), data["reply_starts"].tolist(), data["ends"].tolist()):
        seq = tokens[start:end]
        at = torch.arange(reply - start, len(seq) - 1)  # the root's index in seq; the committed tokens precede it
        if not len(at):
            continue
        padded = torch.cat((seq, torch.full((args.count + 1,), -1)))  # truth past the end never matches
        ids = padded.expand(len(at), -1)
        drafts = lookup_candidates(ids, at, seq[at], args.count, chains=2)  # [P, 2, count]
        truth = torch.stack([padded[i + 1:i + 1 + args.count] for i in at.tolist()])[:, None]  # [P, 1, count]
        got = accepted(drafts, truth)  # [P, 2]
        one += int(got[:, 0].sum())
        two += int(got.max(dim=1).values.sum())
        second_wins += int((got[:, 1] > got[:, 0]).sum())
        positions += len(at)
    print(json.dumps({"heldout": args.heldout, "sequences": len(data["starts"]), "positions": positions,
                      "count": args.count, "one_chain_accepted_per_position": round(one / positions, 4),
                      "best_of_two_accepted_per_position": round(two / positions, 4),
                      "second_chain_wins_share": round(second_wins / positions, 4)}, indent=1))


if __name__ == "__main__":
    main()
