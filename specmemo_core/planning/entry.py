"""The one way from a model, its heads, a device and the user's choices to a plan.

Every entry point — the app, ``specmemo chat``, ``generate``, ``plan`` and ``bench``'s
``plan`` method — goes through here, so the same inputs give the same plan everywhere:

- ``plan_inputs`` gathers once per loaded model what ``plan()`` needs besides the request
  (the device's free memory, the model's and heads' shapes, the candidate trees from the
  heads' calibration, the device timing, and on a GPU the host's free RAM and link
  bandwidth, ``planning.host``): the slow part.
- ``inputs_before_load`` gathers the same from a model file's header (or weights in host
  memory), before any weight is loaded: the precision is planned before loading, and a
  model larger than the GPU is planned (resident and streamed layers) before it is placed.
- ``make_plan`` turns those inputs and the user's ``PlanChoices`` into a ``Plan``: pure and
  fast (the app's settings slider calls it on every move).
- ``load_planned`` does all of it around ``Engine.load`` and applies the plan's tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from specmemo_core.errors import OffloadError, SpecMemoError, SplitError
from specmemo_core.planning.device import DeviceError, DeviceInfo
from specmemo_core.planning.memory import HeadsShape, ModelShape
from specmemo_core.planning.offload import HostLink
from specmemo_core.planning.split import Card, plan_over_devices
from specmemo_core.planning.planner import (
    Budget, Plan, PlanRequest, TreeOption, plan, prior_expected_accepted, tree_options,
)
from specmemo_core.planning.timing import StepTiming

Progress = Callable[[str, float], None]
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")


@dataclass(frozen=True)
class PlanChoices:
    """What the user asks of the plan, whatever the entry point (app settings, CLI flags)."""

    turns: int = 20
    prefer: float = 0.5  # 0 = more turns, 1 = more speed
    prompt_tokens: int = 200
    reply_tokens: int = 256
    temperature: float = 0.0
    precision: str | None = None  # None: the planner chooses
    speculate: bool = True  # False: plain decoding, no heads
    tree: str | None = None  # a tree the user forces: planned with this tree only
    batch: int = 1  # conversations decoded together (a server's batch slots; runtime/batch.py)
    backend: str | None = None  # the base model's forward: None chooses (``backend_for``), else one of BACKENDS

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise SpecMemoError(f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.backend not in (None, "torch", "native", "llamacpp"):
            raise SpecMemoError(f"unknown backend {self.backend!r}: choose torch, native or llamacpp")

    def request(self) -> PlanRequest:
        return PlanRequest(turns=self.turns, prefer=self.prefer, precision=self.precision,
                           prompt_tokens=self.prompt_tokens, reply_tokens=self.reply_tokens,
                           sampling=self.temperature > 0, batch=self.batch)


@dataclass(frozen=True)
class PlanInputs:
    """Everything ``plan()`` needs besides the user's request, gathered once per model."""

    budget: Budget
    model: ModelShape
    heads: HeadsShape | None
    trees: tuple[TreeOption, ...]
    timing: StepTiming | None = None
    calibration: dict | None = field(default=None, repr=False)  # the heads' calibration.json
    heads_folder: Path | None = None
    link: HostLink | None = None  # host RAM and bandwidth: given, layers that do not fit may stream
    cards: tuple[Card, ...] = ()  # two or more: GPUs the layers may split over (planning/split.py)


def budget_for(device: DeviceInfo) -> Budget:
    return Budget(device.kind, device.total_bytes, device.free_bytes, device.name, device.bf16_matmul)


def cards_for(devices: "tuple[DeviceInfo, ...] | None") -> tuple[Card, ...]:
    """The GPUs a plan may split its layers over (``--devices``); () for one device."""
    return tuple(Card(d.torch_device, budget_for(d)) for d in devices) if devices and len(devices) > 1 else ()


def plan_inputs(engine: Any, device: DeviceInfo, timing: StepTiming | None, *,
                link: HostLink | None = None, cards: tuple[Card, ...] = ()) -> PlanInputs:
    """The planner's view of a loaded ``Engine`` on ``device`` (``link``: ``planning.host.host_link_for``;
    ``cards``: the GPUs it may split over, ``cards_for``)."""
    from specmemo_core.runtime.calibration import load_calibration

    folder = engine.heads_folder
    record = load_calibration(folder) if folder is not None else None
    heads = HeadsShape.from_spec(engine.heads.spec) if engine.heads is not None else None
    return PlanInputs(budget_for(device), ModelShape.from_spec(engine.model.spec, engine.identity.name), heads,
                      tuple(tree_options(record)), timing, record, folder, link, cards)


