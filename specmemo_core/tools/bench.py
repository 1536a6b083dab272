"""``specmemo bench``: transformers' generate and our decoders side by side, in one process.

Every method runs the same workload (multi-turn conversations, greedy): a warm-up round
that is not timed, then ``repeats`` rounds with the methods interleaved (A B C … A B C …)
so drift in the machine's speed hits all alike. A *pass* is one method over the whole
workload; per method the report gives tokens/s over the passes (median, min, max), mean
accepted tokens per verify step (prefills excluded), time to first token, the verify
step's buffer bytes, peak memory, and how many replies are token-for-token the
``vanilla`` (plain greedy) reply.

Methods
-------
hf           transformers ``generate``, greedy, the same weights; each turn re-sends the
             whole conversation (chat template, the model's earlier replies as token ids).
hf-pld       the same with prompt-lookup decoding (``prompt_lookup_num_tokens=10``).
vanilla      our plain decoding (one token per forward).
plan         our decoder with the tree the planner picks after timing this device (it
             may pick plain decoding; the report says which).
<tree name>  our decoder with the loaded heads on that tree: medusa-64, 1-10-16-17,
             calibrated-N, …; ``+lookup-N`` adds a chain copied from the conversation
             (``lookup.py``), and ``lookup-N`` alone needs no heads.

Our methods take suffixes, in this order: ``+graphs`` (the static-shape decoder: CUDA graphs
on a GPU), ``+compiled`` (its layer regions through torch.compile), ``+serial`` (each step
waits until the last one is read, as before steps overlapped: ``StaticDecoder.overlap``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from specmemo_core.runtime.chat import encode_conversation
from specmemo_core.errors import SpecMemoError
from specmemo_core.planning.timing import StepTiming
from specmemo_core.tools.evaluate import run_conversations
from specmemo_core.text import encodable

ALL_METHODS = ("hf", "hf-pld", "vanilla", "medusa-64", "1-10-16-17", "plan")
HF_METHODS = ("hf", "hf-pld")
PLD_TOKENS = 10
BENCH_CONTEXT = 4096  # committed tokens each conversation's KV cache holds
TREE_BUFFER_SOURCE = f"predicted: memory.tree_buffer_bytes at a {BENCH_CONTEXT}-token context"
PREDICTED_PEAK_SOURCE = ("predicted: the planner's memory model (weights, heads, KV cache, tree buffers, "
                         "activations, overhead); CPU peak RSS cannot be split by method in one process")
CUDA_PEAK_SOURCE = "measured: torch.cuda.max_memory_allocated over the method's passes (both models resident)"


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise SpecMemoError("no values to summarise")
        return cls(statistics.median(values), min(values), max(values))

    def as_dict(self, digits: int = 3) -> dict[str, float]:
        return {"median": round(self.median, digits), "min": round(self.min, digits), "max": round(self.max, digits)}


@dataclass(frozen=True)
class Pass:
    """One method over the whole workload."""

    replies: list[list[int]]  # token ids per query, stop token excluded
    new_tokens: int
    seconds: float  # wall time, prefills and templating included
    steps: int  # forwards after each reply's first token
    step_tokens: int  # tokens those forwards gave the replies (ours: ``Step.reply_tokens``)
    first_token_s: tuple[float, ...]  # per reply
    peak_bytes: int | None = None
    decode_seconds: float | None = None  # in the steps after the first tokens (ours; None: not measured apart)
    accepted_tokens: int | None = None  # ours: what the verifications accepted, past the replies' ends too

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.step_tokens / self.steps if self.steps else 0.0

    @property
    def mean_accepted(self) -> float:
        accepted = self.step_tokens if self.accepted_tokens is None else self.accepted_tokens
        return accepted / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class Method:
    """A named way to run the workload, with what is known about it before it runs."""

    name: str
    run: Callable[[], Pass]
    tree: str | None = None  # None: one token per forward
    tree_nodes: int = 1
    tree_buffer_bytes: int | None = None  # None: not modelled (transformers)
    predicted_bytes: int | None = None
    note: str = ""


COMPILED = "+compiled"  # a method name's suffix: the same method with compiled layer regions
SERIAL = "+serial"  # … with each step started only once the last is read (no overlapped steps)


def method_suffixes(name: str) -> tuple[str, bool, bool]:
    """A method name without its ``+compiled`` and ``+serial`` suffixes (in that order), and
    whether it had each."""
    serial = name.endswith(SERIAL)
    base = name.removesuffix(SERIAL)
    return base.removesuffix(COMPILED), base.endswith(COMPILED), serial


# -- runners ------------------------------------------------------------------
def ours_runner(engine: Any, conversations: Sequence[Sequence[str]], tree: Any, *, max_new_tokens: int,
                graphs: bool = False, regions: Any = None, serial: bool = False) -> Callable[[], Pass]:
    """Our decoder (plain when ``tree`` is None) over the conversations, via evaluate.run_conversations;
    ``graphs``: the static-shape decoder (CUDA graphs on a GPU, captured on the engine's one
    stream, as the app's sessions are); ``regions``: how the decoder layers run
    (``model.LayerRegions``; None: eagerly), set at each pass since methods take turns;
    ``serial``: no step starts before the last is read."""
    from specmemo_core.runtime.model import EAGER_REGIONS

    heads = engine.heads if tree is not None else None
    capture_stream = engine.graph_capture_stream()

    def run() -> Pass:
        engine.model.use_regions(regions or EAGER_REGIONS)
        r = run_conversations(engine.model, engine.tokenizer, engine.config, conversations, heads=heads,
                              tree=tree, max_new_tokens=max_new_tokens, capacity=BENCH_CONTEXT, graphs=graphs,
                              capture_stream=capture_stream, overlap=False if serial else None)
        return Pass(r.replies, r.new_tokens, r.seconds, r.steps, r.step_tokens, r.first_token_s,
                    decode_seconds=r.decode_seconds, accepted_tokens=r.accepted_tokens)

    return run


class _StepClock:
    """A generate() streamer that counts forwards: the first put is the prompt, the second
    the first token (time to first token), every later one the tokens of one forward."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts = 0
        self.first_token_s = 0.0
        self.step_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_s = time.perf_counter() - self.start
        elif self.puts > 2:
            self.step_tokens += value.numel()

    def end(self) -> None:
        pass

    @property
    def steps(self) -> int:
        return max(self.puts - 2, 0)


def hf_runner(hf: Any, tokenizer: Any, stop_ids: frozenset[int], conversations: Sequence[Sequence[str]],
              max_new_tokens: int, prompt_lookup: int | None = None, *,
              input_device: torch.device | None = None) -> Callable[[], Pass]:
    """transformers' greedy ``generate``; each turn re-sends the conversation so far, the
    model's earlier replies given as the token ids it produced (as our sessions do).
    ``input_device``: where the prompt goes (default ``hf.device``; a model dispatched by
    accelerate takes it on its main device)."""
    from transformers.generation.streamers import BaseStreamer

    clock_type = type("StepClock", (_StepClock, BaseStreamer), {})
    stops = sorted(stop_ids)
    extra = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
    device = input_device if input_device is not None else hf.device

    def turn(prompt: list[int]) -> Turn:
        ids = torch.tensor([prompt], device=device)  # [1, P]
        clock = clock_type()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=stops[0],
                              streamer=clock, **extra)  # [1, P + new]
        reply = out[0, ids.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(reply) if t in stop_ids), len(reply))
        return Turn(reply[:cut], clock.first_token_s, clock.steps, clock.step_tokens)

    return lambda: run_turns(tokenizer, conversations, turn)


