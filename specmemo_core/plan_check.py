"""Plans meet the device: start-up timing, trial allocation, and measured verification.

The planner itself is pure; this module does the three things that need the device:
time a forward so the planner knows where a bigger tree stops paying, allocate the
plan's KV cache and tree buffers once before the weights load (so a plan that passes
cannot run out of memory later), and run a planned chat to compare predicted and
measured peak memory.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from typing import Any

import torch

from .errors import SpecMemoError
from .model import CausalLM, causal_mask, tree_mask
from .planner import Plan, StepTime, linear_step_time


class PlanDoesNotFit(SpecMemoError):
    """The device refused the plan's trial allocation."""


def time_forward(model: CausalLM, heads: Any = None, big: int = 64, context: int = 512, repeats: int = 3) -> StepTime:
    """Median time of a forward over 1 and over ``big`` tokens at ``context`` tokens of
    history, and of one drafted tree level: the planner's step-time model."""
    device = model.device
    cache = model.new_cache(context + big)
    ids = torch.randint(0, model.spec.vocab_size, (context + big,), device=device)
    with torch.inference_mode():
        model(ids[:context], torch.arange(context, device=device), causal_mask(0, context, device), cache)
        cache.commit_prefix(context)

        def run(t: int) -> float:
            mask = tree_mask(context, torch.ones(t, t, dtype=torch.bool, device=device).tril())
            times = []
            for _ in range(repeats + 1):
                _sync(device)
                t0 = time.perf_counter()
                model.logits(model(ids[:t], context + torch.arange(t, device=device), mask, cache))
                _sync(device)
                times.append(time.perf_counter() - t0)
            return sorted(times[1:])[len(times[1:]) // 2]

        t1, tb = run(1), run(big)
        draft = 0.0
        if heads is not None:
            h = torch.zeros(model.spec.hidden_size, device=device, dtype=model.dtype)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                model.lm_head(h[None]).topk(10)
            _sync(device)
            draft = (time.perf_counter() - t0) / repeats
    return linear_step_time(t1, tb, big, draft)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def confirm(plan: Plan, device: str | torch.device) -> None:
    """Allocate the plan's KV cache and tree buffers once and free them again.

    On a GPU this is what llama.cpp's fit check does: if the allocator refuses now, the
    plan is refused before the weights load. On a CPU the OS would overcommit, so the
    check compares against the memory the OS reports available instead.
    """
    need = plan.predicted_bytes.get("kv_cache", 0) + plan.predicted_bytes.get("tree_buffers", 0)
    device = torch.device(device)
    if device.type == "cpu":
        import psutil

        free = psutil.virtual_memory().available
        if plan.total_bytes > free:
            raise PlanDoesNotFit(f"the plan needs {plan.total_bytes / 2**30:.2f} GiB but only "
                                 f"{free / 2**30:.2f} GiB of RAM is available: ask for fewer turns")
        return
    try:
        block = torch.empty(need, dtype=torch.uint8, device=device)
        del block
    except torch.OutOfMemoryError as exc:
        raise PlanDoesNotFit(f"the device refused {need / 2**30:.2f} GiB for the KV cache and tree "
                             f"buffers: plan fewer turns or a smaller tree") from exc
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class Verification:
    predicted_bytes: int
    measured_peak_bytes: int
    measured_terms: dict[str, int]
    fits: bool


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def verify(plan: Plan, model: CausalLM, heads: Any, tree: Any, prompt_tokens: int, reply_tokens: int,
           turns: int) -> Verification:
    """Run the planned chat with synthetic text (prefill + ``turns`` turns) and measure.

    CUDA: ``torch.cuda.max_memory_allocated`` against the predicted total less the
    runtime overhead term (which the allocator does not count). CPU: the process's peak
    resident memory against the predicted total.
    """
    from .decoding import Decoder, GenerationConfig

    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = model.new_cache(plan.kv_tokens + plan.tree_nodes)
    decoder = Decoder(model, cache, heads if plan.tree else None, tree if plan.tree else None)
    gen = torch.Generator().manual_seed(0)
    history: list[int] = []
    for _ in range(turns):
        history += torch.randint(0, model.spec.vocab_size, (prompt_tokens,), generator=gen).tolist()
        if len(history) + reply_tokens + plan.tree_nodes > plan.kv_tokens:
            break
        for step in decoder.generate(history, GenerationConfig(max_new_tokens=reply_tokens)):
            history += list(step.token_ids)
    measured = {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "heads": sum(p.numel() * p.element_size() for p in heads.parameters()) if (heads and plan.tree) else 0,
        "kv_cache": cache.nbytes,
    }
    peak = peak_bytes(device)
    predicted = plan.total_bytes - (plan.predicted_bytes.get("overhead", 0) if device.type == "cuda" else 0)
    return Verification(predicted, peak, measured, peak <= plan.budget_bytes)
