"""What weight quantization costs in quality, and what it saves, on CPU with the default model.

Rows: fp32 (the reference), bf16, int8 (weight-only, torchao, activations fp32), int4
(weight-only, torchao's CPU packing with bf16 scales: each matmul's input cast to bf16, the
rest fp32), int4-cpu (our torch int4 path for a 4-bit GGUF on a CPU: int4 as above, the LM head
as int8 rows, ``cpu_linear.Int8RowLinear``), int4-bf16 (the whole model bf16, then int4) and
native (what the app runs for a 4-bit GGUF on a CPU: ``runtime/native``, the file's own blocks,
activations in int8 blocks of 32):
  (a) greedy agreement with fp32: 64 greedy tokens for each of the first user turns of
      MT-Bench questions 1-8 (no stop tokens, so every run has 64 positions); the share
      of positions before the first divergence, and of all positions, that equal fp32's;
  (b) perplexity of ~4,000 tokens of plain English: all 160 MT-Bench user turns joined,
      scored in one prefill with our own forward;
  (c) weight bytes (measured from the tensors) and plain greedy tokens/s: one run of 64
      tokens on prompt 1 after a warm-up, decode steps only (prefill excluded).
Runs on one thread by default: on a small shared CPU, OpenMP regions of 2 threads stalled
~8 ms each while another job held a core, which swamped every kernel's own cost.
Writes docs/results/quantization_cpu.json after each row. Usage:
    SPECMEMO_DATA_DIR=... python scripts/quant_quality.py [--group-size 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from importlib.metadata import version
from pathlib import Path

import torch
import torch.nn.functional as F

from specmemo_core.planning.device import cpu_device
from specmemo_core.runtime.cpu_linear import pack_linears
from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.storage.datasets import mtbench_questions
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.model import CausalLM, causal_mask
from specmemo_core.runtime.quantize import QuantSpec, held_bytes, linear_weight_bytes, quantize_model
from specmemo_core.storage.sources import load_model

ROWS = {"fp32": ("fp32",), "bf16": ("bf16",), "int8": ("int8",), "int4": ("int4",),
        "int4-cpu": ("int4", "int8-head"), "int4-bf16": ("bf16", "int4"),
        "native": ()}  # row -> quantize_model steps; native: the native forward (runtime/native)
NEW_TOKENS = 64
PPL_TOKENS = 4096
SPEED_TOKENS = 64


def greedy(model: CausalLM, prompt: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens and the seconds spent in decode steps (prefill excluded)."""
    decoder = Decoder(model, model.new_cache(len(prompt) + n + 1))
    tokens: list[int] = []
    decode_s = 0.0
    for step in decoder.generate(prompt, GenerationConfig(max_new_tokens=n)):
        tokens.extend(step.token_ids)
        decode_s += 0.0 if step.prefill else step.forward_s
    return tokens, decode_s


@torch.inference_mode()
def perplexity_text_ids(tokenizer, questions) -> list[int]:
    """The perplexity text's token ids: all MT-Bench user turns joined by blank lines (score the
    first ``PPL_TOKENS``)."""
    text = "\n\n".join(turn for q in questions for turn in q["turns"])
    return tokenizer(text, add_special_tokens=False).input_ids


def perplexity(model: CausalLM, ids: list[int]) -> float:
    """exp(mean cross-entropy of each next token), the whole text in one forward."""
    tokens = torch.tensor(ids)
    hidden = model(tokens, torch.arange(len(ids)), causal_mask(0, len(ids)), model.new_cache(len(ids)))
    nll = torch.zeros((), dtype=torch.float64)
    for start in range(0, len(ids) - 1, 512):  # logits in slices: 4k x 49k floats at once is 0.8 GB
        end = min(start + 512, len(ids) - 1)
        logits = model.logits(hidden[start:end]).float()
        nll += F.cross_entropy(logits, tokens[start + 1:end + 1], reduction="sum").double()
    return math.exp(float(nll) / (len(ids) - 1))


def native_perplexity(lm, ids: list[int]) -> float:
    """``perplexity`` on the native forward: the text in chunks of its most tokens a forward,
    each row scored by its own LM head."""
    from specmemo_core.runtime.native.lm import MAX_TOKENS

    tokens, cache = torch.tensor(ids), lm.new_cache(len(ids))
    nll = torch.zeros((), dtype=torch.float64)
    for start in range(0, len(ids) - 1, MAX_TOKENS):
        chunk = tokens[start:start + MAX_TOKENS]
        logits = lm.logits(lm(chunk, *cache.prepare(torch.arange(chunk.shape[0])), cache))
        cache.settle(chunk.shape[0])
        targets = tokens[start + 1:start + 1 + chunk.shape[0]]
        nll += F.cross_entropy(logits[:targets.shape[0]], targets, reduction="sum").double()
    return math.exp(float(nll) / (len(ids) - 1))


def native_bytes(lm) -> int:
    return sum(p.nbytes for p in lm.weights.values())