@dataclass(frozen=True)
class Turn:
    """One reply of an engine that is not ours, as a bench pass counts it."""

    reply: list[int]  # token ids, stop token excluded
    first_token_s: float
    steps: int  # forwards after the first token
    step_tokens: int  # tokens those forwards emitted


def turn_prompt(tokenizer: Any, turns: Sequence[str], replies: Sequence[Sequence[int]]) -> list[int]:
    """The prompt ids of turn ``len(replies)`` of a conversation of user ``turns``, from our
    chat template: each earlier user turn followed by the model's reply as the token ids
    it produced (as our sessions keep them)."""
    messages: list[dict[str, str]] = []
    known: dict[int, list[int]] = {}
    for text, reply in zip(turns, [*replies, None]):
        messages.append({"role": "user", "content": encodable(text)})
        if reply is None:
            break
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
        known[len(messages) - 1] = list(reply)
    return encode_conversation(tokenizer, messages, known)


def run_turns(tokenizer: Any, conversations: Sequence[Sequence[str]],
              turn: Callable[[list[int]], Turn]) -> Pass:
    """A pass of another engine (transformers, llama.cpp) over the conversations: each turn
    hands ``turn`` the conversation so far (``turn_prompt``)."""
    replies: list[list[int]] = []
    firsts: list[float] = []
    steps = step_tokens = 0
    start = time.perf_counter()
    for turns in conversations:
        done_turns: list[list[int]] = []
        for _ in turns:
            done = turn(turn_prompt(tokenizer, turns, done_turns))
            done_turns.append(done.reply)
            firsts.append(done.first_token_s)
            steps += done.steps
            step_tokens += done.step_tokens
        replies += done_turns
    return Pass(replies, sum(map(len, replies)), time.perf_counter() - start, steps, step_tokens, tuple(firsts))


