"""Write the "beyond chat" prompt workloads for the speculative-decoding speed benchmarks (issue 22).

Two JSONL files, one ``{"turns": [prompt], "kind": ..., "source": ...}`` object a line (the
prompt loader reads ``turns`` and ignores the other keys):

* ``bench_mixed.jsonl``: 30 prompts, 6 of each of five kinds in this order: translation
  (one or two paragraphs into French, German, Spanish, Italian, Portuguese, Chinese),
  summarization of a long input (1,500-4,000 characters), question answering over a
  passage (hand-written questions whose answers are in the passage), math word problems
  (hand-written, multi-step) and RAG (3-4 numbered documents, a question answerable from one).
* ``bench_code.jsonl``: 20 code prompts: complete a function from its signature, docstring
  and first lines; explain, refactor, add tests, fix an injected bug, add type hints; and a
  few hand-written "Write a Python function that ..." tasks.

Why: the benches so far run chat prompts (MT-Bench, ShareGPT); speculation gains differ on
translation, summaries, retrieval and code, where replies copy or closely follow the prompt.
None of these prompts comes from the heads' training data (ShareGPT train split) or the
calibration mix (MT-Bench, held-out ShareGPT): MT-Bench and ShareGPT are not used at all.
Passages and code are the Python standard library's own docstrings (``inspect.getdoc``) and
source (``inspect.getsource``), read at run time, so the files regenerate offline and byte
for byte under the same Python (3.11; other versions have other docstrings and fail the
length checks or give other bytes).

    .venv/bin/python scripts/make_workload_prompts.py [--out-dir assets/prompts]
"""

from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import importlib
import inspect
import io
import json
import sys
import textwrap
from collections import Counter
from pathlib import Path

MAX_PROMPT_CHARS = 6000
MAX_CODE_CHARS = 2500
TRANSLATION_CHARS = (300, 900)
SUMMARY_CHARS = (1500, 4000)
MIXED_KINDS = ("translation", "summarization", "qa", "math", "rag")

TRANSLATIONS = (  # (docstring spec, target language)
    ("getopt", "French"),
    ("tokenize", "German"),
    ("collections", "Spanish"),
    ("colorsys", "Italian"),
    ("functools:lru_cache", "Portuguese"),
    ("this", "Chinese"),
)
TRANSLATION_ASK = ("Translate the following text into {lang}. Keep code, function names and "
                   "option names unchanged.\n\n\"\"\"\n{text}\n\"\"\"")

SUMMARIES = ("argparse", "json", "statistics", "csv", "copy", "logging:basicConfig")
SUMMARY_ASKS = (
    "Summarize the following documentation in one paragraph of at most five sentences.",
    "Summarize the following text as 4 to 6 short bullet points.",
    "Write a two-sentence summary of the following text for a beginner programmer.",
)

QUESTIONS = (  # (docstring spec, hand-written question answered in the passage)
    ("heapq", "How does this heap API differ from textbook heap algorithms, and where is "
              "the smallest item of a heap found?"),
    ("doctest", "When a module's examples are run as a script without -v, what is displayed "
                "if every example passes, and what is the final line of output if one fails?"),
    ("sqlite3", "Which special path name connects to a transient in-memory database, and "
                "what is the oldest SQLite version the module works with?"),
    ("zipfile:ZipFile", "Which integer compression levels are accepted with ZIP_DEFLATED and "
                        "with ZIP_BZIP2, and with which compression methods does compresslevel "
                        "have no effect?"),
    ("fractions:Fraction.__new__", "What does Fraction('3.1415') evaluate to, and which kinds "
                                   "of input can the constructor take?"),
    ("textwrap:TextWrapper", "What is the default width of wrapped lines, and what does "
                             "fix_sentence_endings do and why is it off by default?"),
)
QA_ASK = "Read the passage below and answer the question.\n\nPassage:\n\"\"\"\n{text}\n\"\"\"\n\nQuestion: {q}"

