"""Device probe: real CPU-only machine, fake NVML/amdsmi, the child-process guard, sizes and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specmemo_core.planning.device import DeviceError, DeviceInfo, ProbeReport, cpu_device, parse_size, probe
from specmemo_core.errors import SpecMemoError

GIB = 2**30


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


class FakeNVML:
    """The few pynvml calls the probe makes, over a list of (name, total, free) GPUs."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus=(), init_error: str | None = None, unreadable: tuple[int, ...] = ()):
        self.gpus, self.init_error, self.unreadable = list(gpus), init_error, unreadable
        self.shut_down = False

    def nvmlInit(self):
        if self.init_error:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, handle):
        return self.gpus[handle][0]

    def nvmlDeviceGetMemoryInfo(self, handle):
        if handle in self.unreadable:
            raise FakeNVMLError("Unknown Error")
        name, total, free = self.gpus[handle]
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"


class FakeAmdSmiError(Exception):
    """Stands in for amdsmi.AmdSmiLibraryException."""


class FakeAmdSmi:
    """amdsmi with one GPU, or one whose init fails; `old=True` has only the MB-based vram_usage call."""

    AmdSmiMemoryType = SimpleNamespace(VRAM=0, VIS_VRAM=1, GTT=2)

    def __init__(self, init_error: str | None = None, old: bool = False):
        self.init_error, self.old = init_error, old

    def amdsmi_init(self):
        if self.init_error:
            raise FakeAmdSmiError(self.init_error)

    def amdsmi_shut_down(self):
        pass

    def amdsmi_get_processor_handles(self):
        return ["h0"]

    def amdsmi_get_gpu_memory_total(self, handle, kind):
        if self.old:
            raise FakeAmdSmiError("not supported")
        return 64 * GIB

    def amdsmi_get_gpu_memory_usage(self, handle, kind):
        return 4 * GIB

    def amdsmi_get_gpu_vram_usage(self, handle):
        return {"vram_total": 16 * 1024, "vram_used": 1024}

    def amdsmi_get_gpu_asic_info(self, handle):
        return {"market_name": "AMD Instinct MI210"}

    def amdsmi_get_gpu_driver_info(self, handle):
        return {"driver_name": "amdgpu", "driver_version": "6.7.0"}


