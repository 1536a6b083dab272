"""Gather docs/results/offload_gpu.sh's output into docs/results/offload_h200.json and
(``--readme``) write its rows into README's "Models larger than the GPU" tables.

    python3 scripts/collect_offload_results.py OUT_OF_COLLECT OUT_OF_CALL2 --readme

tests/core/test_readme_numbers.py checks the README rows against the JSON (or, before the
GPU run, that they say "pending GPU run").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs/results/offload_h200.json"
METHODS = ("accelerate-offload", "stream-plain", "stream-tree", "stream-random-heads")
VERIFIES = ("vicuna-7b-bf16-8gb", "vicuna-13b-int8-12gb", "llama-3-8b-bf16-8gb")
COMMANDS = {
    "bench": "bash docs/results/offload_gpu.sh copy; ... start; ... collect (back-to-back device calls)",
    "verify": "bash docs/results/offload_gpu.sh copy; ... call2",
}


def bench_row(name: str, bench: dict | None) -> str:
    if bench is None or name not in bench:
        return f"| `{name}` | pending GPU run | | | |"
    s = bench[name]["tokens_per_s"]
    base, plain = (bench[m]["tokens_per_s"]["median"] for m in ("accelerate-offload", "stream-plain"))
    return (f"| `{name}` | {s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f}) | {bench[name]['mean_accepted']:.2f} "
            f"| {s['median'] / base:.2f}× | {s['median'] / plain:.2f}× |")


def verify_row(name: str, verify: dict | None) -> str:
    v = (verify or {}).get(name)
    if v is None:
        return f"| {name} | pending GPU run | | | | |"
    gib = 2**30
    check = v["stream_check"]
    link = f"{check['link_fraction']:.0%}" if check["link_fraction"] is not None else "n/a"
    return (f"| {name} | {v['resident_layers']} / {v['streamed_layers']} | {v['pinned_host_bytes'] / gib:.2f} | "
            f"{v['predicted_bytes_total'] / gib:.2f} / {v['measured_peak_bytes'] / gib:.2f} | "
            f"{check['tree64_vs_plain_step']:.2f}× | {link} |")


def rows(results: dict | None) -> list[str]:
    bench = results["bench"] if results else None
    verify = results["verify"] if results else None
    return [bench_row(m, bench) for m in METHODS] + [verify_row(v, verify) for v in VERIFIES]


def collect(folders: list[Path]) -> dict:
    def find(name: str) -> Path | None:
        return next((f / name for f in folders if (f / name).exists()), None)

    out: dict = {"commands": COMMANDS, "bench": None, "verify": {}, "probe": None}
    if (bench := find("bench_offload.json")) is not None:
        out["bench"] = json.loads(bench.read_text(encoding="utf-8"))
    for name in VERIFIES:
        if (path := find(f"verify_{name}.json")) is not None and path.stat().st_size:
            out["verify"][name] = json.loads(path.read_text(encoding="utf-8").strip().splitlines()[-1])
    if (probe := find("probe_default_r15.json")) is not None and probe.stat().st_size:
        out["probe"] = json.loads(probe.read_text(encoding="utf-8"))
    return out


def write_readme(results: dict) -> None:
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    for old, new in zip(rows(None), rows(results)):
        label = old.split(" | ", 1)[0]
        line = next(line for line in text.splitlines() if line.startswith(label + " |"))
        text = text.replace(line, new)
    readme.write_text(text, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--readme", action="store_true")
    args = parser.parse_args()
    results = collect(args.folders)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if args.readme:
        write_readme(results)
    print("\n".join(rows(results)))


if __name__ == "__main__":
    main()