RAG_SETS = (  # (documents' docstring specs, question answerable from one of them)
    (("heapq:merge", "bisect:bisect_left", "statistics:median", "difflib:get_close_matches"),
     "What similarity cutoff is used by default when looking for close matches, and in what "
     "order are the matches returned?"),
    (("secrets:token_hex", "base64:urlsafe_b64encode", "html:escape"),
     "Which characters does the URL- and filesystem-safe alphabet use instead of '+' and '/'?"),
    (("glob:glob", "gzip:open", "tempfile:TemporaryDirectory", "zipfile:is_zipfile"),
     "When matching a pathname pattern, are files whose names start with a dot matched by '*' "
     "by default, and which option changes that?"),
    (("random:Random.choices", "collections:Counter.most_common", "statistics:quantiles"),
     "To split data into deciles, what value of n should be used, and how many cut points "
     "are returned for n intervals?"),
    (("ipaddress:ip_network", "sqlite3:connect", "urllib.parse:urlsplit", "shutil:which"),
     "Into how many components is a URL split, and are % escapes expanded?"),
    (("functools:wraps", "textwrap:shorten", "unittest:TestCase.assertAlmostEqual", "pickle:dumps"),
     "What is the default pickle protocol, and in which Python version was it introduced?"),
)
RAG_ASK = "Answer using only the documents above; cite the document number."

MATH_PROBLEMS = (
    "A bakery bakes 12 trays of muffins with 24 muffins on each tray. It sells three quarters "
    "of the muffins in the morning and half of the remaining muffins in the afternoon. How many "
    "muffins are left at closing time?",
    "Maya earns $15 an hour and works 6 hours a day, 5 days a week. She saves 20% of what she "
    "earns each week and spends $90 of the rest on groceries. How much of one week's pay is "
    "left after her savings and groceries?",
    "A train leaves at 9:40 a.m. and travels 210 km at an average speed of 70 km/h. It then "
    "waits 25 minutes at a station and travels another 120 km at 80 km/h. At what time does "
    "it arrive?",
    "A school buys 14 boxes of pencils with 36 pencils in each box. The pencils are shared "
    "equally among 8 classes, and each class gives 2 pencils to each of its 25 students. How "
    "many pencils does each class have left over, and how many are left over in all?",
    "A rectangular garden is 18 m long and 12 m wide. A path 1 m wide runs all the way around "
    "the outside of the garden. What is the area of the path, and how much does it cost to "
    "pave it at $25 per square metre?",
    "Tom has three times as many marbles as Lena. After Tom gives Lena 12 marbles, they both "
    "have the same number of marbles. How many marbles did each of them have at first?",
)
MATH_ASK = "Solve step by step."

CODE_TASKS = (  # (mode, stdlib "module:function" or None, detail)
    ("complete", "textwrap:dedent", 4),
    ("explain", "genericpath:_splitext", None),
    ("write", None, "Write a Python function `chunked(iterable, size)` that yields lists of at "
                    "most `size` items from any iterable, without reading it all into memory. "
                    "Raise ValueError if size is less than 1. Include a docstring with two "
                    "doctest examples."),
    ("complete", "shlex:quote", 2),
    ("tests", "string:capwords", None),
    ("fix", "bisect:bisect_left", ("            if a[mid] < x:", "            if a[mid] <= x:",
                                   "When x is already in the list it should return the index of "
                                   "the leftmost x, but it returns the index after the last x.")),
    ("complete", "bisect:insort_right", 2),
    ("refactor", "posixpath:commonpath", None),
    ("hints", "textwrap:indent", None),
    ("complete", "heapq:nsmallest", 6),
    ("explain", "os:makedirs", None),
    ("write", None, "Write a Python function `parse_duration(text)` that turns strings such as "
                    "'45s', '1h30m' or '2h5m10s' into a whole number of seconds. Reject empty or "
                    "malformed input with ValueError, and add a few assert-based examples."),
    ("complete", "colorsys:rgb_to_hsv", 5),
    ("tests", "statistics:multimode", None),
    ("fix", "html:escape", ('    s = s.replace("&", "&amp;") # Must be done first!\n'
                            '    s = s.replace("<", "&lt;")\n    s = s.replace(">", "&gt;")',
                            '    s = s.replace("<", "&lt;")\n    s = s.replace(">", "&gt;")\n'
                            '    s = s.replace("&", "&amp;")',
                            "escape('<b>') returns '&amp;lt;b&amp;gt;' instead of '&lt;b&gt;'.")),
    ("refactor", "statistics:fmean", None),
    ("complete", "difflib:get_close_matches", 4),
    ("hints", "calendar:monthrange", None),
    ("explain", "random:Random.shuffle", None),
    ("write", None, "Write a Python function `pascal_row(n)` that returns row n (counting from 0) "
                    "of Pascal's triangle as a list of ints using only integer arithmetic, then "
                    "state its time and memory complexity."),
)
CODE_ASKS = {
    "complete": "Complete this Python function. Keep the lines shown, continue from the last "
                "one, and return the whole function.",
    "explain": "Explain what this Python function does, step by step, and point out the edge "
               "cases it handles.",
    "refactor": "Refactor this Python function for readability without changing its behaviour. "
                "Return the new code and list the changes.",
    "tests": "Write pytest unit tests for this Python function, covering normal cases and edge cases.",
    "hints": "Add type hints and a docstring to this Python function. Do not change its behaviour.",
}


