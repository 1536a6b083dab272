"""Predicted against measured peak memory for a matrix of plans, through the real CLI.

Each configuration runs ``specmemo plan ... --verify --json`` in its own process (clean
allocator statistics) and its result is appended to ``OUT/verify.jsonl`` as soon as it
ends, so a run cut short keeps what it measured. Usage (on a CUDA machine):

    python scripts/verify_plans.py --out DIR matrix --model default --model shape:vicuna-7b \\
        --precision bf16 --precision int8 --precision int4 --tree medusa-64 --tree 1-10-16-17
    python scripts/verify_plans.py --out DIR caps --model shape:vicuna-7b --vram 8GB --vram 12GB ...
    python scripts/verify_plans.py --out DIR table [--recompute]   # Markdown table of verify.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(out: Path, label: dict, cli_args: list[str], timeout: int) -> dict:
    cmd = [sys.executable, "-m", "specmemo_core.cli", "plan", *cli_args, "--json"]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = 124, exc.stdout or "", f"timed out after {timeout} s"
        stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    record = {**label, "args": cli_args, "rc": rc, "seconds": round(time.time() - t0, 1)}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if lines:
        result = json.loads(lines[-1])
        record["plan"] = {k: result.get(k) for k in ("fits", "precision", "tree", "tree_nodes", "kv_tokens", "turns",
                                                      "predicted_bytes", "suggestions")}
        for k in ("predicted_bytes_total", "measured_peak_bytes", "measured_terms", "turns_run", "context_resets"):
            if k in result:
                record[k] = result[k]
        if "measured_peak_bytes" in result:
            record["error"] = round((result["predicted_bytes_total"] - result["measured_peak_bytes"])
                                    / result["measured_peak_bytes"], 4)
    if rc not in (0, 3):
        record["stderr_tail"] = stderr[-2000:]
    with open(out / "verify.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: record.get(k) for k in ("kind", "model", "precision", "tree", "vram", "rc", "error",
                                                 "seconds")}), flush=True)
    return record


def predicted_now(r: dict) -> int:
    """The recorded plan's peak as the current memory model predicts it (CUDA: without the
    runtime-overhead term, which the allocator does not count). Measured bytes do not
    depend on the formula, so old runs can be re-scored after a formula changes."""
    from specmemo_core.planning.memory import HeadsShape, TreeShape, known_shape
    from specmemo_core.planning.planner import memory_terms
    from specmemo_core.runtime.tree import load_tree

    p = r["plan"]
    model = r["model"]
    shape = known_shape(model[6:] if model.startswith("shape:") else "smollm2-135m")
    tree = TreeShape(p["tree_nodes"], load_tree(p["tree"]).depth) if p["tree"] else TreeShape()
    terms = memory_terms(shape, HeadsShape("hydra", 4, 1), precision=p["precision"], kind="cuda",
                         kv_tokens=p["kv_tokens"], tree=tree)
    return sum(terms.values()) - terms["overhead"]


def table(out: Path, recompute: bool = False) -> str:
    head = "predicted now GiB" if recompute else "predicted GiB"
    rows = [f"| model | precision | tree | KV tokens | turns run | {head} | measured GiB | error |",
            "|---|---|---|---|---|---|---|---|"]
    for line in (out / "verify.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "measured_peak_bytes" not in r or (recompute and r.get("superseded")):
            continue
        p = r["plan"]
        predicted = predicted_now(r) if recompute else r["predicted_bytes_total"]
        error = (predicted - r["measured_peak_bytes"]) / r["measured_peak_bytes"]
        rows.append(f"| {r['model']} {r.get('vram', '')} | {p['precision']} | {p['tree']} | {p['kv_tokens']} | "
                    f"{r['turns_run']} | {predicted / 2**30:.3f} | "
                    f"{r['measured_peak_bytes'] / 2**30:.3f} | {100 * error:+.1f}% |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    sub = parser.add_subparsers(dest="what", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("--model", action="append", required=True)
    m.add_argument("--precision", action="append", required=True)
    m.add_argument("--tree", action="append", required=True)
    m.add_argument("--vram", default="24GB")
    c = sub.add_parser("caps")
    c.add_argument("--model", default="shape:vicuna-7b")
    c.add_argument("--vram", action="append", required=True)
    for p in (m, c):
        p.add_argument("--turns", default="20")
        p.add_argument("--prompt-tokens", default="200")
        p.add_argument("--reply-tokens", default="64")
        p.add_argument("--timeout", type=int, default=300)
    t = sub.add_parser("table")
    t.add_argument("--recompute", action="store_true", help="score with the current memory model")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "table":
        print(table(args.out, args.recompute))
        return 0
    common = ["--turns", args.turns, "--prompt-tokens", args.prompt_tokens, "--reply-tokens", args.reply_tokens,
              "--verify"]
    if args.what == "matrix":
        for model in args.model:
            for precision in args.precision:
                for tree in args.tree:
                    label = {"kind": "matrix", "model": model, "precision": precision, "tree": tree,
                             "vram": args.vram}
                    run(args.out, label, ["--model", model, "--vram", args.vram, "--precision", precision,
                                          "--tree", tree, "--prefer", "speed", *common], args.timeout)
    else:
        for vram in args.vram:
            label = {"kind": "cap", "model": args.model, "vram": vram}
            run(args.out, label, ["--model", args.model, "--vram", vram, *common], args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
