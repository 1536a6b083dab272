"""How many turns a plan holds, in words, saying when the model's context (not memory) is the limit."""

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
