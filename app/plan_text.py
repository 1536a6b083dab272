"""A plan in words: how many turns it holds (saying when the model's context, not memory, is
the limit), and where the layers live when the model is larger than the GPU (streamed from
RAM, or split over several GPUs)."""

from __future__ import annotations

from specmemo_core.planning.planner import Plan


def context_limited(plan: Plan, wanted: int, max_context: int) -> bool:
    """Fewer turns than wanted because the KV cache already spans the model's whole context."""
    return plan.turns < wanted and plan.kv_tokens >= max_context


def turns_text(plan: Plan, wanted: int, max_context: int) -> str:
    """"20 turns fit", or "17 of 20 turns fit: the model's 2048-token context is the limit" (or memory)."""
    if plan.turns >= wanted:
        return f"{plan.turns} turns fit"
    limit = f"the model's {max_context}-token context" if context_limited(plan, wanted, max_context) else "memory"
    return f"{plan.turns} of {wanted} turns fit: {limit} is the limit"


def layers_text(plan: Plan) -> str:
    """"12 of 32 layers on the GPU, 20 streamed from RAM (7.8 GiB pinned) · 6.1 tokens/s predicted";
    "" when every layer is on the device. More turns take GPU memory from the layers."""
    if not plan.streamed_layers:
        return ""
    layers = plan.resident_layers + plan.streamed_layers
    speed = f" · {plan.predicted_tokens_per_s:.1f} tokens/s predicted" if plan.predicted_tokens_per_s else ""
    return (f"{plan.resident_layers} of {layers} layers on the GPU, {plan.streamed_layers} streamed from RAM "
            f"({plan.pinned_host_bytes / 2**30:.1f} GiB pinned){speed}")


def split_text(plan: Plan) -> str:
    """"layers split over 2 GPUs: cuda:0 layers 0–19 (13.9 GiB), cuda:1 layers 20–39 (14.3 GiB)";
    "" when the plan runs on one device."""
    if len(plan.split) < 2:
        return ""
    cards = ", ".join(f"{s.device} " + (f"layers {s.first_layer}–{s.first_layer + s.layers - 1}" if s.layers
                                        else "no layers") + f" ({s.predicted_bytes / 2**30:.1f} GiB)"
                      for s in plan.split)
    return f"layers split over {len(plan.split)} GPUs: {cards}"
