"""The terminal chat through its real loop (the default model, lines fed on stdin): it goes
on past a full context, says which turns left it, answers /stats, /new, /help and /quit,
and survives bytes that are not valid in the terminal's encoding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINES = [b"Hello! Who are you?", b"Name three colors.", b"caf\xe9 \xff\xfe na\xc3\xafve: name a fruit.",
         b"Name an animal.", b"/stats", b"/new", b"/help", b"/bogus", b"Hi again.", b"/quit", b"never read"]


def run_chat(data_root: Path, lines: list[bytes], *args: str, encoding: str = "ascii") -> subprocess.CompletedProcess:
    """``python -m specmemo_core.cli chat`` with ``lines`` on stdin, its terminal speaking ``encoding``."""
    env = dict(os.environ, SPECMEMO_DATA_DIR=str(data_root), PYTHONPATH=str(REPO), PYTHONIOENCODING=encoding)
    return subprocess.run([sys.executable, "-m", "specmemo_core.cli", "chat", *args],
                          input=b"\n".join(lines) + b"\n", capture_output=True, timeout=900, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def small_context_chat(shared_data_root: Path) -> tuple[str, str, int]:
    done = run_chat(shared_data_root, LINES, "--context", "160", "--max-new-tokens", "24", "--compile")
    return done.stdout.decode("ascii"), done.stderr.decode("ascii"), done.returncode


@pytest.mark.integration
def test_the_chat_goes_on_past_a_full_context_and_says_so(small_context_chat):
    out, err, code = small_context_chat
    assert code == 0, err[-2000:]
    assert "Start a new chat" not in err and "error:" not in err
    assert "--compile speeds steps up on a CUDA GPU only; on cpu the model runs as it is" in err
    left = [int(n) for n in re.findall(r"\[(\d+) earlier turns? left the model's context\]", err)]
    assert left and all(n >= 1 for n in left)  # the oldest turns slid out, and the chat said so
    assert out.count("bot> ") == 5  # every message got a reply: 4 before /new, 1 after
    replies = [r.split("\nyou> ")[0].strip() for r in out.split("bot> ")[1:]]
    assert all(replies), replies


@pytest.mark.integration
def test_the_chat_commands(small_context_chat):
    out, err, code = small_context_chat
    stats = err.split("[new chat]")[0]
    assert re.search(r"4 replies, \d+ tokens", stats)  # /stats before /new counts this chat's four replies
    assert re.search(r"\d of 4 turns in the model's context of 160 tokens", stats)
    assert "[new chat]" in err and "/quit" in err.split("[new chat]")[1]  # /help lists the commands
    assert "unknown command /bogus; /help lists them" in err
    assert "never read" not in out and code == 0  # /quit ended the chat before the last line


@pytest.mark.integration
def test_invalid_utf8_in_and_an_ascii_terminal_out_do_not_crash_the_chat(small_context_chat):
    out, err, code = small_context_chat
    # stdin and stdout are ASCII here: the third line's bytes decode to "?"-like replacements
    # and any non-ASCII character of the replies prints as "?" instead of raising UnicodeError
    assert code == 0 and "UnicodeDecodeError" not in err and "UnicodeEncodeError" not in err
    assert out.count("bot> ") == 5
