"""Every expected failure of ``specmemo`` is one line and exit code 2; an unexpected one is
one line naming the file that holds its traceback; small traps of the options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
NOISE = ("Failed to load", "W1201", "Warning", "warn(")  # torchao's optional kernels, torch's deprecations


def specmemo(*args: str, data: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, SPECMEMO_DATA_DIR=str(data), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "specmemo_core.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def said(done: subprocess.CompletedProcess) -> list[str]:
    """stderr's lines less progress bars and library noise."""
    lines = done.stderr.replace("\r", "\n").splitlines()
    return [ln for ln in lines if ln.strip() and "%|" not in ln and not any(n in ln for n in NOISE)]


def one_error_line(done: subprocess.CompletedProcess, code: int = 2) -> str:
    assert done.returncode == code, done.stderr[-2000:]
    errors = [ln for ln in said(done) if "error" in ln.lower()]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompt", "hi", "--device", "banana"], "no device 'banana'"),
    (["plan", "--prefer", "fast"], "--prefer takes turns, speed"),
    (["plan", "--vram", "8XB"], "write it like 8GB or 12GiB"),
    (["plan", "--turns"], "expected one argument"),  # argparse's own errors are one line too
    (["chat", "--no-such-option"], "unrecognized arguments"),
])
def test_expected_failures_are_one_line(tmp_path: Path, args: list[str], needle: str):
    assert needle in one_error_line(specmemo(*args, data=tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_cpu_build_is_one_line(tmp_path: Path):
    line = one_error_line(specmemo("generate", "--prompt", "hi", "--device", "cuda", data=tmp_path))
    assert "no device 'cuda'" in line and "specmemo devices" in line


@pytest.mark.integration
def test_a_tree_name_that_cannot_be_is_one_line(shared_data_root: Path):
    line = one_error_line(specmemo("generate", "--prompt", "hi", "--max-new-tokens", "2", "--tree", "calibrated-x",
                                   data=shared_data_root))
    assert "calibrated-x" in line and "calibrated-16" in line


@pytest.mark.integration
def test_a_context_beyond_the_trained_one_is_capped_and_said(shared_data_root: Path):
    done = specmemo("generate", "--prompt", "Hi", "--max-new-tokens", "2", "--context", "100000000", "--json",
                    data=shared_data_root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any("--context 100000000 is beyond the 8192 tokens" in ln and "using 8192" in ln for ln in said(done))
    reply = json.loads(done.stdout)
    assert reply["tokens"] >= 1 and reply["precision"] == "fp32" and reply["threads"] >= 1


@pytest.mark.integration
def test_a_context_beyond_the_device_memory_is_refused_before_allocating(shared_data_dir: Path):
    from specmemo_core.cli.loading import ContextTooLargeError, checked_context, kv_room_tokens
    from specmemo_core.planning.device import cpu_device
    from specmemo_core.planning.entry import PlanChoices, load_planned

    small = replace(cpu_device(), total_bytes=int(1.4 * 2**30), free_bytes=int(1.4 * 2**30))
    planned = load_planned("default", choices=PlanChoices(precision="fp32", turns=2), device=small,
                           data_folder=shared_data_dir)
    room = kv_room_tokens(planned)
    assert planned.plan.kv_tokens <= room < 8192  # the plan's own cache fits; the trained context does not
    assert checked_context(room, planned) == room
    with pytest.raises(ContextTooLargeError, match=f"ask for at most {room} tokens"):
        checked_context(8192, planned)


def test_an_unexpected_failure_is_one_line_and_a_traceback_file(tmp_path: Path):
    # a file where the output folder should be: an OSError no command expects
    done = specmemo("train-heads", "--out", "/dev/null/heads", "--steps", "1", "--prompts", "1", data=tmp_path)
    line = one_error_line(done, code=1)
    assert line.startswith("error: unexpected NotADirectoryError") and "please report it" in line
    logs = list((tmp_path / "logs").glob("specmemo-*.log"))
    assert len(logs) == 1 and str(logs[0]) in line
    text = logs[0].read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in text and "NotADirectoryError" in text


def _unwritable_folder(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses new folders to everyone
        return Path("/sys/specmemo-data")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder / "specmemo"


@pytest.mark.skipif(sys.platform != "linux", reason="the read-only folder is made the Linux way")
def test_a_data_folder_that_cannot_be_written_is_named_with_the_way_out(tmp_path: Path):
    folder = _unwritable_folder(tmp_path)
    line = one_error_line(specmemo("generate", "--prompt", "hi", data=folder))
    assert f"the data folder {folder} cannot be written" in line
    assert "SPECMEMO_DATA_DIR=/some/writable/folder" in line and "internet" not in line


def test_a_bare_vram_number_is_gigabytes(tmp_path: Path):
    bare = specmemo("plan", "--model", "shape:vicuna-7b", "--vram", "8", "--json", data=tmp_path)
    unit = specmemo("plan", "--model", "shape:vicuna-7b", "--vram", "8GB", "--json", data=tmp_path)
    assert bare.returncode == unit.returncode == 0, bare.stderr[-2000:]
    assert json.loads(bare.stdout) == json.loads(unit.stdout)
    assert json.loads(bare.stdout)["budget_bytes"] > 6 * 10**9  # not 8 bytes
    assert "a bare number is GB" in " ".join(specmemo("plan", "--help", data=tmp_path).stdout.split())
