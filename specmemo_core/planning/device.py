"""Which devices can run the model, and how much memory each has free for us.

GPU libraries (NVML, amdsmi, the CUDA runtime) can hang or crash on a broken
driver, so by default the GPU part of the probe runs in a short-lived child
process; whatever goes wrong there becomes a note and the CPU is still offered.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from specmemo_core.errors import SpecMemoError

CHILD_CODE = "from specmemo_core.planning.device import _child_main; _child_main()"
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class DeviceError(SpecMemoError):
    """A device or memory size the user gave cannot be used."""


@dataclass(frozen=True)
class DeviceInfo:
    """One place the model can run, with the memory we may use there."""

    kind: str  # "cuda" | "rocm" | "mps" | "cpu"
    index: int  # device index (0 for cpu/mps)
    name: str
    total_bytes: int
    free_bytes: int  # NVML's free (other programs' use excluded); psutil "available" for the CPU
    driver: str  # driver / runtime version, "" if unknown
    torch_device: str  # "cuda:0", "mps", "cpu"
    note: str = ""  # why a fallback happened
    bf16_matmul: bool = False  # a CPU with bf16 matrix instructions (AMX-BF16 or AVX512-BF16): see BF16_MATMUL_FLAGS


@dataclass(frozen=True)
class ProbeReport:
    """Everything the probe found, plus every reason something was not found."""

    devices: tuple[DeviceInfo, ...]  # GPUs first, CPU always last
    notes: tuple[str, ...]

    def best(self) -> DeviceInfo:
        """The GPU with the most free memory, else the CPU."""
        gpus = [d for d in self.devices if d.kind != "cpu"]
        if gpus:
            return max(gpus, key=lambda d: d.free_bytes)
        if not self.devices:
            raise DeviceError("the device report is empty: run `specmemo devices` to see what was found")
        return self.devices[-1]

    def as_dict(self) -> dict[str, Any]:
        return {"devices": [asdict(d) for d in self.devices], "notes": list(self.notes)}


def parse_size(text: str) -> int:
    """Read a memory size the way people write it: 8GB (10^9), 12GiB or 12G (2^30), or plain bytes."""
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise DeviceError(f"could not read size {text!r}: write it like 8GB or 12GiB")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or round(value) < 1:
        raise DeviceError(f"could not read size {text!r}: it must be more than zero; write it like 8GB or 12GiB")
    return int(round(value))


# CPU flags of bf16 matrix instructions, where the planner's trees pay more in bf16 than in fp32:
# AMX-BF16 (Intel Xeon since Sapphire Rapids; docs/results/bf16_cpu/) and AVX512-BF16 (AMD Zen 4;
# docs/results/bf16_cpu_epyc/: the planner's method 1.27x faster in bf16, runs alternating).
BF16_MATMUL_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_device() -> DeviceInfo:
    """The CPU with the RAM that is available now (not merely unused)."""
    import psutil
    import torch

    mem = psutil.virtual_memory()
    return DeviceInfo("cpu", 0, _cpu_name(), int(mem.total), int(min(mem.available, mem.total)),
                      f"torch {torch.__version__}", "cpu", bf16_matmul=bool(BF16_MATMUL_FLAGS & _cpu_flags()))


def _cpu_info_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return []


def _cpu_name() -> str:
    for line in _cpu_info_lines():
        if line.lower().startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere: then no flag is assumed)."""
    for line in _cpu_info_lines():
        if line.lower().startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def probe(timeout_s: float = 10.0, nvml: Any = None, amdsmi: Any = None, run_subprocess: bool = True,
          _child_code: str = CHILD_CODE) -> ProbeReport:
    """Find GPUs (NVIDIA, AMD, Apple) and the CPU; never raises for a missing or broken GPU."""
    if run_subprocess:
        gpus, notes = _probe_in_child(timeout_s, _child_code)
    else:
        gpus, notes = _probe_gpus(nvml, amdsmi)
    return ProbeReport(tuple(gpus) + (cpu_device(),), tuple(notes))


GPU_DEVICE_NODES = ("nvidia[0-9]*", "kfd", "dxg")  # NVIDIA, AMD (ROCm), WSL's paravirtualized GPU


def worth_probing(system: str | None = None, dev: Path = Path("/dev")) -> bool:
    """False only where no GPU can be found: Linux with none of the device files a GPU driver is reached
    through. There the probe child (5–10 s: a Python that imports torch) is skipped at start."""
    if (system or platform.system()) != "Linux":
        return True  # Windows, macOS (MPS): nothing as cheap tells
    return any(next(dev.glob(pattern), None) is not None for pattern in GPU_DEVICE_NODES)


