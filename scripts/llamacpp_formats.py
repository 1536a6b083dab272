"""Other llama.cpp weight formats for a GGUF (the optional ``llamacpp`` extra): the file
requantized by llama.cpp's own quantizer, each copy scored (perplexity on the 4,096 tokens of
MT-Bench text that ``scripts/quant_quality.py`` uses) and timed (ms per ``llama_decode`` of T
tokens at a 100-token context, flash attention off and on, all configurations interleaved).
Results: docs/results/int4_cpu/formats.md.

    python scripts/llamacpp_formats.py [--gguf default] [--formats Q8_0,Q4_K_S,Q4_0] [--sizes 1,4,8,16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from llamacpp_tree_steps import PROMPT, Llama
from quant_quality import PPL_TOKENS, perplexity_text_ids


def requantized(L, src: Path, name: str, folder: Path) -> Path:
    dst = folder / f"{src.stem}.{name}.gguf"
    p = L.llama_model_quantize_default_params()
    p.ftype, p.allow_requantize, p.nthread = getattr(L, f"LLAMA_FTYPE_MOSTLY_{name}"), True, 2
    if L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
        raise RuntimeError(f"llama.cpp could not requantize to {name}")
    return dst


def perplexity(L, model, ids: list[int]) -> float:
    llm = Llama(L, model, 2, flash=False, n_ctx=len(ids) + 64)
    nll = 0.0
    for start in range(0, len(ids), 512):
        chunk = ids[start:start + 512]
        logits = llm.decode(chunk, range(start, start + len(chunk)), [[0]] * len(chunk)).astype(np.float64)
        for i, row in enumerate(logits[: len(ids) - 1 - start]):
            top = row.max()
            nll += top + math.log(np.exp(row - top).sum()) - row[ids[start + i + 1]]
    return math.exp(nll / (len(ids) - 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="default")
    ap.add_argument("--formats", default="Q8_0,Q4_K_S,Q4_0")
    ap.add_argument("--sizes", default="1,4,8,16")
    args = ap.parse_args()
    import llama_cpp as L

    from specmemo_core.storage.datasets import mtbench_questions
    from specmemo_core.storage.sources import load_model
    from specmemo_core.tools.bench_llamacpp import gguf_path

    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda *a: None)  # kept alive while llama.cpp may call it
    L.llama_log_set(quiet, None)
    src = gguf_path(args.gguf)
    ids = perplexity_text_ids(load_model(args.gguf).tokenizer, mtbench_questions())[:PPL_TOKENS]
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        files = {src.stem.rsplit(".", 1)[-1]: src} | {f: requantized(L, src, f, Path(tmp)) for f in args.formats.split(",")}
        contexts, out = {}, {}
        for name, path in files.items():
            mp = L.llama_model_default_params()
            mp.n_gpu_layers = 0
            model = L.llama_model_load_from_file(str(path).encode(), mp)
            out[name] = {"bytes": path.stat().st_size, "perplexity": round(perplexity(L, model, ids), 3), "ms": {}}
            vocab = L.llama_model_get_vocab(model)
            buf = (L.llama_token * 512)()
            prompt = list(buf[:L.llama_tokenize(vocab, PROMPT.encode(), len(PROMPT), buf, 512, True, True)]) * 4
            for flash in (False, True):
                llm = Llama(L, model, 2, flash)
                llm.decode(prompt, range(len(prompt)), [[0]] * len(prompt))
                contexts[name, flash] = llm, len(prompt), prompt[-1]
        times = {key: {s: [] for s in sizes} for key in contexts}
        for _ in range(5):
            for key, (llm, n, token) in contexts.items():
                for s in sizes:
                    t0 = time.perf_counter()
                    for _ in range(10):
                        llm.decode([token] * s, range(n, n + s), [[0]] * s)
                        L.llama_memory_seq_rm(llm.mem, -1, n, -1)
                    times[key][s].append((time.perf_counter() - t0) / 10 * 1e3)
        for (name, flash), by_size in times.items():
            out[name]["ms"][f"flash_{'on' if flash else 'off'}"] = {s: round(statistics.median(v), 2)
                                                                   for s, v in by_size.items()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
