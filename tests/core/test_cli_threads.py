"""choose_threads: the torch thread count from made-up CPU readings; the cgroup readers on real files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specmemo_core.planning.threads import (CpuReadings, apply_threads, choose_threads, quota_from_cgroup_v1,
                                            quota_from_cgroup_v2, read_cpu, read_quota)


def cpu(allowed=8, machine=8, physical=8, quota=None, load=0.0) -> CpuReadings:
    return CpuReadings(allowed=allowed, machine=machine, physical=physical, quota=quota, load=load)


def test_an_idle_machine_gets_a_thread_per_core():
    assert choose_threads(cpu()) == 8


def test_busy_cores_are_left_alone_but_one_thread_always_runs():
    assert choose_threads(cpu(load=3.0)) == 5
    assert choose_threads(cpu(allowed=2, machine=2, physical=2, load=2.0)) == 1  # the self-test's machine
    assert choose_threads(cpu(allowed=2, machine=2, physical=2, load=40.0)) == 1


def test_affinity_limits_the_cores_and_takes_its_share_of_the_load():
    # 4 of 32 cores allowed; a load of 16 spread over the machine puts 2 on ours
    assert choose_threads(cpu(allowed=4, machine=32, physical=32, load=16.0)) == 2


def test_the_container_quota_caps_the_threads():
    assert choose_threads(cpu(quota=2.0)) == 2
    assert choose_threads(cpu(quota=0.5)) == 1
    assert choose_threads(cpu(quota=2.5, load=0.0)) == 2


def test_hyperthreads_count_once():
    assert choose_threads(cpu(allowed=16, machine=16, physical=8)) == 8


def test_cgroup_texts():
    assert quota_from_cgroup_v2("max 100000\n") is None
    assert quota_from_cgroup_v2("200000 100000\n") == 2.0
    assert quota_from_cgroup_v2("garbage") is None
    assert quota_from_cgroup_v1("-1\n", "100000\n") is None
    assert quota_from_cgroup_v1("150000\n", "100000\n") == 1.5


def test_read_quota_from_cgroup_folders(tmp_path: Path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("300000 100000\n")
    assert read_quota(v2) == 3.0
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert read_quota(tmp_path / "v1") == 0.5
    assert read_quota(tmp_path / "none") is None


def test_the_running_system_is_read_from_the_os():
    readings = read_cpu()
    assert readings.allowed == len(os.sched_getaffinity(0)) and readings.machine == os.cpu_count()
    assert readings.quota == read_quota()


def test_a_process_pinned_to_one_cpu_reads_one_allowed_cpu_and_chooses_one_thread():
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from specmemo_core.planning.threads import choose_threads, read_cpu; "
            "r = read_cpu(); print(r.allowed, choose_threads(r))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_apply_threads_sets_torch(restore_threads):
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    chosen = apply_threads(0)
    assert chosen == torch.get_num_threads() >= 1
