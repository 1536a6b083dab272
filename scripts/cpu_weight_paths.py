"""Issue 23 on a CPU: what the default model's step costs with its weights held as the
GGUF's own 4-bit grid (or int8) and multiplied through ATen's weight-only kernels, the rest
of the model left in fp32. A measurement, not a product path.

Variants (every decoder linear; the tied LM head as noted):
  fp32     the product's CPU path: fp32 weights packed for oneDNN (``cpu_linear``)
  int8     int8 per-row weights (``_weight_int8pack_mm``), LM head too; each matmul's input
           cast to bf16 and its output back (the int8 kernel has no fast fp32 path)
  int4     int4 weights in groups of 32 (``_weight_int4pack_mm_for_cpu``: the Q4_1 grid
           re-found exactly), bf16 matmul inputs as above; LM head int8
  int4-all int4 LM head too
For each: plain greedy tok/s over the first turns of 4 MT-Bench questions (64 tokens,
decode steps only, 3 rounds; medians), the share of tokens equal to the fp32 variant's,
and ms per forward (plus LM head) of 1, 8 and 16 tokens after a 300-token context (what
a plain step and a small tree's verify cost).

    python scripts/cpu_weight_paths.py [--threads 2] > docs/results/cpu_avx2_epyc/weight_paths.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.runtime.cpu_linear import pack_linears
from specmemo_core.runtime.decoding import Decoder, GenerationConfig
from specmemo_core.runtime.kv_cache import causal_mask
from specmemo_core.runtime.model import CausalLM
from specmemo_core.storage.datasets import mtbench_questions
from specmemo_core.storage.sources import load_model


class Int8Linear(nn.Module):
    """int8 per-row symmetric weights; bf16 matmul input, output in the input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
        self.w8 = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale, self.n, self.k = scale.bfloat16(), w.shape[0], w.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.k).bfloat16(), self.w8, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.n)


class Int4Linear(nn.Module):
    """int4 weights in groups of ``group`` (min/max per group: a Q4_1 grid comes back exactly)."""

    def __init__(self, linear: nn.Linear, group: int = 32) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((wg - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        # the kernel's convention: w = (q - 8)·scale + zero
        self.scale_zero = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().bfloat16()
        self.group, self.n, self.k = group, n, k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.k).bfloat16(), self.packed, self.group,
                                                       self.scale_zero)
        return y.to(x.dtype).view(*x.shape[:-1], self.n)


VARIANTS = {"fp32": None, "int8": (Int8Linear, Int8Linear), "int4": (Int4Linear, Int8Linear),
            "int4-all": (Int4Linear, Int4Linear)}


def build(src, variant: str) -> CausalLM:
    model = CausalLM.from_state_dict(src.config, src.state_dict)
    if VARIANTS[variant] is None:
        pack_linears(model)
        return model
    layer_cls, head_cls = VARIANTS[variant]
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, layer_cls(child))
    model.lm_head = head_cls(model.lm_head)
    return model


def decode_speed(model: CausalLM, prompts: list[list[int]]) -> tuple[float, list[tuple[int, ...]]]:
    """Plain greedy decode tok/s (steps only) over ``prompts``, and every step's tokens."""
    steps, seconds, tokens = 0, 0.0, []
    for prompt in prompts:
        decoder = Decoder(model, model.new_cache(len(prompt) + 70))
        for step in decoder.generate(prompt, GenerationConfig(max_new_tokens=64)):
            tokens.append(step.token_ids)
            if not step.prefill:
                steps, seconds = steps + 1, seconds + step.forward_s
    return steps / seconds, tokens


@torch.inference_mode()
def forward_ms(model: CausalLM, context: int = 300) -> dict[int, float]:
    """Median ms of a forward plus LM head over 1, 8 and 16 new tokens after ``context``."""
    cache = model.new_cache(context + 32)
    ids = torch.randint(0, 40000, (context,), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(context), causal_mask(0, context), cache)
    cache.commit_prefix(context)
    out = {}
    for t in (1, 8, 16):
        x = torch.zeros(t, dtype=torch.long)

        def run() -> None:
            model.logits(model(x, torch.arange(context, context + t), causal_mask(context, t), cache))

        for _ in range(3):
            run()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        out[t] = round(statistics.median(times), 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = load_model("default")
    prompts = [encode_conversation(src.tokenizer, [{"role": "user", "content": q["turns"][0]}])
               for q in mtbench_questions()[:4]]
    reference: list[tuple[int, ...]] = []
    for variant in VARIANTS:
        model = build(src, variant)
        speeds, tokens = [], []
        for _ in range(3):
            speed, tokens = decode_speed(model, prompts)
            speeds.append(speed)
        reference = reference or tokens
        ms = forward_ms(model)
        print(json.dumps({"variant": variant, "threads": args.threads, "tok_s": [round(s, 1) for s in speeds],
                          "median": round(statistics.median(speeds), 1), "forward_ms": ms,
                          "verify8_vs_plain": round(ms[8] / ms[1], 2),
                          "steps_equal_to_fp32": round(sum(a == b for a, b in zip(tokens, reference)) / len(tokens), 3)}),
              flush=True)


if __name__ == "__main__":
    main()
