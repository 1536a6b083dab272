"""The engine ``chat`` and ``generate`` talk to: loaded and planned through ``planning.entry``,
with the KV cache the user asked for checked against the model and the device first."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from specmemo_core.cli.common import StageProgress
from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.entry import PlanChoices, PlannedEngine
from specmemo_core.runtime.chat import ChatSession, encode_conversation
from specmemo_core.runtime.context_window import Messages

GIB = 2**30


class ContextTooLargeError(SpecMemoError):
    """The KV cache asked for (``--context``) does not fit the device's memory."""


def plan_choices(args: argparse.Namespace) -> PlanChoices:
    """The user's flags as the planner's choices; ``--tree auto`` (or none): the planner's tree."""
    return PlanChoices(reply_tokens=args.max_new_tokens, temperature=args.temperature, precision=None if args.dtype == "auto" else args.dtype,
                       speculate=not args.no_spec, tree=None if args.tree in (None, "auto") else args.tree,
                       batch=getattr(args, "slots", 1),  # `serve`: its slots share the device
                       backend=None if getattr(args, "backend", "auto") == "auto" else args.backend)


def load_planned_engine(args: argparse.Namespace) -> PlannedEngine:
    """Planned from the cached device timing, else the prior: a reply never waits on a
    timing (``specmemo plan`` and ``bench`` measure and cache one)."""
    from specmemo_core.cli.common import parse_devices
    from specmemo_core.planning.entry import find_device, find_devices, load_planned
    from specmemo_core.storage.data_folder import data_dir

    numbers = parse_devices(args.devices)  # before loading: a wrong --device(s) costs no loading time
    if numbers:
        devices = find_devices(numbers)
    else:  # no device named: every GPU here, split over where one card does not hold the chat
        devices = find_devices() if args.device in (None, "auto") else ()
    if len(devices) > 1:
        device = None  # the plan picks a card, or splits over them
    else:  # one GPU found or named (no second probe), else the device named or the CPU
        device = devices[0] if devices else find_device(args.device)
    with StageProgress() as progress:
        return load_planned(args.model, heads=args.heads, choices=plan_choices(args), device=device,
                            data_folder=data_dir(), progress=progress, wait_for_timing=False, devices=devices)


def kv_room_tokens(planned: PlannedEngine) -> int:
    """Committed tokens whose KV cache fits beside everything else the plan keeps on the device."""
    from specmemo_core.planning.memory import around_precision, kv_bytes

    plan = planned.plan
    others = plan.total_bytes - plan.predicted_bytes.get("kv_cache", 0)
    per_token = max(kv_bytes(planned.inputs.model, 1, around_precision(plan.precision, plan.device)), 1)
    return max((plan.budget_bytes - others) // per_token - plan.tree_nodes, 0)


def checked_context(requested: int | None, planned: PlannedEngine) -> int:
    """``--context``: None is the plan's KV cache; beyond the model's trained context it is
    capped (with a warning saying why); more than the device's memory holds is refused,
    before anything is allocated."""
    if requested is None:
        return max(planned.plan.kv_tokens, 256)
    trained = planned.inputs.model.max_context
    if requested > trained:
        print(f"warning: --context {requested} is beyond the {trained} tokens {planned.inputs.model.name} was "
              f"trained on (it would not follow text further back); using {trained}", file=sys.stderr)
        requested = trained
    room = kv_room_tokens(planned)
    if requested > room:
        raise ContextTooLargeError(
            f"--context {requested} needs a KV cache larger than the {planned.device.kind} memory holds beside "
            f"the model ({planned.plan.budget_bytes / GIB:.2f} GiB usable): ask for at most {room} tokens, or "
            f"leave --context out for the plan's {planned.plan.kv_tokens}")
    return requested


@dataclass(frozen=True)
class ChatSetup:
    """A planned engine and the chat's settings: what a terminal conversation needs."""

    planned: PlannedEngine
    capacity: int
    system_prompt: str | None
    graphs: bool | None
    threads: int

    def open_session(self) -> ChatSession:
        return self.planned.new_session(capacity=self.capacity, system_prompt=self.system_prompt,
                                        graphs=self.graphs)

    def count_tokens(self, messages: Messages) -> int:
        return len(encode_conversation(self.planned.engine.tokenizer, messages))

    def facts(self) -> dict:
        """The tree, precision and threads in force, for --json and the banner."""
        return {"tree": self.planned.tree, "precision": self.planned.engine.precision, "threads": self.threads,
                "backend": self.planned.engine.backend}

    @property
    def describe(self) -> str:
        tree = self.planned.tree
        mode = f"speculative, tree {tree}" if tree else "plain decoding"
        threads = f"{self.threads} thread" + ("s" if self.threads > 1 else "")
        engine = self.planned.engine
        backend = {"llamacpp": " through llama.cpp", "native": ", native forward"}.get(engine.backend, "")
        precision = engine.precision + backend
        return (f"{engine.identity.name} on {self.planned.device.torch_device} ({mode}, "
                f"{precision}, {threads}, context {self.capacity} tokens)")


def load_for_chat(args: argparse.Namespace) -> ChatSetup:
    import torch

    planned = load_planned_engine(args)
    capacity = checked_context(args.context, planned)
    if args.compile:
        if planned.device.torch_device.startswith("cuda"):
            planned.engine.model.compile_layers()
        else:
            print(f"warning: --compile speeds steps up on a CUDA GPU only; on {planned.device.torch_device} the "
                  "model runs as it is", file=sys.stderr)
    return ChatSetup(planned, capacity, args.system, args.graphs, torch.get_num_threads())
