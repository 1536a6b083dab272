"""Whether a family of our Triton kernels builds and answers right on a device.

Triton compiles with the system's C compiler and for the GPU's architecture, so a machine
without one, or a GPU it does not target, must fall back to the torch path (the log says
why) instead of failing a reply. Each family is tried once per process, device and dtype on
a small input against torch: a fact of the machine, like Triton's own import cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger(__name__)
# (family, device, dtype) -> whether its kernels built and ran right there
_PROBED: dict[tuple[str, torch.device, torch.dtype], bool] = {}


def runs_on(family: str, device: torch.device, dtype: torch.dtype,
            probe: Callable[[torch.device, torch.dtype], bool]) -> bool:
    """``probe(device, dtype)``'s answer, asked once. Inside a CUDA graph capture nothing is
    tried (a compile there would break the capture): False, until an eager run has tried."""
    key = (family, device, dtype)
    if key not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[key] = probe(device, dtype)
    return _PROBED[key]


def failed(family: str, device: torch.device, error: Exception, fallback: str) -> bool:
    """Log why ``family`` cannot run on ``device`` (a build or launch error) and answer False."""
    log.warning("%s unavailable on %s (%s: %s); %s", family, device, type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "", fallback)
    return False


def wrong(family: str, device: torch.device, error: float, fallback: str) -> bool:
    """Log that ``family`` answered wrong on ``device`` (its largest error) and answer False."""
    log.warning("%s gave wrong results on %s (max error %.3g); %s", family, device, error, fallback)
    return False


def source_revision(module_file: str, kernels: str) -> str:
    """A short hash of a module's source and its kernels' (``kernels``: the file beside it): a GPU
    step timed under other kernels is timed again (``planning.timing.engine_timing_key``)."""
    here = Path(module_file).resolve()
    return hashlib.sha256(here.read_bytes() + here.with_name(kernels).read_bytes()).hexdigest()[:12]


@functools.cache
def shared_bytes(device: torch.device) -> int:
    """Shared memory one program (a thread block) may use on ``device``, as Triton checks it before
    a launch (its driver's ``max_shared_mem``: 227 KB on an H100 or H200, ~100 KB on most laptop
    GPUs); no bound off a GPU (Triton's interpreter)."""
    if device.type != "cuda":
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - an older Triton: torch's figure, else the least of CUDA GPUs since Volta
        return getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0) or 99 << 10


@functools.cache
def processors(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (132 on an H100 SXM, 20–60 on laptop GPUs); 0
    off a GPU (Triton's interpreter: no figure to fill)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def fitting_stages(stages: int, *, stage_bytes: int, shared_bytes: int) -> int:
    """The most of ``stages`` (a kernel's loads in flight, ``stage_bytes`` of buffers each) that fit
    ``shared_bytes``, at least one: Triton refuses a kernel that asks more than a block has, and the
    stages change only how far loads run ahead, not the arithmetic."""
    return max(1, min(stages, shared_bytes // stage_bytes))