def _resolve(spec: str) -> object:
    """The module or object named by ``module[:Qual.name]``."""
    module_name, _, qualname = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def doc_text(spec: str) -> str:
    """The docstring of ``spec``; for ``this``, the Zen of Python (rot13-decoded ``this.s``)."""
    if spec == "this":
        with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the Zen
            import this
        return codecs.decode(this.s, "rot13").strip()
    text = inspect.getdoc(_resolve(spec))
    if not text:
        raise SystemExit(f"{spec}: no docstring in this Python ({sys.version.split()[0]})")
    return text


def _check_length(text: str, bounds: tuple[int, int], *, what: str) -> str:
    if not bounds[0] <= len(text) <= bounds[1]:
        raise SystemExit(f"{what}: {len(text)} characters, outside {bounds} (not Python 3.11?)")
    return text


def _function_node(spec: str) -> tuple[list[str], ast.FunctionDef]:
    """The module's source lines and the ``def`` node of ``module:Qual.name``, found with ast
    (so that functions replaced by C versions, e.g. bisect's, still have their source)."""
    module_name, _, qualname = spec.partition(":")
    text = inspect.getsource(importlib.import_module(module_name))
    node: ast.AST = ast.parse(text)
    for part in qualname.split("."):
        node = next(n for n in ast.walk(node)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
    return text.splitlines(), node


def _docstring_end(node: ast.FunctionDef) -> int | None:
    """Last line of the function's docstring, or None if it has none."""
    first = node.body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    return first.end_lineno if is_doc else None


def function_source(spec: str, *, body_lines: int | None = None, docstring: bool = True) -> str:
    """Source of a stdlib function, dedented: whole, or cut ``body_lines`` lines after the
    docstring (signature + docstring + first lines), or with the docstring taken out."""
    lines, node = _function_node(spec)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    end, doc_end = node.end_lineno, _docstring_end(node)
    picked = list(range(start, end + 1))
    if body_lines is not None:
        picked = [n for n in picked if n <= (doc_end or node.lineno) + body_lines]
    if not docstring and doc_end is not None:
        picked = [n for n in picked if not node.body[0].lineno <= n <= doc_end]
    return textwrap.dedent("\n".join(lines[n - 1] for n in picked)).rstrip() + "\n"


def _row(prompt: str, kind: str, *, source: str) -> dict:
    if len(prompt) >= MAX_PROMPT_CHARS:
        raise SystemExit(f"{kind} prompt from {source}: {len(prompt)} characters, over {MAX_PROMPT_CHARS}")
    return {"turns": [prompt], "kind": kind, "source": source}


def _doc_source(spec: str) -> str:
    if spec == "this":
        return "python stdlib: this (the Zen of Python, rot13-decoded this.s)"
    return f"python stdlib docstring: {spec.replace(':', '.')}"


def translation_prompts() -> list[dict]:
    rows = []
    for spec, lang in TRANSLATIONS:
        text = _check_length(doc_text(spec), TRANSLATION_CHARS, what=spec)
        rows.append(_row(TRANSLATION_ASK.format(lang=lang, text=text), "translation", source=_doc_source(spec)))
    return rows


def summary_prompts() -> list[dict]:
    rows = []
    for i, spec in enumerate(SUMMARIES):
        text = _check_length(doc_text(spec), SUMMARY_CHARS, what=spec)
        prompt = f'{SUMMARY_ASKS[i % len(SUMMARY_ASKS)]}\n\n"""\n{text}\n"""'
        rows.append(_row(prompt, "summarization", source=_doc_source(spec)))
    return rows


def qa_prompts() -> list[dict]:
    return [_row(QA_ASK.format(text=doc_text(spec), q=question), "qa", source=_doc_source(spec))
            for spec, question in QUESTIONS]


def rag_prompts() -> list[dict]:
    rows = []
    for specs, question in RAG_SETS:
        if len({s.partition(":")[0] for s in specs}) != len(specs):
            raise SystemExit(f"RAG set {specs}: documents must come from different modules")
        docs = "\n\n".join(f"Document {i}:\n{doc_text(s)}" for i, s in enumerate(specs, start=1))
        prompt = f"{docs}\n\nQuestion: {question}\n\n{RAG_ASK}"
        rows.append(_row(prompt, "rag", source="; ".join(_doc_source(s) for s in specs)))
    return rows


def math_prompts() -> list[dict]:
    return [_row(f"{problem}\n\n{MATH_ASK}", "math", source="hand-written") for problem in MATH_PROBLEMS]


def _fenced(code: str) -> str:
    return f"```python\n{code}```"


def _code_prompt(mode: str, spec: str | None, *, detail: object) -> str:
    """The prompt of one CODE_TASKS entry."""
    if mode == "write":
        return str(detail)
    if mode == "complete":
        return f"{CODE_ASKS[mode]}\n\n{_fenced(function_source(spec, body_lines=detail))}"
    if mode == "fix":
        old, new, symptom = detail
        code = function_source(spec)
        if old not in code:
            raise SystemExit(f"{spec}: the line to break is not in this Python's source")
        return (f"Fix the bug in this Python function. {symptom} Explain the bug, then give the "
                f"corrected function.\n\n{_fenced(code.replace(old, new, 1))}")
    code = function_source(spec, docstring=mode != "hints")
    return f"{CODE_ASKS[mode]}\n\n{_fenced(code)}"


def code_prompts() -> list[dict]:
    rows = []
    for mode, spec, detail in CODE_TASKS:
        prompt = _code_prompt(mode, spec, detail=detail)
        if len(prompt) > MAX_CODE_CHARS:
            raise SystemExit(f"code prompt {mode} {spec}: {len(prompt)} characters, over {MAX_CODE_CHARS}")
        source = "hand-written" if spec is None else f"python stdlib source: {spec.replace(':', '.')}"
        rows.append(_row(prompt, "code", source=source))
    return rows


def mixed_prompts() -> list[dict]:
    return translation_prompts() + summary_prompts() + qa_prompts() + math_prompts() + rag_prompts()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_bytes(text.encode("utf-8"))


def _report(path: Path, rows: list[dict]) -> str:
    counts = Counter(row["kind"] for row in rows)
    lengths = [len(row["turns"][0]) for row in rows]
    kinds = ", ".join(f"{kind} {n}" for kind, n in counts.items())
    return f"{path}: {len(rows)} prompts ({kinds}); {min(lengths)}-{max(lengths)} characters"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", default="assets/prompts", help="folder for the two files (default assets/prompts)")
    args = p.parse_args(argv)
    if sys.version_info[:2] != (3, 11):
        print(f"warning: Python {sys.version.split()[0]}; the committed files come from 3.11", file=sys.stderr)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("bench_mixed.jsonl", mixed_prompts()), ("bench_code.jsonl", code_prompts())):
        write_jsonl(out / name, rows)
        print(_report(out / name, rows))


if __name__ == "__main__":
    main()