# -- the benchmark ------------------------------------------------------------
def run_bench(methods: Sequence[Method], repeats: int, warmup: int = 1, device: str | torch.device = "cpu",
              progress: Callable[[str, float], None] | None = None,
              on_round: Callable[[dict[str, list[Pass]]], None] | None = None) -> dict[str, list[Pass]]:
    """The timed passes of each method: ``warmup`` untimed rounds, then ``repeats`` rounds,
    the methods interleaved within each round. ``on_round`` gets the passes so far after
    every timed round (so a run cut short still leaves its finished rounds)."""
    if repeats < 1 or warmup < 0:
        raise SpecMemoError(f"--repeats must be at least 1, got {repeats}")
    device = torch.device(device)
    passes: dict[str, list[Pass]] = {m.name: [] for m in methods}
    rounds = warmup + repeats
    for r in range(rounds):
        for i, method in enumerate(methods):
            if progress:
                label = "warm-up" if r < warmup else f"repeat {r - warmup + 1}/{repeats}"
                progress(f"bench {label}", (r * len(methods) + i) / (rounds * len(methods)))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            result = method.run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                result = replace(result, peak_bytes=torch.cuda.max_memory_allocated(device))
            if r >= warmup:
                passes[method.name].append(result)
        if on_round is not None and r >= warmup:
            on_round(passes)
    return passes


def identical_count(replies: Sequence[Sequence[int]], baseline: Sequence[Sequence[int]]) -> int:
    """Replies equal token for token to the baseline's reply to the same query."""
    if len(replies) != len(baseline):
        raise SpecMemoError(f"{len(replies)} replies against {len(baseline)} baseline replies: not the same workload")
    return sum(list(a) == list(b) for a, b in zip(replies, baseline))


def summarize(method: Method, passes: Sequence[Pass], baseline: Sequence[Sequence[int]] | None) -> dict[str, Any]:
    """One method's report entry. Replies are greedy, so every pass gives the same ones;
    the identical count is taken over the last pass."""
    speeds = Spread.of([p.tokens_per_s for p in passes])
    last = passes[-1]
    peaks = [p.peak_bytes for p in passes if p.peak_bytes is not None]
    return {
        "tree": method.tree,
        "tree_nodes": method.tree_nodes,
        "tokens_per_s": speeds.as_dict(),
        "tokens_per_s_passes": [round(p.tokens_per_s, 3) for p in passes],
        "tokens_per_step": round(statistics.mean(p.tokens_per_step for p in passes), 4),
        "mean_accepted": round(statistics.mean(p.mean_accepted for p in passes), 4),
        "time_to_first_token_s": round(statistics.median(t for p in passes for t in p.first_token_s), 4)
        if last.first_token_s else None,
        # ms a step took (from the last step's result to this one's) and the share of a pass in
        # steps: the rest is prefills, templating and turn set-up
        "step_ms": round(statistics.median(1e3 * p.decode_seconds / p.steps for p in passes), 4)
        if last.decode_seconds is not None and all(p.steps for p in passes) else None,
        "steps_share": round(statistics.median(p.decode_seconds / p.seconds for p in passes), 4)
        if last.decode_seconds is not None and all(p.seconds > 0 for p in passes) else None,
        "new_tokens": last.new_tokens,
        "replies": len(last.replies),
        "identical_to_vanilla": identical_count(last.replies, baseline) if baseline is not None else None,
        "tree_buffer_bytes": method.tree_buffer_bytes,
        "tree_buffer_source": TREE_BUFFER_SOURCE if method.tree_buffer_bytes is not None else "not modelled",
        "peak_bytes": max(peaks) if peaks else method.predicted_bytes,
        "peak_source": CUDA_PEAK_SOURCE if peaks else (PREDICTED_PEAK_SOURCE if method.predicted_bytes
                                                        else "not modelled"),
        "note": method.note,
    }


