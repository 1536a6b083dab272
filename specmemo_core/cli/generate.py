"""``specmemo generate``: one reply to one prompt, speculating with the planner's tree."""

from __future__ import annotations

import argparse
import json
import sys

from specmemo_core.cli.common import add_model_args, generation_config
from specmemo_core.cli.replies import status_line, stream_reply


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="one reply to one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with the reply, its speed, the tree, precision and threads")
    add_model_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specmemo_core.cli.loading import load_for_chat

    config = generation_config(args)
    setup = load_for_chat(args)
    echo = None if args.json else (lambda s: print(s, end="", flush=True))
    stats = stream_reply(setup.open_session(), args.prompt, config, echo)
    if args.json:
        print(json.dumps({"text": stats.text, **stats.as_dict(), **setup.facts()}))
    else:
        print(f"\n{status_line(stats)} {setup.describe}", file=sys.stderr)
    return 0
