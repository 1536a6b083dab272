"""Peak memory and time of loading a GGUF into a planned precision, first and second start.

    python scripts/measure_load.py /tmp/synth/llama3-8b-shaped.Q4_0.gguf --precision int4 \
        --out docs/results/synthetic_8b_load_cpu.json

Each start is a fresh process (``--one-start``) loading the file with ``Engine.load`` on
the CPU, as ``specmemo chat --dtype int4`` does, then producing one greedy token after
"Hello" (a chat-templated prompt is ~30 tokens: minutes of prefill for this CPU's int4
kernel). The first start uses an empty data folder (the file is hashed, its header parsed
and cached, its decoder weights quantized and kept: ``storage/quantized_cache.py``); the
second, the same folder. Peak RSS is the process's ``ru_maxrss`` (what ``/usr/bin/time -v``
reports as "Maximum resident set size"). The file's pages are in the OS's file cache on
the second start, as on a user's second start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def one_start(path: Path, precision: str) -> dict:
    import torch

    from specmemo_core.runtime.decoding import Decoder, GenerationConfig
    from specmemo_core.planning.memory import ModelShape, weight_bytes
    from specmemo_core.runtime.engine import Engine
    from specmemo_core.runtime.quantize import held_bytes, linear_weight_bytes

    start = time.perf_counter()
    engine = Engine.load(path, heads="none", precision=precision, device="cpu")
    seconds = time.perf_counter() - start
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    prompt = engine.tokenizer.encode("Hello")  # short: 2 cores run an 8B int4 forward at ~10 s a token
    decoder = Decoder(engine.model, engine.model.new_cache(len(prompt) + 2))
    step_start = time.perf_counter()
    token = [t for s in decoder.generate(prompt, GenerationConfig(max_new_tokens=1)) for t in s.token_ids]
    largest = max(p.numel() for p in engine.model.parameters() if p.dtype.is_floating_point) * 4
    return {
        "load_seconds": round(seconds, 2),
        "peak_rss_bytes_after_load": load_peak,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "weight_bytes": held_bytes(engine.model),  # every weight as held: int4 layers, fp32 embedding and LM head
        "quantized_layer_bytes": linear_weight_bytes(engine.model),
        "planner_weight_bytes": weight_bytes(ModelShape.from_spec(engine.model.spec, engine.identity.name), precision,
                                             device_kind="cpu"),
        "largest_tensor_fp32_bytes": largest,
        "prompt_tokens": len(prompt),
        "greedy_token": token,
        "greedy_token_text": engine.tokenizer.decode(token),
        "first_token_seconds": round(time.perf_counter() - step_start, 2),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--precision", default="int4", choices=("bf16", "fp32", "int8", "int4"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one-start", action="store_true", help="one load in this process: print its JSON")
    args = parser.parse_args()
    if args.one_start:
        print(json.dumps(one_start(args.gguf, args.precision)))
        return
    starts = []
    with tempfile.TemporaryDirectory(prefix="measure-load-") as folder:
        env = {**os.environ, "SPECMEMO_DATA_DIR": folder}
        for _ in ("first", "second"):
            done = subprocess.run([sys.executable, __file__, str(args.gguf), "--precision", args.precision,
                                   "--one-start"], env=env, check=True, capture_output=True, text=True)
            starts.append(json.loads(done.stdout.strip().splitlines()[-1]))
        kept = sum(f.stat().st_size for f in Path(folder).glob("cache/*/weights-*.pt"))
    second = starts[1]
    weights = second["weight_bytes"]
    result = {
        "file": args.gguf.name,
        "file_bytes": args.gguf.stat().st_size,
        "precision": args.precision,
        "host": {"cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total, "machine": platform.machine()},
        "quantized_cache_bytes": kept,  # decoder weights kept at the planned precision (storage/quantized_cache.py)
        "command": f"python scripts/measure_load.py {args.gguf} --precision {args.precision}",
        "first_start": starts[0],
        "second_start": second,
        "peak_rss_over_weights": round(max(s["peak_rss_bytes"] for s in starts) / weights, 3),
        "limit_1_3x_weights_plus_1gb": int(1.3 * weights + 2**30),
        "within_limit": all(s["peak_rss_bytes"] <= 1.3 * weights + 2**30 for s in starts),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