def inputs_before_load(loaded: Any, heads: Any, device: DeviceInfo, *, link: HostLink | None,
                       cards: tuple[Card, ...] = ()) -> PlanInputs:
    """The planner's view of a model opened (``storage.sources.OpenedModel``: its header) or
    read into host memory (``LoadedModel``) and the heads ``heads`` names, before anything
    is placed on ``device``; no timing."""
    import torch

    from specmemo_core.runtime.calibration import load_calibration
    from specmemo_core.runtime.engine import heads_source, load_draft_heads
    from specmemo_core.runtime.model import ModelSpec
    from specmemo_core.runtime.native.lm import planned_bytes

    spec = ModelSpec.from_config(loaded.config)
    draft, folder = load_draft_heads(heads_source(heads), spec, loaded.identity, torch.bfloat16, "cpu")
    record = load_calibration(folder) if folder is not None else None
    heads_shape = HeadsShape.from_spec(draft.spec) if draft is not None else None
    native = planned_bytes(loaded) if loaded.stored_bits == 4 and device.kind == "cpu" else None
    shape = ModelShape.from_spec(spec, loaded.identity.name, stored_bits=loaded.stored_bits, native_bytes=native)
    return PlanInputs(budget_for(device), shape, heads_shape,
                      tuple(tree_options(record)), None, record, folder, link, cards)


def forced_tree_option(name: str, inputs: PlanInputs) -> TreeOption:
    """A tree the user names, as a planner option: its acceptance from the heads'
    calibration (else SpecMemo's prior)."""
    for option in inputs.trees:
        if option.name == name:
            return option
    from specmemo_core.runtime.calibration import expected_accepted, rates_of
    from specmemo_core.runtime.engine import resolve_tree

    tree = resolve_tree(name, inputs.heads_folder)
    tree.check_heads(inputs.heads)
    accepted = (expected_accepted(tree, rates_of(inputs.calibration)) if inputs.calibration is not None
                else prior_expected_accepted(tree))
    return TreeOption(name, tree.num_nodes, tree.depth, accepted, tree.widest_drafting_level, tree.growth is not None)


def make_plan(inputs: PlanInputs, choices: PlanChoices) -> Plan:
    """The plan for ``choices`` (pure). Without speculation heads and trees are left out;
    a forced tree is planned alone and used where it fits, even where the timing says
    plain decoding would be faster: it is the user's choice."""
    if not choices.speculate:
        return _plan_on(inputs, None, choices.request(), (), _step_time(inputs))
    if choices.tree is not None:
        option = forced_tree_option(choices.tree, inputs)
        return _plan_on(inputs, inputs.heads, choices.request(), (option,), None)
    return _plan_on(inputs, inputs.heads, choices.request(), inputs.trees, _step_time(inputs))


def _plan_on(inputs: PlanInputs, heads: HeadsShape | None, request: PlanRequest, trees, step_time) -> Plan:
    """One device's plan, or over ``inputs.cards`` (one of them, or the layers split over
    them); when the cards do not hold it even split, the first card streaming what it cannot
    hold from host RAM (NOTE: not yet split and streamed at once)."""
    if len(inputs.cards) > 1:
        over = plan_over_devices(inputs.cards, inputs.model, heads, request, trees, step_time)
        if over.fits or inputs.link is None:
            return over
        streamed = plan(inputs.budget, inputs.model, heads, request, trees, step_time, link=inputs.link)
        return streamed if streamed.fits else over
    return plan(inputs.budget, inputs.model, heads, request, trees, step_time, link=inputs.link)


def _step_time(inputs: PlanInputs):
    return inputs.timing.step_time() if inputs.timing is not None else None


@dataclass(frozen=True)
class PlannedEngine:
    """A loaded engine with the plan in force (its tree applied)."""

    engine: Any  # specmemo_core.runtime.engine.Engine
    device: DeviceInfo
    inputs: PlanInputs
    plan: Plan
    choices: PlanChoices

    @property
    def tree(self) -> str | None:
        return self.engine.tree.name if self.engine.speculative else None

    def replanned(self, choices: PlanChoices) -> "PlannedEngine":
        """New choices that need no reload: a new plan, and the tree it picks."""
        return apply_plan(replace(self, choices=choices), make_plan(self.inputs, choices))

    def new_session(self, *, capacity: int | None = None, system_prompt: str | None = None,
                    graphs: bool | None = None):
        """A conversation with the plan's KV cache (``capacity`` overrides it)."""
        size = capacity if capacity is not None else max(self.plan.kv_tokens, 256)
        return self.engine.new_session(size, system_prompt, speculate=self.choices.speculate, graphs=graphs)

    def new_batch_decoder(self, *, graphs: bool | None = None):
        """A ``runtime.batch.BatchDecoder`` with the plan's ``batch`` slots of ``kv_tokens``
        each (plus the tree's scratch), on the plan's tree (``Engine.new_batch_decoder``)."""
        return self.engine.new_batch_decoder(max(self.plan.kv_tokens, 256), slots=self.plan.batch,
                                             speculate=self.choices.speculate, graphs=graphs)


