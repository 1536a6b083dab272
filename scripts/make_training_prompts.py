"""Write the prompt files that ship with the app for training draft heads ("Speed up this model").

- ``assets/prompts/heads_training.jsonl.gz``: the first ``--train`` ShareGPT V3 first turns
  of the training split (``distill.user_turns``) whose templated prompt is at most 1,024
  tokens of the default model (``generate_replies`` drops longer ones): the 8,000 replies
  the shipped heads were self-distilled on.
- ``assets/prompts/heads_heldout.jsonl.gz``: the held-out calibration mix the shipped heads
  are calibrated on (``make_calibration_prompts.calibration_prompts``).

Both are MT-Bench style JSONL (``{"turns": [...]}`` per line), gzipped.

    python scripts/make_training_prompts.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_calibration_prompts import calibration_prompts  # noqa: E402

from specmemo_core.runtime.chat import encode_conversation  # noqa: E402
from specmemo_core.storage.datasets import sharegpt_conversations  # noqa: E402
from specmemo_core.storage.sources import open_model  # noqa: E402
from specmemo_core.tools.train.distill import user_turns  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "prompts"
MAX_PROMPT_TOKENS = 1024  # generate_replies' default


def write(path: Path, conversations: list[list[str]]) -> None:
    text = "".join(json.dumps({"turns": t}, ensure_ascii=False) + "\n" for t in conversations)
    with gzip.GzipFile(path, "wb", mtime=0) as f:  # mtime 0: the same bytes every run
        f.write(text.encode("utf-8"))
    print(f"{len(conversations)} conversations → {path} ({path.stat().st_size:,} bytes)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=8000)
    args = p.parse_args()
    tokenizer = open_model("default").tokenizer
    fits = (t for t in user_turns(sharegpt_conversations(), held_out=False)
            if len(encode_conversation(tokenizer, [{"role": "user", "content": t[0]}])) <= MAX_PROMPT_TOKENS)
    train = [t for _, t in zip(range(args.train), fits)]
    ASSETS.mkdir(parents=True, exist_ok=True)
    write(ASSETS / "heads_training.jsonl.gz", train)
    write(ASSETS / "heads_heldout.jsonl.gz", calibration_prompts(sharegpt=140, max_chars=2000))


if __name__ == "__main__":
    main()
