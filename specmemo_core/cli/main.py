"""``specmemo``: the parser of every command, and one line for every failure.

An expected failure (a ``SpecMemoError``, a wrong option) prints one line and exits with
2; an unexpected exception prints one line naming the file in the data folder's
``logs/`` that holds its full traceback, and exits with 1.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

from specmemo_core.cli import bench, chat, devices, generate, plan, serve, train
from specmemo_core.errors import SpecMemoError

COMMANDS = (chat, generate, serve, plan, bench, devices, train)  # each has add_parser(subparsers) and run(args)


class OneLineParser(argparse.ArgumentParser):
    """A wrong option is one line that says where the help is, not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specmemo", description="Local chat with memory-aware speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def tolerant_streams() -> None:
    """A byte that is not valid in the terminal's encoding becomes a replacement character,
    in and out, instead of a UnicodeError that ends the chat (legacy code pages, piped bytes)."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")


def write_traceback(exc: BaseException) -> Path | None:
    """The full traceback in the data folder's ``logs/`` (else the temp folder); None if neither is writable."""
    import tempfile

    from specmemo_core.storage.data_folder import data_dir

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"specmemo-{time.strftime('%Y%m%d-%H%M%S')}-{id(exc):x}.log"
    for folder in (data_dir() / "logs", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / name
            path.write_text(f"specmemo {' '.join(sys.argv[1:])}\n{text}", encoding="utf-8")
            return path
        except OSError:
            continue
    return None


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def main(argv: list[str] | None = None) -> int:
    tolerant_streams()
    args = build_parser().parse_args(argv)
    try:
        from specmemo_core.planning.threads import apply_threads

        apply_threads(args.threads)  # before any model loads
        return args.run(args)
    except SpecMemoError as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (``specmemo plan | head``): not a failure of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush is silent too
        return 0
    except Exception as exc:  # noqa: BLE001 - the one place that turns a bug into a line and a file
        where = write_traceback(exc)
        saved = f"the full traceback is in {where}" if where else "no log folder could be written"
        print(f"error: unexpected {type(exc).__name__}: {one_line(exc)} ({saved}; please report it)",
              file=sys.stderr)
        return 1