def probe_at_start() -> ProbeReport:
    """``probe()``, or only the CPU where ``worth_probing`` says no GPU can be there."""
    return probe() if worth_probing() else ProbeReport((cpu_device(),), ())


def _probe_in_child(timeout_s: float, code: str) -> tuple[list[DeviceInfo], list[str]]:
    """Run the GPU probe in a child process so a hung or crashing driver cannot take us down."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [], [f"GPU probe timed out after {timeout_s:g} s; using the CPU "
                    "(a GPU driver may be stuck: check it with nvidia-smi or amd-smi)"]
    except OSError as exc:
        return [], [f"GPU probe could not start ({exc}); using the CPU"]
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no error message"])[-1]
        return [], [f"GPU probe failed (exit code {done.returncode}: {last[:200]}); using the CPU"]
    try:
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        data = json.loads(lines[-1])
        names = {f.name for f in fields(DeviceInfo)}
        gpus = [DeviceInfo(**{k: v for k, v in d.items() if k in names}) for d in data["devices"]]
        notes = [str(n) for n in data["notes"]]
        _check_devices(gpus)
    except (IndexError, KeyError, TypeError, ValueError, AttributeError) as exc:
        shown = done.stdout.strip()[-120:] or "nothing"
        return [], [f"GPU probe printed something unreadable ({type(exc).__name__}: {shown!r}); using the CPU"]
    return gpus, notes


def _check_devices(devices: list[DeviceInfo]) -> None:
    for d in devices:
        if not (isinstance(d.total_bytes, int) and isinstance(d.free_bytes, int) and isinstance(d.index, int)
                and all(isinstance(s, str) for s in (d.kind, d.name, d.driver, d.torch_device, d.note))):
            raise ValueError(f"malformed device entry {d!r}")


def _child_main() -> None:
    """Entry point of the probe child: print the GPUs and notes as one JSON line."""
    gpus, notes = _probe_gpus(None, None)
    print(json.dumps({"devices": [asdict(d) for d in gpus], "notes": notes}))


def _probe_gpus(nvml: Any, amdsmi: Any) -> tuple[list[DeviceInfo], list[str]]:
    """NVIDIA through NVML, AMD through amdsmi, then torch.cuda and MPS as fallbacks."""
    import torch

    notes: list[str] = []
    hip = getattr(torch.version, "hip", None)
    nvidia, nvml_failure = _nvml_devices(nvml, notes)
    amd = _amdsmi_devices(amdsmi, notes, bool(hip))
    gpus = nvidia + amd
    if nvml_failure and not gpus:
        gpus = _torch_cuda_devices(nvml_failure, notes, hip)
    if not gpus:
        gpus = _mps_devices(notes)
    if gpus and not (torch.version.cuda or hip or gpus[0].kind == "mps"):
        notes.append(f"torch {torch.__version__} is a CPU-only build: to use the GPU, install a CUDA or ROCm "
                     "build of torch (see the README)")
    if not gpus:
        notes.append("no GPU found; using the CPU")
    return gpus, notes


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_devices(nvml: Any, notes: list[str]) -> tuple[list[DeviceInfo], str]:
    """NVIDIA GPUs with NVML's free memory; returns (devices, why NVML was unusable or "")."""
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver, no library, or a broken one
        return [], f"NVML not available: {_text(exc) or type(exc).__name__}"
    devices: list[DeviceInfo] = []
    try:
        visible = _visible_cuda_indices(nvml.nvmlDeviceGetCount())
        if visible is None:
            return [], "CUDA_VISIBLE_DEVICES names GPUs by UUID, which NVML indices cannot match"
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:  # noqa: BLE001
            driver = ""
        for torch_index, i in enumerate(visible):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                name = _text(nvml.nvmlDeviceGetName(handle))
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                devices.append(DeviceInfo("cuda", torch_index, name, int(mem.total), int(mem.free), driver,
                                          f"cuda:{torch_index}"))
            except Exception as exc:  # noqa: BLE001
                notes.append(f"NVIDIA GPU {i} skipped: NVML could not read it ({_text(exc)})")
        if not visible:
            count = nvml.nvmlDeviceGetCount()
            notes.append(f"CUDA_VISIBLE_DEVICES hides all {count} NVIDIA GPUs" if count else "NVML found no NVIDIA GPU")
    except Exception as exc:  # noqa: BLE001
        return [], f"NVML failed: {_text(exc) or type(exc).__name__}"
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    return devices, ""


