"""Every expected failure of ``specmemo`` is one line and exit code 2; small traps of the options. (Bad model
files, --device banana/cuda, --tree calibrated-x, --context beyond the trained one and an unexpected failure's
traceback file are cases of tests/reliability/test_bad_inputs.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

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
    (["plan", "--prefer", "fast"], "--prefer takes turns, speed"),
    (["plan", "--vram", "8XB"], "write it like 8GB or 12GiB"),
    (["plan", "--turns"], "expected one argument"),  # argparse's own errors are one line too
    (["chat", "--no-such-option"], "unrecognized arguments"),
])
def test_expected_failures_are_one_line(tmp_path: Path, args: list[str], needle: str):
    assert needle in one_error_line(specmemo(*args, data=tmp_path))


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


def test_progress_is_one_line_per_stage_where_stderr_is_not_a_terminal() -> None:
    """A log or a pipe gets each stage once, not hundreds of bar redraws on one line."""
    import io

    from specmemo_core.cli.common import StageProgress

    out = io.StringIO()  # not a terminal
    progress = StageProgress(stream=out)
    for stage in ("checking file", "loading weights", "planning"):
        for i in range(101):
            progress(stage, i / 100)
    progress.close()
    assert out.getvalue() == "checking file\nloading weights\nplanning\n"


def test_progress_draws_a_bar_on_a_terminal() -> None:
    import io

    from specmemo_core.cli.common import StageProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = StageProgress(stream=out)
    progress("loading weights", 0.5)
    progress.close()
    assert "loading weights:  50%|" in out.getvalue()
