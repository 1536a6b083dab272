"""Draft heads for the user's own model: the app's "Speed up this model" and ``specmemo speed-up``.

One job, three functions, the same for the app and the terminal:

- ``speed_up_job``: what to train (the shipped prompt files, or the user's own) and where
  the result goes: ``<data folder>/heads/<model>-<fingerprint>/``, beside the model caches,
  where ``Engine.load``'s default heads (``HeadsChoice.SHIPPED``) find it next time, before
  any heads shipped with the app.
- ``estimate_training``: times a few real steps of each stage on this device (a batch of
  replies, a batch of hidden states, a few training steps) and multiplies them out, so the
  user sees the time before anything long starts.
- ``train_speed_up_heads``: the pipeline (``pipeline.run_training``), stopped at the next
  progress report when ``cancel`` is set; running it again resumes (every stage keeps its
  result, training its checkpoint).
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from specmemo_core.errors import SpecMemoError
from specmemo_core.storage.trained_heads import CARD_FILE, finished, trained_heads_dir
from specmemo_core.tools.train.pipeline import PipelineConfig, run_training, trainer_dtype, trainer_model
from specmemo_core.tools.train.trainer import TrainConfig

Progress = Callable[[str, float], None]

ASSETS_PROMPTS = Path(__file__).resolve().parents[3] / "assets" / "prompts"
SHIPPED_PROMPTS = ASSETS_PROMPTS / "heads_training.jsonl.gz"  # scripts/make_training_prompts.py
SHIPPED_HELDOUT = ASSETS_PROMPTS / "heads_heldout.jsonl.gz"
JOB_FILE = "job.json"  # the job a folder is being trained for (a resumed run must match it)
HELDOUT_REPLY_TOKENS = 128  # the shipped heads' calibration replies
ESTIMATE_PROMPT_TOKENS = 96  # a typical templated ShareGPT first turn of the shipped file
ESTIMATE_TRAIN_STEPS = 3  # timed training steps (after one untimed)
MEAN_REPLY_TOKENS = 200.0  # the shipped heads' distilled replies averaged 198 tokens of 256
LONGEST_PROMPT_TOKENS = 1024  # generate_replies drops longer prompts
MEMORY_MARGIN = 1.10  # allocator slack and what the estimates leave out


class TrainingDoesNotFitError(SpecMemoError):
    """Training heads for this model would need more memory than this computer has free; the
    message says how much, and how many prompts would fit."""


class TrainingCancelled(SpecMemoError):
    """The user stopped training heads; what was done is kept and the next run resumes there."""

    def __init__(self) -> None:
        super().__init__("training the heads was stopped; start it again to resume where it stopped")


@dataclass(frozen=True)
class SpeedUpJob:
    """Train ``config`` for ``config.model`` on ``device`` into ``out``."""

    config: PipelineConfig
    out: Path
    device: str

    @property
    def started(self) -> bool:
        """Some of it is done already (the next run resumes)."""
        return (self.out / JOB_FILE).exists() and not finished(self.out)


def speed_up_job(model: str, *, name: str, fingerprint: str, device: str, data_folder: Path,
                 prompts_file: str | Path | None = None, prompts: int | None = None,
                 steps: int | None = None) -> SpeedUpJob:
    """The default job for a model: heads like the shipped ones (4 hydra heads with a context
    layer that reads the next token, an 8,192-token drafting vocabulary), self-distilled on
    the shipped ShareGPT prompts (or the user's ``prompts_file``, MT-Bench style JSONL) and
    calibrated on the shipped held-out mix. Replies are generated 256 at a time on a GPU, 16
    on a CPU."""
    on_gpu = not str(device).startswith("cpu")
    train = TrainConfig() if steps is None else TrainConfig(steps=steps)
    config = PipelineConfig(
        model=str(model), kind="hydra", num_heads=4, num_layers=1, context=True, context_next=True,
        train_prompts=prompts if prompts is not None else 8000,
        prompts_file=str(prompts_file or SHIPPED_PROMPTS), heldout_file=str(SHIPPED_HELDOUT), heldout_prompts=400,
        max_new_tokens=256, gen_batch=256 if on_gpu else 16, train=train)
    return SpeedUpJob(config, trained_heads_dir(data_folder, name, fingerprint), str(device))


def _job_record(job: SpeedUpJob) -> dict[str, Any]:
    return {"config": asdict(job.config), "device_kind": torch.device(job.device).type}


def _claim(job: SpeedUpJob) -> None:
    """Write the job into its folder; refuse a folder half-trained for another job."""
    job.out.mkdir(parents=True, exist_ok=True)
    path = job.out / JOB_FILE
    record = _job_record(job)
    if path.exists() and not finished(job.out):
        old = json.loads(path.read_text())
        if old["config"] != record["config"]:
            raise SpecMemoError(f"{job.out} holds heads half-trained with other settings; delete that folder "
                                "to start over, or resume with the same prompts and steps")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def train_speed_up_heads(job: SpeedUpJob, *, progress: Progress | None = None,
                         cancel: threading.Event | None = None,
                         log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Train, calibrate and store the job's heads; returns their card. Raises
    ``TrainingCancelled`` at the next progress report once ``cancel`` is set; running the
    same job again resumes. A folder with finished heads is trained again from the start."""
    if finished(job.out):
        for name in (CARD_FILE, "heads.safetensors", "calibration.json"):
            (job.out / name).unlink(missing_ok=True)  # stage files stay: the replies are reused
    _claim(job)

    def checked(stage: str, fraction: float) -> None:
        if cancel is not None and cancel.is_set():
            raise TrainingCancelled()
        if progress is not None:
            progress(stage, fraction)

    checked("starting", 0.0)
    return run_training(job.config, job.out, job.device, checked, log=log or (lambda _m: None))


@dataclass(frozen=True)
class TrainingEstimate:
    """Seconds each stage should take on this device, from timed steps (``estimate_training``)."""

    stages: dict[str, float]  # replies, hidden states, training, calibration
    device_name: str
    features_bytes: int  # host memory the hidden states take (positions × hidden × 2 bytes, × 2 with context)
    step_times: dict[str, float]  # the measured figures the stages are made of

    @property
    def total_s(self) -> float:
        return sum(self.stages.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {_duration(v)}" for k, v in self.stages.items())
        return f"about {_duration(self.total_s)} on {self.device_name} ({parts})"

    def as_dict(self) -> dict[str, Any]:
        return {"total_s": round(self.total_s, 1), "stages_s": {k: round(v, 1) for k, v in self.stages.items()},
                "device": self.device_name, "features_bytes": self.features_bytes,
                "step_times_s": {k: round(v, 6) for k, v in self.step_times.items()}}


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"{platform.processor() or 'CPU'} ({torch.get_num_threads()} threads)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _generate_times(hf: Any, batch: int, device: torch.device) -> tuple[float, float]:
    """(prefill s, s per new token) of one batched ``generate`` of ``batch`` prompts."""
    vocab = hf.config.vocab_size
    ids = torch.randint(0, vocab, (batch, ESTIMATE_PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def run(n: int) -> None:
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)

    run(2)  # warm-up
    short, long = 2, 10
    t_short, t_long = _timed(device, lambda: run(short)), _timed(device, lambda: run(long))
    per_token = max((t_long - t_short) / (long - short), 1e-6)
    return max(t_short - short * per_token, 0.0), per_token


def _feature_time(hf: Any, batch: int, length: int, device: torch.device) -> float:
    ids = torch.randint(0, hf.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)

    def run() -> None:
        with torch.inference_mode():
            hf.model(input_ids=ids, attention_mask=torch.ones_like(ids))

    run()
    return _timed(device, run)


def _train_step_time(hf: Any, config: PipelineConfig, device: torch.device, reply_tokens: int) -> float:
    """Seconds per training step: the real trainer on hidden states of ``hf`` over random sequences."""
    from specmemo_core.runtime.heads import HeadsSpec
    from specmemo_core.tools.train.distill import Sequences
    from specmemo_core.tools.train.features import build_features
    from specmemo_core.tools.train.pipeline import _context_shape, base_rope, frozen_io
    from specmemo_core.tools.train.trainer import train_heads

    gen = torch.Generator().manual_seed(2)
    vocab = hf.config.vocab_size
    rows_needed = config.train.batch_size * 2
    count = max(2, math.ceil(rows_needed / max(reply_tokens, 1)))
    pairs = [(torch.randint(0, vocab, (ESTIMATE_PROMPT_TOKENS,), generator=gen).tolist(),
              torch.randint(0, vocab, (reply_tokens,), generator=gen).tolist()) for _ in range(count)]
    feats = build_features(hf, Sequences.from_pairs(pairs), config.num_heads, keep_all=config.context)
    spec = HeadsSpec(config.kind, config.num_heads, config.num_layers, hf.config.hidden_size, vocab, False,
                     "estimate", "0", **_context_shape(config, hf.config),
                     draft_vocab=min(config.draft_vocab, vocab) if config.kind == "hydra" else 0)
    embed, lm_head = frozen_io(hf)
    stamps: list[float] = []

    def stamp(_stage: str, _fraction: float) -> None:
        _sync(device)
        stamps.append(time.perf_counter())

    steps = ESTIMATE_TRAIN_STEPS + 1
    train_heads(feats, spec, embed, lm_head, replace(config.train, steps=steps, checkpoint_every=10 ** 9),
                device=device, progress=stamp, rope=base_rope(hf.config))
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def estimate_training(job: SpeedUpJob, hf: Any, *, prompts: int | None = None, heldout_replies: int = 280,
                      mean_reply_tokens: float = MEAN_REPLY_TOKENS, progress: Progress | None = None
                      ) -> TrainingEstimate:
    """Time ``job`` on this device with ``hf`` (the base model as transformers runs it: real
    weights, or random ones of a real shape) and multiply it out:

    - replies: ⌈prompts / gen_batch⌉ batched ``generate`` calls of ``max_new_tokens``
      (a batch runs until its longest reply ends), from a timed prefill and per-token time;
    - hidden states: one forward over 32 sequences of prompt + a mean reply, per 32 replies
      (on a CPU 8 sequences are timed, ×4);
    - training: ``train.steps`` × a timed step of the real trainer;
    - calibration: the held-out replies (``heldout_replies`` of ``HELDOUT_REPLY_TOKENS``),
      their hidden states twice (features, then the heads' ranks), scaled by length.

    ``mean_reply_tokens``: the shipped heads' replies averaged 198 tokens of 256."""
    cfg = job.config
    device = next(hf.parameters()).device
    count = prompts if prompts is not None else cfg.train_prompts
    report = progress or (lambda _s, _f: None)
    report("timing replies", 0.0)
    prefill, per_token = _generate_times(hf, cfg.gen_batch, device)
    report("timing hidden states", 0.4)
    length = ESTIMATE_PROMPT_TOKENS + int(mean_reply_tokens)
    # a CPU's forward is compute-bound, linear in the batch: time a quarter of one
    timed_rows = 32 if device.type == "cuda" else 8
    feature_batch = _feature_time(hf, timed_rows, length, device) * 32 / timed_rows
    report("timing training steps", 0.6)
    train_step = _train_step_time(hf, cfg, device, int(mean_reply_tokens))
    report("timing done", 1.0)
    batches = math.ceil(count / cfg.gen_batch)
    held_batches = math.ceil(heldout_replies / cfg.gen_batch)
    held_feature = feature_batch * (ESTIMATE_PROMPT_TOKENS + HELDOUT_REPLY_TOKENS) / length
    stages = {
        "replies": batches * (prefill + cfg.max_new_tokens * per_token),
        "hidden states": math.ceil(count / 32) * feature_batch,
        "training": cfg.train.steps * train_step,
        "calibration": held_batches * (prefill + HELDOUT_REPLY_TOKENS * per_token)
                       + 2 * math.ceil(heldout_replies / 32) * held_feature,
    }
    features_bytes = hidden_states_bytes(hf.config.hidden_size, cfg, count, mean_reply_tokens)
    times = {"prefill_s": prefill, "per_token_s": per_token, "feature_batch_s": feature_batch,
             "train_step_s": train_step, "gen_batch": cfg.gen_batch}
    return TrainingEstimate(stages, _device_name(device), features_bytes, times)


def base_model_for(model: str, device: str, progress: Progress | None = None) -> tuple[Any, str, str]:
    """The base model as the trainer runs it (``pipeline.trainer_model``) and its (name,
    fingerprint). ``shape:NAME``: random weights of that real shape (for estimates of models
    that are not here)."""
    if str(model).startswith("shape:"):
        from transformers import AutoModelForCausalLM

        from specmemo_core.planning.memory import known_shape
        from specmemo_core.planning.plan_check import shape_config

        name = str(model)[len("shape:"):]
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(shape_config(known_shape(name)), dtype=trainer_dtype(device))
        return hf.eval().requires_grad_(False), name, "shape"
    loaded, hf = trainer_model(model, device, progress)
    return hf, loaded.identity.name, loaded.identity.fingerprint


def hidden_states_bytes(hidden_size: int, config: PipelineConfig, replies: int,
                        mean_reply_tokens: float = MEAN_REPLY_TOKENS) -> int:
    """The training features (``features.build_features``, bf16): every training position's
    hidden state, and with a context layer every position's too."""
    positions = int(replies * (ESTIMATE_PROMPT_TOKENS + mean_reply_tokens))
    return positions * hidden_size * 2 * (2 if config.context else 1)


@dataclass(frozen=True)
class TrainingMemory:
    """What training ``replies`` replies needs, before anything is loaded (``training_memory``)."""

    replies: int
    weights_bytes: int  # the base model in the trainer's dtype
    hidden_bytes: int  # the features (host memory, and on a GPU the device too: training moves them there)
    host_bytes: int  # RAM: the weights read and built once more, the features
    device_bytes: int  # GPU: the weights, the features, the fp32 embedding and LM head, a reply batch's KV (0 on a CPU)


def training_memory(shape: Any, job: SpeedUpJob, replies: int | None = None) -> TrainingMemory:
    """The memory ``job`` needs for a model of ``shape`` (``planning.memory.ModelShape``)."""
    from specmemo_core.planning.memory import kv_bytes

    cfg = job.config
    count = cfg.train_prompts if replies is None else replies
    dtype = trainer_dtype(job.device)
    weights = shape.params * dtype.itemsize
    hidden = hidden_states_bytes(shape.hidden_size, cfg, count)
    host = int((2 * weights + hidden) * MEMORY_MARGIN)  # the weights read, the model built from them
    device = 0
    if not job.device.startswith("cpu"):
        frozen = 2 * shape.vocab_size * shape.hidden_size * 4  # frozen_io's fp32 embedding and LM head
        kv = kv_bytes(shape, cfg.gen_batch * (LONGEST_PROMPT_TOKENS + cfg.max_new_tokens), "bf16")
        device = int((weights + hidden + frozen + kv) * MEMORY_MARGIN)
    return TrainingMemory(count, weights, hidden, host, device)


def _fitting_replies(shape: Any, job: SpeedUpJob, free: int, need: Callable[[TrainingMemory], int]) -> int:
    """The most replies (a multiple of 100) whose training fits in ``free`` bytes, 0 if none."""
    best, step = 0, 100
    while best + step <= job.config.train_prompts and need(training_memory(shape, job, best + step)) <= free:
        best += step
    return best


def check_training_fits(shape: Any, job: SpeedUpJob, *, free_ram: int, free_device: int | None,
                        replies: int | None = None) -> TrainingMemory:
    """``training_memory`` for ``job``, or ``TrainingDoesNotFitError`` saying what is short and
    how many prompts would fit. ``free_device``: the GPU's free bytes (None on a CPU)."""
    memory = training_memory(shape, job, replies)
    gib = 2 ** 30
    checks = [("RAM", memory.host_bytes, free_ram, lambda m: m.host_bytes)]
    if free_device is not None and memory.device_bytes:
        checks.append(("GPU memory", memory.device_bytes, free_device, lambda m: m.device_bytes))
    for what, need, free, of in checks:
        if need <= free:
            continue
        fits = min(_fitting_replies(shape, job, f, g) for _, _, f, g in checks)
        advice = (f"train on {fits} prompts or fewer (--prompts {fits}, or a prompt file that short)" if fits
                  else "the model itself does not leave room: train on a computer with more memory")
        raise TrainingDoesNotFitError(
            f"training heads needs about {need / gib:.1f} GiB of {what} ({memory.weights_bytes / gib:.1f} GiB of "
            f"weights, {memory.hidden_bytes / gib:.1f} GiB of hidden states for {memory.replies} replies) and "
            f"{free / gib:.1f} GiB is free: {advice}, or close other programs")
    return memory


def preflight(job: SpeedUpJob, replies: int | None = None, *, opened: Any = None) -> TrainingMemory:
    """Check ``job`` against this computer's free RAM (and GPU memory) from the model file's
    header alone, before its weights are read; see ``check_training_fits``. ``opened``: the
    model's header already opened (``storage.sources.open_model``), so it is not read again."""
    import psutil

    from specmemo_core.planning.memory import ModelShape, known_shape
    from specmemo_core.runtime.model import ModelSpec
    from specmemo_core.storage.sources import open_model

    source = job.config.model
    if source.startswith("shape:"):
        shape = known_shape(source[len("shape:"):])
    else:
        shape = ModelShape.from_spec(ModelSpec.from_config((opened or open_model(source)).config))
    free_device = None
    if not job.device.startswith("cpu") and torch.cuda.is_available():
        free_device = int(torch.cuda.mem_get_info(torch.device(job.device))[0])
    return check_training_fits(shape, job, free_ram=int(psutil.virtual_memory().available),
                               free_device=free_device, replies=replies)
