"""The host side of a plan read at start-up (planning/host.py): free RAM, and the link's
bandwidth measured once per GPU and cached in the data folder."""

from __future__ import annotations

import pytest

from specmemo_core.planning import host
from specmemo_core.planning.device import DeviceInfo, cpu_device

GPU = DeviceInfo("cuda", 0, "Test GPU 8GB", 8 * 2**30, 8 * 2**30, "", "cuda:0")


def test_free_ram_is_what_the_os_can_hand_out_now():
    import psutil

    assert abs(host.free_host_ram() - psutil.virtual_memory().available) < 256 * 2**20


def test_no_link_off_gpus():
    assert host.host_link_for(cpu_device(), None) is None
    assert host.link_bandwidth(cpu_device(), None) is None


def test_the_bandwidth_is_measured_once_and_read_back_after(tmp_path, monkeypatch):
    calls = []

    def measure(device, *, nbytes, repeats):
        calls.append((device, nbytes, repeats))
        return 42e9

    monkeypatch.setattr("specmemo_core.runtime.host_link.host_to_device_bandwidth", measure)
    monkeypatch.setattr(host, "free_host_ram", lambda: 32 * 2**30)
    first = host.host_link_for(GPU, tmp_path)
    second = host.host_link_for(GPU, tmp_path)
    assert first == second and first.bandwidth == 42e9 and first.free_ram_bytes == 32 * 2**30
    assert calls == [("cuda:0", host.PROBE_BYTES, host.PROBE_REPEATS)]  # short, and only once
    other = DeviceInfo("cuda", 1, "Another GPU", 2**30, 2**30, "", "cuda:1")
    host.host_link_for(other, tmp_path)
    assert len(calls) == 2  # cached per GPU


def test_given_numbers_override_the_readings(tmp_path, monkeypatch):
    monkeypatch.setattr("specmemo_core.runtime.host_link.host_to_device_bandwidth",
                        lambda *a, **k: pytest.fail("a given bandwidth is not measured"))
    link = host.host_link_for(GPU, tmp_path, ram_bytes=2**30, bandwidth=10e9)
    assert (link.free_ram_bytes, link.bandwidth) == (2**30, 10e9)


def test_a_broken_cache_is_measured_again(tmp_path, monkeypatch):
    (tmp_path / host.LINK_FILE).write_text("{not json", encoding="utf-8")
    monkeypatch.setattr("specmemo_core.runtime.host_link.host_to_device_bandwidth", lambda *a, **k: 5e9)
    assert host.link_bandwidth(GPU, tmp_path) == 5e9
    assert host.cached_bandwidth(tmp_path, GPU.name) == 5e9