def report(methods: Sequence[Method], passes: dict[str, list[Pass]]) -> dict[str, dict[str, Any]]:
    """{method: summary}, in the order given, with speed ratios against ``hf``, ``vanilla``
    and ``vanilla+graphs``; replies are compared with ``vanilla``'s, else (a GPU run
    without the slow eager decoder) with ``vanilla+graphs``' (``identical_baseline``).
    (The CLI adds one more key, ``_run``, with the settings: see ``run_info``.)"""
    baseline = next((name for name in ("vanilla", "vanilla+graphs") if name in passes), None)
    base = passes[baseline][-1].replies if baseline else None
    out = {m.name: summarize(m, passes[m.name], base) | {"identical_baseline": baseline} for m in methods}
    for ref in ("hf", "vanilla", "vanilla+graphs"):
        if ref in out:
            ref_speed = out[ref]["tokens_per_s"]["median"]
            for entry in out.values():
                entry[f"vs_{ref}"] = round(entry["tokens_per_s"]["median"] / ref_speed, 3) if ref_speed else None
    return out


def run_info(model_name: str, device: str, dtype: str, *, conversations: Sequence[Sequence[str]],
             max_new_tokens: int, repeats: int, methods: Sequence[str], warmup: int = 1) -> dict[str, Any]:
    """The report's ``_run`` entry: the settings and the machine, so a result can be re-run."""
    import os

    import transformers

    from specmemo_core.planning.device import cpu_device

    on_cuda = torch.device(device).type == "cuda"
    return {
        "model": model_name, "device": device,
        "device_name": torch.cuda.get_device_name(torch.device(device)) if on_cuda else cpu_device().name,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "dtype": dtype,
        "queries": sum(map(len, conversations)), "conversations": len(conversations),
        "max_new_tokens": max_new_tokens, "repeats": repeats, "warmup_rounds": warmup, "methods": list(methods),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }


def plot_report(result: dict[str, Any], png: str | Path) -> Path:
    """Draw ``result`` as a PNG bar chart (``app.bench_plot``) in a child process: the chart
    is drawn with Qt, and the core never imports Qt."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bench.json"
        src.write_text(json.dumps(result), encoding="utf-8")
        done = subprocess.run([sys.executable, "-m", "app.bench_plot", str(src), str(png)],
                              capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise SpecMemoError(f"could not draw the chart {png}: {why}")
    return Path(png)


# -- memory model and the planner's choice ------------------------------------
def predicted_memory(model: Any, heads: Any, tree: Any, precision: str, device_kind: str) -> tuple[int, int]:
    """(tree-buffer bytes, total bytes) the planner's memory model gives our decoder with
    ``tree`` (None: plain) and a ``BENCH_CONTEXT``-token KV cache."""
    from specmemo_core.planning.memory import HeadsShape, ModelShape, TreeShape
    from specmemo_core.planning.planner import memory_terms

    shape = ModelShape.from_spec(model.spec)
    tree_shape = TreeShape.of(tree)
    heads_shape = HeadsShape.from_spec(heads.spec) if (heads is not None and tree_shape.nodes > 1) else None
    terms = memory_terms(shape, heads_shape, precision=precision, kind=device_kind, kv_tokens=BENCH_CONTEXT,
                         tree=tree_shape)
    return terms["tree_buffers"], sum(terms.values())


def planner_choice(engine: Any, precision: str, reply_tokens: int, *, timing: StepTiming | None = None,
                   data_folder: Path | None = None, batch: int = 1) -> Any:
    """The Plan for this device through the one plan entry (``planning.entry``), as the app
    and ``specmemo chat`` make it: the device's free memory, the heads' calibrated trees
    (else SpecMemo's prior), and the device timing (``timing``, else the cached one in
    ``data_folder``, else measured now); for ``batch`` conversations decoded together."""
    from specmemo_core.planning.entry import PlanChoices, find_device, make_plan, plan_inputs
    from specmemo_core.planning.host import host_link_for
    from specmemo_core.planning.timing import timing_for

    info = find_device(engine.model.device.type)  # the device the engine runs on, as every entry point finds it
    timing = timing or timing_for(engine, info.name, data_folder, precision)
    inputs = plan_inputs(engine, info, timing, link=host_link_for(info, data_folder))
    return make_plan(inputs, PlanChoices(reply_tokens=reply_tokens, precision=precision, batch=batch))


def build_methods(names: Sequence[str], engine: Any, hf: Any, conversations: Sequence[Sequence[str]], *,
                  max_new_tokens: int, precision: str,
                  plan_timing: StepTiming | None = None, data_folder: Path | None = None) -> list[Method]:
    """Methods by name over a loaded Engine (ours) and a transformers model (``hf``)."""
    from specmemo_core.runtime.chat import end_of_turn_ids
    from specmemo_core.runtime.engine import resolve_tree
    from specmemo_core.runtime.model import compiled_regions

    kind = engine.model.device.type
    stops = end_of_turn_ids(engine.tokenizer, engine.config)
    methods: list[Method] = []
    # one compiled LayerRegions for every +compiled method (so they share what was compiled)
    compiled = compiled_regions() if any(method_suffixes(n)[1] for n in names) else None

    def ours(name: str, tree: Any, note: str = "", graphs: bool = False) -> Method:
        buffers, total = predicted_memory(engine.model, engine.heads, tree, precision, kind)
        _, is_compiled, serial = method_suffixes(name)
        regions = compiled if is_compiled else None
        note = "; ".join(n for n in (note, regions is not None and "compiled layer regions", serial and "serial steps") if n)
        run = ours_runner(engine, conversations, tree, max_new_tokens=max_new_tokens, graphs=graphs, regions=regions,
                          serial=serial)
        return Method(name, run, tree.name if tree is not None else None, tree.num_nodes if tree is not None else 1,
                      buffers, total, note)

    for full_name in names:
        # NAME+graphs: the same method on the static-shape decoder (CUDA graphs on a GPU); then +compiled:
        # its layers' regions through torch.compile (model.compiled_regions); then +serial: no overlapped steps
        base = method_suffixes(full_name)[0]
        if base != full_name and base.split("+", 1)[0] in HF_METHODS:
            raise SpecMemoError(f"method {full_name}: +compiled and +serial apply to our decoder, not to transformers")
        name, graphs = (base[: -len("+graphs")], True) if base.endswith("+graphs") else (base, False)
        graphs = graphs or (name == "plan" and kind == "cuda" and engine.model.capturable)  # as the app runs it
        if graphs and kind == "cuda" and not engine.model.capturable:
            raise SpecMemoError(f"method {full_name}: a model split over two GPUs steps eagerly (one CUDA graph "
                                "holds one device's kernels); bench it without +graphs")
        graph_note = "static shapes" + (", CUDA graphs" if kind == "cuda" else ", eager (no GPU)") if graphs else ""
        if graphs and name in HF_METHODS:
            raise SpecMemoError(f"method {full_name}: +graphs applies to our decoder, not to transformers")
        if name in HF_METHODS:
            if hf is None:
                raise SpecMemoError(f"method {name} needs the transformers model")
            pld = PLD_TOKENS if name == "hf-pld" else None
            note = f"prompt lookup, {PLD_TOKENS} tokens" if pld else ""
            methods.append(Method(name, hf_runner(hf, engine.tokenizer, stops, conversations, max_new_tokens, pld),
                                  note=note + ("; " if note else "") + "re-prefills the conversation every turn"))
        elif name == "vanilla":
            methods.append(ours(full_name, None, graph_note, graphs))
        elif name == "plan":
            chosen = planner_choice(engine, precision, max_new_tokens, timing=plan_timing,
                                    data_folder=data_folder)
            tree = resolve_tree(chosen.tree, engine.heads_folder) if chosen.tree else None
            speed = chosen.predicted_tokens_per_s
            note = (f"planner chose {chosen.tree or 'plain decoding'}"
                    + (f", predicted {speed:.1f} tokens/s" if speed else "") + (f"; {graph_note}" if graphs else ""))
            methods.append(ours(full_name, tree, note, graphs))
        else:
            tree = resolve_tree(name, engine.heads_folder)
            tree.check_heads(engine.heads)
            methods.append(ours(full_name, tree, graph_note, graphs))
    return methods


# -- output -------------------------------------------------------------------
def format_table(result: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'method':<14}{'tree':<16}{'tok/s median':>13}{'min':>8}{'max':>8}{'tok/step':>9}{'TTFT s':>8}"
             f"{'buffers MiB':>12}{'peak MiB':>10}{'identical':>10}"]
    mib = lambda n: f"{n / 2**20:.1f}" if n is not None else "-"  # noqa: E731
    for name, r in result.items():
        if name.startswith("_"):
            continue
        s = r["tokens_per_s"]
        same = f"{r['identical_to_vanilla']}/{r['replies']}" if r["identical_to_vanilla"] is not None else "-"
        ttft = f"{r['time_to_first_token_s']:.3f}" if r["time_to_first_token_s"] is not None else "-"
        lines.append(f"{name:<14}{(r['tree'] or 'plain')[:15]:<16}{s['median']:>13.2f}{s['min']:>8.2f}"
                     f"{s['max']:>8.2f}{r['tokens_per_step']:>9.2f}{ttft:>8}{mib(r['tree_buffer_bytes']):>12}"
                     f"{mib(r['peak_bytes']):>10}{same:>10}")
    return "\n".join(lines)
