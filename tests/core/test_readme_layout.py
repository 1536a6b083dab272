"""README's "How the code is laid out" names every folder: each package folder (one with an
``__init__.py``) and each top-level folder git tracks, and no other."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## How the code is laid out"


def readme_folders(text: str) -> list[str]:
    """The folders the section lists, one ``- `folder/` — what it holds`` line each."""
    body = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^- `([^`]+/)`", body, re.MULTILINE)]


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def existing_folders(files: list[str]) -> set[str]:
    """Top-level folders of ``files``, and every folder below them that holds an ``__init__.py``
    (on disk: a new package counts before it is committed)."""
    top = {f.split("/", 1)[0] + "/" for f in files if "/" in f}
    packages = {p.parent.relative_to(ROOT).as_posix() + "/"
                for folder in top for p in (ROOT / folder).rglob("__init__.py")}
    return top | packages


def test_readme_lists_each_folder_once():
    listed = readme_folders((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(listed) == len(set(listed)), "a folder is listed twice"


def test_readme_lists_exactly_the_folders_that_exist():
    listed = set(readme_folders((ROOT / "README.md").read_text(encoding="utf-8")))
    existing = existing_folders(tracked_files())
    assert sorted(existing - listed) == [], "folders missing from README's layout"
    assert sorted(listed - existing) == [], "README's layout lists folders that do not exist"


def test_the_parser_reads_only_the_section():
    text = ("# X\n\n## How the code is laid out\n\n- `a/` — one\n- `a/b/` — two\nnot `c/`\n\n"
            "## Next\n\n- `d/` — elsewhere\n")
    assert readme_folders(text) == ["a/", "a/b/"]
