"""Check a layer split on real devices: greedy output equals one device's, and what it costs.

``python -m specmemo_core.tools.split_check --devices cuda:0,cuda:1 --json`` loads the model
twice from one read of its weights: whole on the first device, and split evenly over the
devices (``runtime/split.py``; ``cuda:0,cuda:0`` is two segments on one card, ``cpu,cpu``
the CPU path). Both run the same workload, MT-Bench's first user turns as concurrent
requests through batch decoders of each ``--batches`` size (``tools/batch_bench.py``),
plain and speculative (the planner's tree for that batch size, or ``--tree``). It reports

- ``equal``: per method, whether every reply of the split model is token for token the
  whole model's (greedy; same decoder, same batch size: the same kernels run);
- ``split``: per batch size, tokens/s of plain and speculative decoding on the split model
  over ``--repeats`` timed rounds (median, min, max) and speculation's speedup.

Exit status 1 when a reply differs. On CPU use fp32 and few tokens (the test does).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

import torch

from specmemo_core.errors import SpecMemoError, SplitError


def parse_torch_devices(text: str) -> list[torch.device]:
    """``"cuda:0,cuda:1"`` → two devices (one may repeat: segments on one card); a typed error else."""
    try:
        devices = [torch.device(part.strip()) for part in text.split(",")]
    except RuntimeError:
        devices = []
    if len(devices) < 2:
        raise SplitError(f"--devices takes two or more torch devices, e.g. cuda:0,cuda:1 or cpu,cpu; got {text!r}")
    return devices


def _requests(engine: Any, queries: int, prompt_file: str | None) -> Any:
    """The first ``queries`` user turns (of ``prompt_file``, JSONL with a 'turns' list per line, else
    MT-Bench's), each a request of its own (``batch_bench.Requests``)."""
    from specmemo_core.storage.datasets import first_queries, load_prompt_file, mtbench_conversations
    from specmemo_core.tools.batch_bench import Requests

    convs = first_queries(load_prompt_file(prompt_file), queries) if prompt_file else mtbench_conversations(queries)
    return Requests.of_conversations(engine.tokenizer, convs, history=False, max_new_tokens=0)


def check(*, model: str, heads: str, devices: Sequence[torch.device], dtype: torch.dtype, precision: str,
          batches: Sequence[int], queries: int, max_new_tokens: int, repeats: int, tree: str | None,
          prompt_file: str | None = None) -> dict:
    from specmemo_core.runtime.chat import end_of_turn_ids
    from specmemo_core.runtime.decoding import GenerationConfig
    from specmemo_core.runtime.engine import Engine, resolve_tree
    from specmemo_core.runtime.split import LayerSplit
    from specmemo_core.storage.sources import load_model
    from specmemo_core.tools.batch_bench import batch_methods, batch_report
    from specmemo_core.tools.bench import planner_choice, run_bench

    loaded = load_model(model)
    split = LayerSplit.even(devices, loaded.config.num_hidden_layers)
    parted = Engine.load(loaded, heads=heads, dtype=dtype, split=split)
    requests = _requests(parted, queries, prompt_file)
    config = GenerationConfig(max_new_tokens=max_new_tokens,
                              stop_token_ids=frozenset(end_of_turn_ids(parted.tokenizer, parted.config)))
    trees: dict[int, str | None] = {}

    def tree_for(b: int):
        if b not in trees:
            trees[b] = tree if tree is not None else planner_choice(parted, precision, max_new_tokens, batch=b).tree
        return resolve_tree(trees[b], parted.heads_folder) if trees[b] else None

    graphs = parted.model.device.type == "cuda" and parted.model.capturable  # the same decoders for both models
    kwargs = dict(batches=batches, tree_for=tree_for, config=config, graphs=graphs)
    split_methods = batch_methods(parted.model, parted.heads, requests, **kwargs)
    split_passes = run_bench(split_methods, repeats, device=split.home)
    whole = Engine.load(loaded, heads=heads, dtype=dtype, device=devices[0])
    whole_methods = batch_methods(whole.model, whole.heads, requests, **kwargs)
    whole_passes = run_bench(whole_methods, 1, warmup=0, device=devices[0])
    equal = {name: split_passes[name][-1].replies == whole_passes[name][-1].replies for name in split_passes}
    return {
        "model": parted.identity.name, "precision": precision, "devices": [str(d) for d in devices],
        "layers": list(split.layers), "graphs": graphs, "trees": {str(b): t for b, t in trees.items()},
        "queries": sum(requests.turns), "max_new_tokens": max_new_tokens, "repeats": repeats,
        "equal": equal, "all_equal": all(equal.values()),
        "split": batch_report(split_methods, split_passes),
    }


def main(argv: Sequence[str] | None = None) -> int:
    from specmemo_core.tools.batch_bench import parse_batches

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", required=True,
                   help="two or more torch devices: cuda:0,cuda:1 | cuda:0,cuda:0 | cpu,cpu")
    p.add_argument("--model", default="default")
    p.add_argument("--heads", default="auto", help="'auto' (shipped heads), 'random', or a heads folder")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--queries", type=int, default=16, help="first user turns as requests (default 16)")
    p.add_argument("--prompts", default=None, help="JSONL with a 'turns' list per line (default: MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds on the split model (default 3)")
    p.add_argument("--tree", default=None, help="speculate on this tree at every batch size (default: the planner's)")
    p.add_argument("--json", action="store_true", help="print one JSON object (else a summary)")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    args = p.parse_args(argv)
    devices = parse_torch_devices(args.devices)
    batches = parse_batches(args.batches)
    if args.repeats < 1 or args.queries < 1 or args.max_new_tokens < 1:
        raise SpecMemoError("--repeats, --queries and --max-new-tokens must be at least 1")
    precision = args.dtype or ("bf16" if devices[0].type == "cuda" else "fp32")
    result = check(model=args.model, heads=args.heads, devices=devices,
                   dtype=torch.bfloat16 if precision == "bf16" else torch.float32, precision=precision,
                   batches=batches, queries=args.queries, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                   tree=args.tree, prompt_file=args.prompts)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        print(text)
    else:
        print(f"{result['model']} split {result['layers']} over {', '.join(result['devices'])}: greedy "
              + ("equal to one device" if result["all_equal"] else f"DIFFERS {result['equal']}"))
        for b, entry in result["split"].items():
            plain, spec = entry["plain"]["tokens_per_s"], entry["speculative"]["tokens_per_s"]
            print(f"  batch {b}: plain {plain['median']} ({plain['min']}–{plain['max']}) tok/s, speculative on "
                  f"{entry['speculative']['tree']} {spec['median']} ({spec['min']}–{spec['max']}) tok/s, "
                  f"speedup {entry['speedup']}")
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
