"""The host→device link: copies of streamed weights into staging slots, ordered against
the compute that reads them, and a measurement of the link's bandwidth.

A ``Link`` knows two events per staging slot: a copy into the slot has *arrived*, and the
compute has *released* the slot (the layer that read it has run). On CUDA and ROCm
(``StreamLink``) the copies run on a side stream and both orders are CUDA events, so the
host never waits: the compute stream waits for a slot's arrival, the copy stream for
its release. On CPU and MPS (``SyncLink``) a copy is done when it is sent, so both
orders hold by themselves; it runs the same streaming code (``offload.LayerStreamer``)
with a synchronous copy function, which is how the CPU tests check that code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import weakref

import torch

from specmemo_core.errors import OffloadError

Copy = Callable[[torch.Tensor, torch.Tensor], None]  # copy(dst, src): src's bytes into dst


def sync_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def async_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Enqueue on the current stream; from pinned host memory the host does not wait."""
    dst.copy_(src, non_blocking=True)


class Link(Protocol):
    def send(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (host) into ``dst`` (staging ``slot``) once the slot is released."""
        ...

    def wait_arrival(self, slot: int) -> None:
        """Make the compute that follows wait for the last copy sent into ``slot``."""
        ...

    def release(self, slot: int) -> None:
        """The compute enqueued so far is the last to read ``slot`` before its next copy."""
        ...

    def drain(self) -> None:
        """Wait, on the host, for every copy sent (after an interrupted forward)."""
        ...


@dataclass
class SyncLink:
    """A link whose copies are done when sent (CPU, MPS: offload is never planned there,
    but the streaming code runs the same way)."""

    copy: Copy = sync_copy

    def send(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copy(dst, src)

    def wait_arrival(self, slot: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def drain(self) -> None:
        pass


@dataclass
class StreamLink:
    """Copies on a side CUDA stream, ordered by two events per slot (made once); the
    host enqueues and never synchronises per layer."""

    device: torch.device
    slots: int
    copy: Copy = async_copy
    stream: torch.cuda.Stream = field(init=False)
    arrived: list[torch.cuda.Event] = field(init=False)
    released: list[torch.cuda.Event] = field(init=False)

    def __post_init__(self) -> None:
        self.stream = torch.cuda.Stream(self.device)
        self.arrived = [torch.cuda.Event() for _ in range(self.slots)]
        self.released = [torch.cuda.Event() for _ in range(self.slots)]

    def send(self, slot: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.released[slot])  # never recorded yet: no wait
            self.copy(dst, src)
            self.arrived[slot].record(self.stream)

    def wait_arrival(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.arrived[slot])

    def release(self, slot: int) -> None:
        self.released[slot].record(torch.cuda.current_stream(self.device))

    def drain(self) -> None:
        self.stream.synchronize()


def streams_copies(device: torch.device) -> bool:
    """Whether copies to ``device`` can overlap its compute (CUDA and ROCm builds)."""
    return device.type == "cuda"


def link_for(device: torch.device | str, slots: int, copy: Copy | None = None) -> Link:
    """The link to ``device``: a side stream on CUDA/ROCm, synchronous copies elsewhere.
    ``copy``: the copy function (default: non-blocking on CUDA, plain elsewhere)."""
    device = torch.device(device)
    if streams_copies(device):
        return StreamLink(device, slots, copy or async_copy)
    return SyncLink(copy or sync_copy)


def host_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Host bytes (uint8 ``shape``) to stream to ``device``: page-locked where copies to it
    stream (so they run without the host), and exactly ``shape``'s size. Not through
    ``pin_memory=True``: torch's pinned allocator rounds every block up to a power of two,
    so 13.5 GB of streamed layers would lock 16 GB (pytorch/pytorch#150517)."""
    buf = torch.empty(shape, dtype=torch.uint8)
    if streams_copies(device) and buf.numel():
        _pin(buf)
    return buf


def _pin(buf: torch.Tensor) -> None:
    """Page-lock ``buf`` in place (cudaHostRegister) until it is freed."""
    ptr, size = buf.data_ptr(), buf.numel()
    try:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, size, 0))
    except RuntimeError as e:
        raise OffloadError(f"could not page-lock {size / 2**30:.2f} GiB of host memory for the streamed layers "
                           f"({e}); free RAM, or plan more layers on the GPU") from e
    weakref.finalize(buf, _unpin, ptr)


def _unpin(ptr: int) -> None:
    torch.cuda.synchronize()  # no copy from the buffer may still be in flight
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_to_device_bandwidth(device: torch.device | str, *, nbytes: int = 256 * 2**20,
                             repeats: int = 5) -> float | None:
    """Measured host→device bandwidth in bytes/s: the best of ``repeats`` copies of a
    pinned ``nbytes`` buffer, timed with CUDA events. None off CUDA/ROCm (CPU, MPS: the
    memory is the host's, and offload is never planned there)."""
    device = torch.device(device)
    if not streams_copies(device):
        return None
    with torch.cuda.device(device):
        host = host_buffer((nbytes,), device)  # page-locked as the streamed layers are
        target = torch.empty(nbytes, dtype=torch.uint8, device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        target.copy_(host, non_blocking=True)  # warm-up: first touch of both buffers
        torch.cuda.synchronize(device)
        stream, best = torch.cuda.current_stream(device), float("inf")
        for _ in range(repeats):
            start.record(stream)
            target.copy_(host, non_blocking=True)
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000.0)
        return nbytes / best