def _visible_cuda_indices(count: int) -> list[int] | None:
    """NVML indices torch will see, in torch's order; None when CUDA_VISIBLE_DEVICES uses UUIDs."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(count))
    picked: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        if part.startswith(("GPU-", "MIG-")):
            return None
        if not part.lstrip("-").isdigit() or int(part) < 0 or int(part) >= count:
            break  # CUDA stops at the first invalid entry
        picked.append(int(part))
    return picked


def _amdsmi_devices(amdsmi: Any, notes: list[str], rocm_torch: bool) -> list[DeviceInfo]:
    """AMD GPUs through amdsmi where it is installed; every failure becomes a note."""
    try:
        if amdsmi is None:
            import amdsmi
    except Exception:  # noqa: BLE001 - not installed: normal on non-AMD machines
        return []
    try:
        amdsmi.amdsmi_init()
    except Exception as exc:  # noqa: BLE001
        notes.append(f"amdsmi not available: {_text(exc) or type(exc).__name__}")
        return []
    devices: list[DeviceInfo] = []
    try:
        for i, handle in enumerate(amdsmi.amdsmi_get_processor_handles()):
            try:
                total, used = _amd_memory(amdsmi, handle)
            except Exception as exc:  # noqa: BLE001
                notes.append(f"AMD GPU {i} skipped: amdsmi could not read its memory ({_text(exc)})")
                continue
            name, driver = f"AMD GPU {i}", ""
            try:
                name = str(amdsmi.amdsmi_get_gpu_asic_info(handle)["market_name"]) or name
            except Exception:  # noqa: BLE001
                pass
            try:
                driver = str(amdsmi.amdsmi_get_gpu_driver_info(handle)["driver_version"])
            except Exception:  # noqa: BLE001
                pass
            note = "" if rocm_torch else "this torch build has no ROCm support"
            devices.append(DeviceInfo("rocm", i, name, total, max(total - used, 0), driver, f"cuda:{i}", note))
    except Exception as exc:  # noqa: BLE001
        notes.append(f"amdsmi failed: {_text(exc) or type(exc).__name__}")
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:  # noqa: BLE001
            pass
    return devices


def _amd_memory(amdsmi: Any, handle: Any) -> tuple[int, int]:
    """(total, used) VRAM in bytes; the older vram_usage call reports MB."""
    try:
        vram = amdsmi.AmdSmiMemoryType.VRAM
        total = amdsmi.amdsmi_get_gpu_memory_total(handle, vram)
        return int(total), int(amdsmi.amdsmi_get_gpu_memory_usage(handle, vram))
    except Exception:  # noqa: BLE001
        usage = amdsmi.amdsmi_get_gpu_vram_usage(handle)
        return int(usage["vram_total"]) * 2**20, int(usage["vram_used"]) * 2**20


def _torch_cuda_devices(why: str, notes: list[str], hip: str | None) -> list[DeviceInfo]:
    """GPUs as the CUDA/ROCm runtime sees them, used when NVML is unusable."""
    import torch

    try:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    except Exception as exc:  # noqa: BLE001
        available, count = False, 0
        why = f"{why}; torch.cuda failed too ({exc})"
    if not available:
        notes.append(f"{why}; torch.cuda sees no GPU either")
        return []
    note = f"{why}; using torch.cuda"
    notes.append(note)
    kind, driver = ("rocm", f"HIP {hip}") if hip else ("cuda", f"CUDA {torch.version.cuda}")
    devices: list[DeviceInfo] = []
    for i in range(count):
        try:
            free, total = torch.cuda.mem_get_info(i)
            name = torch.cuda.get_device_name(i)
            devices.append(DeviceInfo(kind, i, name, int(total), int(free), driver, f"cuda:{i}", note))
        except Exception as exc:  # noqa: BLE001
            notes.append(f"GPU {i} skipped: torch.cuda could not read it ({exc})")
    return devices


def _mps_devices(notes: list[str]) -> list[DeviceInfo]:
    """Apple GPU: unified memory, so 'total' is what Metal recommends we use."""
    import torch

    try:
        if not torch.backends.mps.is_available():
            return []
    except Exception:  # noqa: BLE001
        return []
    import psutil

    note = ""
    try:
        total = int(torch.mps.recommended_max_memory())
    except Exception:  # noqa: BLE001 - older torch
        total, note = int(psutil.virtual_memory().total), "MPS memory limit unknown; using total RAM"
    try:
        used = int(torch.mps.driver_allocated_memory())
    except Exception:  # noqa: BLE001
        used = 0
    name = f"Apple GPU ({platform.machine()})"
    if note:
        notes.append(note)
    return [DeviceInfo("mps", 0, name, total, max(total - used, 0), f"macOS {platform.mac_ver()[0]}", "mps", note)]
