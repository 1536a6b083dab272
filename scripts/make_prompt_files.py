"""Write the ShareGPT prompt files (train / held-out split): the first two user turns of
each conversation whose first prompt fits 512 tokens (train-heads --turns 2 answers both).

The GPU machine cannot reach PyPI, so the prompts travel with the job:
    python scripts/make_prompt_files.py .payload
"""

import json
import sys
from pathlib import Path

from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.storage.datasets import sharegpt_conversations
from specmemo_core.storage.sources import load_model
from specmemo_core.tools.train.distill import user_turns


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_model("default").tokenizer
    conversations = sharegpt_conversations()
    for held_out, name in ((False, "train"), (True, "heldout")):
        kept = [turns for turns in user_turns(conversations, held_out, 2)
                if len(encode_conversation(tokenizer, [{"role": "user", "content": turns[0]}])) <= 512]
        with open(folder / f"{name}.jsonl", "w") as f:
            for turns in kept:
                f.write(json.dumps({"turns": turns}) + "\n")
        print(name, len(kept), "conversations,", sum(len(t) for t in kept), "turns")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".payload")
