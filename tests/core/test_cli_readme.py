"""The README's `specmemo plan` examples for shape: models print what the command prints today."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```text\n\$ (specmemo plan --model shape:[^\n]*)\n(.*?)```", re.S)


def readme_plan_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((REPO / "README.md").read_text(encoding="utf-8"))


def test_readme_plan_examples_match_the_command(tmp_path: Path):
    blocks = readme_plan_blocks()
    assert blocks, "the README's Planning memory section shows `specmemo plan` output"
    env = dict(os.environ, SPECMEMO_DATA_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    for command, printed in blocks:
        done = subprocess.run([sys.executable, "-m", "specmemo_core.cli", *command.split()[1:]],
                              capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout == printed, f"README block of `{command}` differs from its output"