@pytest.fixture(autouse=True)
def _all_gpus_visible(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def check_cpu_last(report: ProbeReport) -> DeviceInfo:
    cpu = report.devices[-1]
    assert cpu.kind == "cpu" and cpu.torch_device == "cpu" and cpu.index == 0
    assert cpu.total_bytes > 0 and 0 < cpu.free_bytes <= cpu.total_bytes
    assert cpu.driver == f"torch {torch.__version__}" and cpu.name
    assert all(d.kind != "cpu" for d in report.devices[:-1])
    return cpu


# --- the real machine (no GPU) ---

@pytest.mark.parametrize("run_subprocess", [True, False])
def test_real_probe_finds_the_cpu_and_says_why_no_gpu(run_subprocess):
    report = probe(run_subprocess=run_subprocess)
    check_cpu_last(report)
    if not torch.cuda.is_available():
        assert report.best().kind == "cpu"
        assert any("NVML" in n for n in report.notes)
        assert any("no GPU found" in n for n in report.notes)


def test_cpu_device_matches_psutil():
    import psutil

    cpu = cpu_device()
    assert cpu.total_bytes == psutil.virtual_memory().total
    assert 0 < cpu.free_bytes <= cpu.total_bytes


def test_cpu_device_says_whether_it_has_bf16_matrix_units():
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    flags = next((line.split(":", 1)[1].split() for line in info.read_text().splitlines()
                  if line.startswith("flags")), []) if info.exists() else []
    assert cpu_device().bf16_matmul == ("amx_bf16" in flags or "avx512_bf16" in flags)


# --- fake NVML / amdsmi, in-process ---

def test_nvml_init_failure_falls_back_with_a_note():
    report = probe(nvml=FakeNVML(init_error="Driver Not Loaded"), amdsmi=FakeAmdSmi("no driver"),
                   run_subprocess=False)
    check_cpu_last(report)
    assert any("NVML not available: Driver Not Loaded" in n for n in report.notes)


def test_nvml_reports_two_gpus_exactly():
    nvml = FakeNVML([("NVIDIA A10", 24 * GIB, 20 * GIB), ("NVIDIA H100", 80 * GIB, 70 * GIB)])
    report = probe(nvml=nvml, amdsmi=FakeAmdSmi("no driver"), run_subprocess=False)
    gpus = report.devices[:-1]
    assert [(d.kind, d.index, d.name, d.total_bytes, d.free_bytes, d.driver, d.torch_device) for d in gpus] == [
        ("cuda", 0, "NVIDIA A10", 24 * GIB, 20 * GIB, "550.54.15", "cuda:0"),
        ("cuda", 1, "NVIDIA H100", 80 * GIB, 70 * GIB, "550.54.15", "cuda:1"),
    ]
    check_cpu_last(report)
    assert report.best() == gpus[1]
    assert nvml.shut_down


def test_best_prefers_free_memory_not_total():
    nvml = FakeNVML([("big but busy", 80 * GIB, 2 * GIB), ("small idle", 16 * GIB, 15 * GIB)])
    report = probe(nvml=nvml, amdsmi=FakeAmdSmi("x"), run_subprocess=False)
    assert report.best().name == "small idle"


def test_cpu_only_torch_build_is_noted_when_a_gpu_is_found():
    report = probe(nvml=FakeNVML([("NVIDIA A10", 24 * GIB, 20 * GIB)]), amdsmi=FakeAmdSmi("x"), run_subprocess=False)
    if torch.version.cuda is None and torch.version.hip is None:
        assert any("CPU-only build" in n and "install" in n for n in report.notes)


def test_unreadable_nvml_device_is_skipped_with_a_note():
    nvml = FakeNVML([("GPU A", 24 * GIB, 20 * GIB), ("GPU B", 24 * GIB, 10 * GIB)], unreadable=(0,))
    report = probe(nvml=nvml, amdsmi=FakeAmdSmi("x"), run_subprocess=False)
    assert [d.name for d in report.devices[:-1]] == ["GPU B"]
    assert any("GPU 0 skipped" in n and "Unknown Error" in n for n in report.notes)
    assert nvml.shut_down


def test_cuda_visible_devices_maps_nvml_indices_to_torch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    nvml = FakeNVML([("GPU A", 24 * GIB, 20 * GIB), ("GPU B", 48 * GIB, 40 * GIB)])
    gpus = probe(nvml=nvml, amdsmi=FakeAmdSmi("x"), run_subprocess=False).devices[:-1]
    assert [(d.name, d.index, d.torch_device) for d in gpus] == [("GPU B", 0, "cuda:0")]


def test_nvml_failure_uses_torch_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (3 * GIB, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Runtime GPU")
    report = probe(nvml=FakeNVML(init_error="NVML Shared Library Not Found"), amdsmi=FakeAmdSmi("x"),
                   run_subprocess=False)
    gpu = report.devices[0]
    assert (gpu.name, gpu.total_bytes, gpu.free_bytes, gpu.torch_device) == ("Runtime GPU", 8 * GIB, 3 * GIB, "cuda:0")
    assert gpu.kind == ("rocm" if torch.version.hip else "cuda")
    assert gpu.note == "NVML not available: NVML Shared Library Not Found; using torch.cuda"
    assert gpu.note in report.notes


def test_mps_uses_recommended_memory(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 12 * GIB)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2 * GIB)
    report = probe(nvml=FakeNVML(init_error="no NVML on macOS"), amdsmi=FakeAmdSmi("x"), run_subprocess=False)
    gpu = report.devices[0]
    assert (gpu.kind, gpu.torch_device, gpu.total_bytes, gpu.free_bytes) == ("mps", "mps", 12 * GIB, 10 * GIB)


def test_amdsmi_init_failure_is_a_note():
    report = probe(nvml=FakeNVML(), amdsmi=FakeAmdSmi(init_error="AMDSMI_STATUS_DRIVER_NOT_LOADED"),
                   run_subprocess=False)
    check_cpu_last(report)
    assert any("amdsmi not available: AMDSMI_STATUS_DRIVER_NOT_LOADED" in n for n in report.notes)


@pytest.mark.parametrize("old, total, free", [(False, 64 * GIB, 60 * GIB), (True, 16 * GIB, 15 * GIB)])
def test_amdsmi_gpu_memory(old, total, free):
    report = probe(nvml=FakeNVML(init_error="no NVIDIA"), amdsmi=FakeAmdSmi(old=old), run_subprocess=False)
    gpu = report.devices[0]
    assert (gpu.kind, gpu.name, gpu.driver, gpu.torch_device) == ("rocm", "AMD Instinct MI210", "6.7.0", "cuda:0")
    assert (gpu.total_bytes, gpu.free_bytes) == (total, free)


# --- the child-process guard ---

def test_hanging_child_times_out_to_cpu_only():
    start = time.monotonic()
    report = probe(timeout_s=1, _child_code="import time; time.sleep(60)")
    assert time.monotonic() - start < 3
    check_cpu_last(report)
    assert len(report.devices) == 1
    assert any("timed out after 1 s" in n and "using the CPU" in n for n in report.notes)


@pytest.mark.parametrize("code, words", [
    ("print('hello, not json')", "unreadable"),
    ("print('{\"devices\": [{\"kind\": 1}], \"notes\": []}')", "unreadable"),
    ("import sys; sys.stderr.write('Segmentation fault\\n'); sys.exit(139)", "exit code 139: Segmentation fault"),
])
def test_broken_child_gives_cpu_only_with_a_note(code, words):
    report = probe(_child_code=code)
    assert len(report.devices) == 1
    check_cpu_last(report)
    assert any(words in n for n in report.notes), report.notes


def test_child_json_is_read_back():
    gpu = {"kind": "cuda", "index": 0, "name": "Child GPU", "total_bytes": 8 * GIB, "free_bytes": GIB,
           "driver": "1.0", "torch_device": "cuda:0", "note": ""}
    line = json.dumps({"devices": [gpu], "notes": ["hello"]})
    report = probe(_child_code=f"print('warning noise'); print({line!r})")
    assert report.devices[0] == DeviceInfo(**gpu)
    assert report.notes == ("hello",)


# --- sizes ---

@pytest.mark.parametrize("text, expected", [
    ("8GB", 8 * 10**9), ("12 GiB", 12 * GIB), ("24G", 24 * GIB), ("512MiB", 512 * 2**20),
    ("1.5GB", 1_500_000_000), ("123", 123), ("  2gib ", 2 * GIB), ("1TB", 10**12), ("64k", 65536),
    ("100b", 100), (".5G", GIB // 2),
])
def test_parse_size_good(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["banana", "", "-1GB", "0", "0GB", "nan", "NaNGB", "inf", "8 GBs", "8XB",
                                  "1e999GB", "0.1", "GB", "8 G B"])
def test_parse_size_bad(text):
    with pytest.raises(SpecMemoError) as info:
        parse_size(text)
    assert isinstance(info.value, DeviceError)
    assert f"could not read size {text!r}" in str(info.value) and "8GB or 12GiB" in str(info.value)


def test_empty_report_best_is_a_clear_error():
    with pytest.raises(DeviceError, match="specmemo devices"):
        ProbeReport((), ()).best()


# --- command line ---

def test_cli_devices_json():
    done = subprocess.run([sys.executable, "-m", "specmemo_core.cli", "devices", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["devices"][-1]["kind"] == "cpu" and data["devices"][-1]["total_bytes"] > 0
    assert isinstance(data["notes"], list)


def test_cli_devices_table(capsys):
    from specmemo_core.cli import main

    assert main(["devices"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("kind") and "\ncpu " in out and "free / total GiB" in out


def test_the_probe_child_is_skipped_only_where_no_gpu_can_be(tmp_path: Path) -> None:
    from specmemo_core.planning.device import worth_probing

    assert not worth_probing("Linux", tmp_path)  # no device files: no driver to ask
    (tmp_path / "nvidiactl").touch()
    assert not worth_probing("Linux", tmp_path)  # the control node alone is not a GPU
    for node in ("nvidia0", "kfd", "dxg"):
        folder = tmp_path / node.replace("0", "")
        folder.mkdir()
        (folder / node).touch()
        assert worth_probing("Linux", folder), node
    assert worth_probing("Windows", tmp_path) and worth_probing("Darwin", tmp_path)
