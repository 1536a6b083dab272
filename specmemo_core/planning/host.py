"""The host side of a plan, read at start-up: free RAM and the host→GPU link's bandwidth.

Every entry point gets both through ``planning.entry`` (``host_link_for``), so a plan that
streams decoder layers (``planning/offload.py``) checks its pinned bytes against the RAM
that is free now and prices each step with the link this machine has.

- Free RAM is read each time (``psutil``: memory the OS can give without swapping).
- The bandwidth is measured once per GPU and torch version (a page-locked 64 MiB copy,
  best of 3: well under a second) and kept in the data folder, as the step timing is
  (``planning/timing.py``); later starts read the number.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from specmemo_core.planning.device import DeviceInfo
from specmemo_core.planning.offload import OFFLOAD_KINDS, HostLink

log = logging.getLogger(__name__)

LINK_FILE = "host_link.json"
PROBE_BYTES = 64 * 2**20
PROBE_REPEATS = 3
ASSUMED_GB_S = 25.0  # PCIe 4.0 x16 in practice: for plans made for a GPU that is not here


def free_host_ram() -> int:
    """Bytes of RAM the OS can hand out now without swapping (``MemAvailable``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:  # NOTE: psutil is a dependency; this keeps a bare GPU box planning
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        raise


@dataclass(frozen=True)
class MeasuredLink:
    """A stored bandwidth: bytes/s, and the torch version it was measured under."""

    bandwidth: float
    torch_version: str


def _key(device_name: str) -> str:
    import torch

    return f"{device_name}|{torch.__version__}"


def cached_bandwidth(folder: Path, device_name: str) -> float | None:
    try:
        value = json.loads((folder / LINK_FILE).read_text(encoding="utf-8"))[_key(device_name)]
        return float(value) if float(value) > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_bandwidth(folder: Path, device_name: str, bandwidth: float) -> None:
    path = folder / LINK_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: start afresh
        data = {}
    try:
        data = data if isinstance(data, dict) else {}
        data[_key(device_name)] = bandwidth
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        tmp.replace(path)
    except (OSError, ValueError) as exc:  # only costs a re-measurement next start
        log.warning("could not save the host link bandwidth to %s (%s)", path, exc)


def link_bandwidth(device: DeviceInfo, folder: Path | None) -> float | None:
    """The host→``device`` bandwidth in bytes/s: cached in ``folder``, else measured now
    (and cached). None off CUDA/ROCm."""
    from specmemo_core.runtime.host_link import host_to_device_bandwidth

    if device.kind not in OFFLOAD_KINDS:
        return None
    cached = cached_bandwidth(folder, device.name) if folder is not None else None
    if cached is not None:
        return cached
    measured = host_to_device_bandwidth(device.torch_device, nbytes=PROBE_BYTES, repeats=PROBE_REPEATS)
    if measured is not None and folder is not None:
        store_bandwidth(folder, device.name, measured)
    return measured


def host_link_for(device: DeviceInfo, folder: Path | None, *, ram_bytes: int | None = None,
                  bandwidth: float | None = None) -> HostLink | None:
    """The planner's ``HostLink`` for ``device``: free RAM (``ram_bytes`` overrides it) and
    the measured link (``bandwidth`` overrides it). None where offload is never planned
    (CPU, MPS: the model already lives in host memory)."""
    if device.kind not in OFFLOAD_KINDS:
        return None
    speed = bandwidth if bandwidth is not None else link_bandwidth(device, folder)
    if speed is None:
        return None
    return HostLink(free_host_ram() if ram_bytes is None else ram_bytes, speed)