def apply_plan(planned: PlannedEngine, new_plan: Plan) -> PlannedEngine:
    """``new_plan`` in force: refused with the planner's suggestions when it does not fit,
    and with ``OffloadError`` when it places the layers otherwise than the loaded engine
    (more or fewer resident layers need the model loaded again)."""
    if not new_plan.fits:
        raise PlanDoesNotFitError(new_plan)
    if new_plan.resident_layers != resident_layers_of(planned.engine):
        raise OffloadError(f"this plan keeps {_layers_text(new_plan.resident_layers)} on the GPU but the model was "
                           f"loaded with {_layers_text(resident_layers_of(planned.engine))}: load the model again "
                           "to apply it")
    if split_of_plan(new_plan) != split_of(planned.engine):
        raise SplitError(f"this plan splits the layers as {split_of_plan(new_plan) or 'one device'} but the model was "
                         f"loaded as {split_of(planned.engine) or 'one device'}: load the model again to apply it")
    tree = new_plan.tree if planned.choices.speculate else None
    return replace(planned, plan=new_plan, engine=planned.engine.with_tree(tree))


def split_of(engine: Any) -> tuple[tuple[str, int], ...]:
    """(device, decoder layers) of each segment of a loaded engine split over devices; (): on one."""
    placement = engine.model.placement
    if placement is None:
        return ()
    return tuple((str(d), n) for d, n in zip(placement.split.devices, placement.split.layers))


def split_of_plan(plan: Plan) -> tuple[tuple[str, int], ...]:
    """(device, decoder layers) of each card of a split plan; (): on one device (a plan over
    several cards that one of them holds names that card alone in ``Plan.split``)."""
    return tuple((s.device, s.layers) for s in plan.split) if len(plan.split) > 1 else ()


def resident_layers_of(engine: Any) -> int | None:
    """Decoder layers a loaded engine keeps on its device when it streams the rest; None: all."""
    return None if engine.model.streamed is None else len(engine.model.model.layers)


def _layers_text(resident: int | None) -> str:
    return "every layer" if resident is None else f"{resident} layers"


class PlanDoesNotFitError(SpecMemoError):
    """Nothing the planner can choose fits the device; the message says what would."""

    def __init__(self, refused: Plan) -> None:
        self.plan = refused
        super().__init__("the chat does not fit this device: " + "; ".join(refused.suggestions))


def find_devices(indices: tuple[int, ...] | None = None) -> tuple[DeviceInfo, ...]:
    """The GPUs ``--devices`` names by number (``cuda:N``), in that order; None: every GPU here
    (the set a plan may split over when the user names none)."""
    from specmemo_core.planning.device import probe_at_start

    gpus = {d.index: d for d in probe_at_start().devices if d.kind in ("cuda", "rocm")}
    if indices is None:
        return tuple(gpus[i] for i in sorted(gpus))
    missing = [i for i in indices if i not in gpus]
    if missing:
        found = ", ".join(str(i) for i in sorted(gpus)) or "none"
        raise DeviceError(f"--devices names GPU {', '.join(map(str, missing))} but this machine has GPUs: {found}; "
                          "run `specmemo devices` to see them, or leave --devices out to use the best one")
    return tuple(gpus[i] for i in indices)


def find_device(name: str | None) -> DeviceInfo:
    """The device the user names (``cpu``, ``cuda``, ``cuda:1``, ``mps``, ``rocm``), or
    the best one found (None / ``auto``)."""
    from specmemo_core.planning.device import cpu_device, probe_at_start

    if name in (None, "", "auto"):
        return probe_at_start().best()
    if name == "cpu":
        return cpu_device()
    report = probe_at_start()
    for d in report.devices:
        if name in (d.torch_device, d.kind) or (name == "cuda" and d.kind == "rocm"):
            return d
    known = ", ".join(d.torch_device for d in report.devices)
    raise DeviceError(f"no device {name!r} here (found: {known}); run `specmemo devices` to see what was "
                      "found, or leave --device out to use the best one")


def torch_dtype(precision: str | None, device_kind: str | None = None):
    """The dtype the model is loaded in for a precision. int8/int4 are weight-only: bf16
    around them on a GPU (as the planner counts and ``plan --verify`` measures), fp32 on a
    CPU (each int4 matmul takes its input cast to bf16, ``quantize.Int4CpuLinear``; norms,
    attention and the KV cache stay fp32, as ``memory.weight_bytes`` counts)."""
    import torch

    if precision in ("int8", "int4") and device_kind in ("cuda", "rocm"):
        return torch.bfloat16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision or "", torch.float32)


