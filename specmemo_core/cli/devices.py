"""``specmemo devices``: the GPUs and the CPU, with the memory free for the model."""

from __future__ import annotations

import argparse
import json

from specmemo_core.cli.common import add_threads_arg


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("devices", help="list GPUs and the CPU with the memory free for the model")
    p.add_argument("--json", action="store_true", help="print one JSON object with devices and notes")
    add_threads_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specmemo_core.planning.device import probe

    report = probe()
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    gib = 2**30
    print(f"{'kind':<6}{'name':<36}{'free / total GiB':>18}  {'driver':<18}note")
    for d in report.devices:
        print(f"{d.kind:<6}{d.name[:35]:<36}{d.free_bytes / gib:>8.1f} / {d.total_bytes / gib:<7.1f}"
              f"  {d.driver[:18]:<18}{d.note}")
    for note in report.notes:
        print(f"note: {note}")
    return 0