def agreement(ref: list[list[int]], out: list[list[int]]) -> dict[str, float]:
    prefix, overall = [], []
    for r, o in zip(ref, out):
        same = [a == b for a, b in zip(r, o)]
        first_diff = same.index(False) if False in same else len(same)
        prefix.append(first_diff / len(r))
        overall.append(sum(same) / len(r))
    return {"until_first_divergence": round(sum(prefix) / len(prefix), 4),
            "overall": round(sum(overall) / len(overall), 4),
            "prompts_identical": sum(p == 1.0 for p in prefix)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group-size", type=int, default=QuantSpec("int4").group_size)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/results/quantization_cpu.json")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)} (fp32 first: the reference)")
    args = ap.parse_args()
    chosen = args.rows.split(",")
    if chosen[0] != "fp32" or not set(chosen) <= set(ROWS):
        ap.error(f"--rows must start with fp32 (the reference) and name rows of {', '.join(ROWS)}")
    torch.set_num_threads(args.threads)
    src = load_model("default")
    tok = src.tokenizer
    questions = mtbench_questions()
    prompts = [encode_conversation(tok, [{"role": "user", "content": q["turns"][0]}]) for q in questions[:8]]
    all_ids = perplexity_text_ids(tok, questions)
    ppl_ids = all_ids[:PPL_TOKENS]

    rows: dict[str, dict] = {}
    reference: list[list[int]] = []
    for row in chosen:
        steps = ROWS[row]
        t0 = time.perf_counter()
        if row == "native":
            from specmemo_core.runtime.native.lm import load_native
            from specmemo_core.storage.sources import open_model

            model = load_native(open_model("default"), threads=args.threads)
        else:
            model = CausalLM.from_state_dict(src.config, src.state_dict)
        for precision in steps:
            if precision == "int8-head":
                pack_linears(model, int8_head=True)  # as Engine.load does on a CPU
            else:
                quantize_model(model, QuantSpec(precision, group_size=args.group_size))
        quantize_s = time.perf_counter() - t0
        outs = [greedy(model, p, NEW_TOKENS)[0] for p in prompts]
        if row == "fp32":
            reference = outs
        greedy(model, prompts[0], 8)  # warm-up
        speed_tokens, decode_s = greedy(model, prompts[0], SPEED_TOKENS)
        rows[row] = {
            "greedy_agreement": agreement(reference, outs),
            "perplexity": round((native_perplexity if row == "native" else perplexity)(model, ppl_ids), 3),
            "weight_bytes": native_bytes(model) if row == "native" else held_bytes(model),
            "decoder_linear_weight_bytes": None if row == "native" else linear_weight_bytes(model),
            "decode_tokens_per_s": round((len(speed_tokens) - 1) / decode_s, 1),
            "quantize_s": round(quantize_s, 2),
        }
        print(row, json.dumps(rows[row]), flush=True)
        write(args.out, src, args, len(ppl_ids), len(all_ids), rows)
    print(Path(args.out).read_text())


def _cpu_name() -> str:
    cpu = cpu_device()
    return cpu.name + (" (bf16 matrix units)" if cpu.bf16_matmul else "") if cpu.name else platform.machine()


def write(out: str, src, args: argparse.Namespace, ppl_tokens: int, available: int, rows: dict) -> None:
    result = {
        "model": src.identity.name,
        "source": src.source.name,
        "device": "cpu", "cpu": _cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "torchao": version("torchao"),
        "int4_group_size": args.group_size,
        "greedy": {"prompts": "MT-Bench questions 1-8, first user turn, chat template",
                   "new_tokens": NEW_TOKENS, "stop_tokens": "none"},
        "perplexity_text": {"what": "all 160 MT-Bench user turns joined by blank lines",
                            "tokens": ppl_tokens, "of_available": available},
        "speed": {"what": "plain greedy decode steps, prefill excluded, prompt 1, after a warm-up",
                  "tokens": SPEED_TOKENS, "runs": 1},
        "notes": [
            "int8: torchao Int8WeightOnlyConfig, per-row scales; int4: torchao prototype "
            "PrototypeInt4WeightOnlyConfig (Int4OpaqueTensor, ATen _weight_int4pack_mm_for_cpu), "
            "asymmetric, group size as above, scales in bf16; each int4 matmul's input cast to bf16 "
            "(quantize.Int4CpuLinear). Activations stay fp32 elsewhere for int8/int4, bf16 for int4-bf16.",
            "embedding and lm_head (tied in this model) stay fp32/bf16, except int4-cpu's LM head: a "
            "copy as int8 rows (cpu_linear.Int8RowLinear) beside the fp32 embedding.",
            "native: runtime/native's C forward over the GGUF's own Q4_1/Q8_0 blocks (scales as half "
            "floats), activations quantized to int8 per block of 32 (as llama.cpp does); its weight "
            "bytes are the packed matrices and norms (the heads' fp32 embedding copy not counted).",
            "the default model ships as a Q4_1 GGUF, dequantized to fp32 at load: fp32 here is the "
            "dequantized Q4_1 weights, not the original bf16 checkpoint.",
            "tokens/s: one run each, one thread, on a 2-core machine that other jobs were using "
            "at the same time: a rough comparison between rows, not a benchmark.",
        ],
        "results": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