def backend_for(source: Any, device: DeviceInfo, first: Plan) -> str:
    """What runs the base model's forward by default, for a GGUF planned as int4 on a CPU for
    one conversation at a time: our C forward over the file's blocks (``runtime/native``)
    where it runs the model, else llama.cpp's (``runtime/ggml_step.py``) where
    llama-cpp-python is installed; ours in torch otherwise (batched decoding too). One step
    of the default model after 200 tokens on a 2-core AVX-512 Xeon: native 3.2 ms (its AVX2
    build 4.4), llama.cpp 6.2; a forward of 8 tokens 7.7 ms against llama.cpp's 30."""
    from specmemo_core.runtime.ggml_step import available
    from specmemo_core.runtime.native.lm import supports

    whole = not first.streamed_layers and not first.split and first.batch == 1
    gguf = Path(str(getattr(source, "source", ""))).suffix.lower() == ".gguf"
    if not (device.kind == "cpu" and first.precision == "int4" and whole and gguf):
        return "torch"
    return "native" if supports(source) else "llamacpp" if available() else "torch"


def load_planned(model: str | Path = "default", *, heads: Any = "auto", choices: PlanChoices = PlanChoices(),
                 device: DeviceInfo | None = None, data_folder: Path | None = None,
                 progress: Progress | None = None, wait_for_timing: bool = True,
                 devices: tuple[DeviceInfo, ...] | None = None) -> PlannedEngine:
    """Load the model and heads, take the device timing, plan, and apply the plan: the
    engine every entry point chats with.

    The model is planned from its file's header before its weights are read
    (``inputs_before_load``; on a GPU with the host's free RAM and link bandwidth,
    ``planning.host``), then loaded at the plan's precision, each weight converted as it
    is read (``runtime/model_build.py``): an 8B model planned in int4 never exists in
    fp32. A plan that streams layers loads with its resident layers; a plan that fits
    nowhere is refused (``PlanDoesNotFitError``) before anything is loaded.

    ``wait_for_timing``: True measures the device when ``data_folder`` holds no timing for
    it (``timing.timing_for``, cached there); False never measures: the cached timing,
    else the prior (``timing.timing_without_waiting``), so nothing waits on a timing;
    the app then measures in the background (``timing.refresh_in_background``).

    ``devices``: two or more GPUs (``--devices``) the layers may split over (``planning.split``):
    planned before loading as a streamed plan is, and loaded split as planned."""
    from specmemo_core.planning.host import host_link_for
    from specmemo_core.planning.timing import timing_for, timing_without_waiting
    from specmemo_core.runtime.engine import Engine, HeadsChoice

    device = device or (devices[0] if devices else find_device(None))
    cards = cards_for(devices)
    heads = heads if choices.speculate else HeadsChoice.NONE
    link = host_link_for(device, data_folder)
    from specmemo_core.storage.sources import open_model

    source = open_model(model, progress=progress)  # the header (and the embedding, for the heads' identity)
    first = make_plan(inputs_before_load(source, heads, device, link=link, cards=cards), choices)
    if not first.fits:
        raise PlanDoesNotFitError(first)
    resident, split = (first.resident_layers if first.streamed_layers else None), None
    choices = replace(choices, precision=first.precision)  # each weight read straight into it
    if len(first.split) == 1:  # one of the cards holds it: that one
        device = next(d for d in devices if d.torch_device == first.split[0].device)
    elif first.split:
        from specmemo_core.runtime.split import LayerSplit

        split = LayerSplit.of([s.device for s in first.split], [s.layers for s in first.split])
    dtype = torch_dtype(choices.precision, device.kind)
    backend = choices.backend or backend_for(source, device, first)
    engine = Engine.load(source, heads=heads, dtype=dtype, device=device.torch_device, progress=progress,
                         precision=choices.precision, resident_layers=resident, split=split, backend=backend)
    timing = (timing_for(engine, device.name, data_folder, choices.precision, progress) if wait_for_timing
              else timing_without_waiting(engine, device.name, data_folder, choices.precision))
    if progress is not None:
        progress("planning", 1.0)
    inputs = plan_inputs(engine, device, timing, link=link, cards=cards)
    timed = make_plan(inputs, choices)
    if cards and [(s.device, s.layers) for s in timed.split] != [(s.device, s.layers) for s in first.split]:
        timed = first  # the timing moved a layer or a card: keep the placement the model was loaded with
    planned = PlannedEngine(engine, device, inputs, timed, choices)
    return apply_plan(planned, planned.plan)
