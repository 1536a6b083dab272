"""The "beyond chat" bench workloads (issue 22): assets/prompts/bench_mixed.jsonl and bench_code.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from specmemo_core.storage.datasets import load_prompt_file

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "assets" / "prompts"
FILES = {"bench_mixed.jsonl": 30, "bench_code.jsonl": 20}
MIXED_KINDS = ("translation", "summarization", "qa", "math", "rag")


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPTS / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def _turns_of(gz_name: str) -> set[str]:
    return {turn for turns in load_prompt_file(PROMPTS / gz_name) for turn in turns}


@pytest.mark.parametrize(("name", "count"), FILES.items())
def test_files_load_with_expected_counts(name: str, count: int) -> None:
    conversations = load_prompt_file(PROMPTS / name)
    assert len(conversations) == count
    assert all(len(turns) == 1 and len(turns[0]) < 6000 for turns in conversations)


def test_mixed_file_has_six_of_each_kind_in_order() -> None:
    kinds = [row["kind"] for row in _rows("bench_mixed.jsonl")]
    assert Counter(kinds) == {kind: 6 for kind in MIXED_KINDS}
    assert kinds == [kind for kind in MIXED_KINDS for _ in range(6)]
    assert {row["kind"] for row in _rows("bench_code.jsonl")} == {"code"}


def test_no_prompt_comes_from_training_or_calibration_data() -> None:
    seen = _turns_of("heads_training.jsonl.gz") | _turns_of("heads_heldout.jsonl.gz")
    assert len(seen) > 1000  # the files were read, not empty
    prompts = [turns[0] for name in FILES for turns in load_prompt_file(PROMPTS / name)]
    assert not [p[:80] for p in prompts if p in seen or p.strip() in seen]
    assert len(set(prompts)) == len(prompts)


def test_script_reproduces_the_files_byte_for_byte(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_workload_prompts.py"), "--out-dir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (PROMPTS / name).read_bytes(), name
