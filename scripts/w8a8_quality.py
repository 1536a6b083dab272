"""Issue 23 on a CPU: int8 weights with int8 activations (W8A8: per-output-channel weight
scales, per-token activation scales, ``torch._int_mm``'s exact int32 accumulation, which
stays flat in the tokens of a step where torchao's int4 kernel grows with them) against fp32
on the default model: perplexity on the MT-Bench text and greedy agreement with fp32, as
``quant_quality.py`` measures them, and plain decoding speed. A probe of the idea, not a
precision the engine offers: each decoder linear is swapped for ``W8A8Linear`` here.

    python scripts/w8a8_quality.py > docs/results/int8_activations_cpu/w8a8.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_quality import PPL_TOKENS, agreement, greedy, perplexity  # noqa: E402

from specmemo_core.runtime.chat import encode_conversation  # noqa: E402
from specmemo_core.runtime.model import CausalLM  # noqa: E402
from specmemo_core.storage.datasets import mtbench_questions  # noqa: E402
from specmemo_core.storage.sources import load_model  # noqa: E402


class W8A8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        self.scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
        self.weight = (w / self.scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        s = (rows.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)  # [T, 1] per token
        y = torch._int_mm((rows / s).round().clamp(-127, 127).to(torch.int8), self.weight.t()).float() * s * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1).to(x.dtype)


def to_w8a8(model: CausalLM) -> CausalLM:
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                setattr(parent, name, W8A8Linear(getattr(parent, name)))
    return model


def main() -> None:
    torch.set_num_threads(2)
    src = load_model("default")
    questions = mtbench_questions()
    prompts = [encode_conversation(src.tokenizer, [{"role": "user", "content": q["turns"][0]}]) for q in questions[:8]]
    text = "\n\n".join(turn for q in questions for turn in q["turns"])
    ids = src.tokenizer(text, add_special_tokens=False).input_ids[:PPL_TOKENS]
    reference = None
    for row in ("fp32", "w8a8"):
        model = CausalLM.from_state_dict(src.config, src.state_dict)
        if row == "w8a8":
            to_w8a8(model)
        outs = [greedy(model, p, 64)[0] for p in prompts]
        reference = reference or outs
        greedy(model, prompts[0], 8)  # warm-up
        tokens, seconds = greedy(model, prompts[0], 64)
        print(row, "perplexity", round(perplexity(model, ids), 3), "agreement with fp32", agreement(reference, outs),
              "plain tok/s", round((len(tokens) - 1) / seconds, 1), flush=True)


if __name__ == "__main__":
    main()
