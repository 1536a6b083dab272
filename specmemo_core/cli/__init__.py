"""``specmemo`` command line: one module per command (chat, generate, plan, bench, devices,
train for train-heads/calibrate/eval-acceptance), each with ``add_parser(subparsers)`` and
``run(args) -> int``; ``main`` parses and turns failures into one line."""

from specmemo_core.cli.main import build_parser, main
from specmemo_core.cli.replies import ReplyStats, stream_reply

__all__ = ["ReplyStats", "build_parser", "main", "stream_reply"]
