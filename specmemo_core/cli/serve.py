"""``specmemo serve``: the loaded model on localhost through the OpenAI API, until Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import sys

from specmemo_core.cli.common import add_model_args, generation_config
from specmemo_core.errors import SpecMemoError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the model on localhost through the OpenAI API")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this computer only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="refuse requests without `Authorization: Bearer KEY` (default: any key is accepted)")
    p.add_argument("--log-text", action="store_true",
                   help="log prompts and replies (default: only their sizes and speeds)")
    p.add_argument("--slots", type=int, default=4,
                   help="requests decoded together in one batch (each with its own KV cache, planned for; "
                        "default 4); more wait in the queue")
    p.add_argument("--max-queued", type=int, default=32,
                   help="requests that may wait for a decoding slot; more get HTTP 429")
    add_model_args(p)  # --max-new-tokens / --temperature: what a request that leaves them out gets
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specmemo_core.cli.loading import load_for_chat
    from specmemo_core.serving.api import ApiOptions
    from specmemo_core.serving.served import Defaults, serve_engine
    from specmemo_core.serving.server import ServerAddress, serve_blocking

    generation_config(args)  # checked before the model loads
    address = ServerAddress(args.host, args.port)
    if args.slots < 1:
        raise SpecMemoError(f"--slots must be 1 or more, got {args.slots}")
    if args.max_queued < 0:
        raise SpecMemoError(f"--max-queued must be 0 or more, got {args.max_queued}")
    if args.host not in LOOPBACK:
        print(f"warning: --host {args.host} lets other computers reach the model; anyone who can reach it can use "
              "it" + ("" if args.api_key else " (add --api-key)"), file=sys.stderr)
    setup = load_for_chat(args)
    planned = setup.planned
    served = serve_engine(planned.engine, capacity=setup.capacity, slots=args.slots, max_waiting=args.max_queued,
                          defaults=Defaults(args.max_new_tokens, args.temperature, args.system),
                          speculate=planned.choices.speculate, graphs=args.graphs)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)

    def ready(url: str) -> None:
        key = "the --api-key given" if args.api_key else "any"
        print(f"serving {setup.describe}\n  at {url} (OpenAI API: model {served.name!r}, API key: {key}); "
              "Ctrl-C stops", file=sys.stderr, flush=True)

    try:
        serve_blocking(served, address, ApiOptions(api_key=args.api_key, log_text=args.log_text), on_ready=ready)
    except KeyboardInterrupt:  # uvicorn passes Ctrl-C on once it has shut down: how a server is stopped
        pass
    print("stopped", file=sys.stderr)
    return 0
