"""Print what ``scripts/time_graph_steps.py --kernels`` wrote: each tree's step time, and its
kernels and GPU µs by phase with the busiest kernels (the GPU scripts under docs/results/).

    python3 scripts/show_step_profile.py FILE.jsonl [FILE.jsonl …]
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    for path in sys.argv[1:]:
        print("==", path.rsplit("/", 1)[-1])
        for line in open(path, encoding="utf-8"):
            row = json.loads(line)
            if "phases_us" in row:
                print(row["kernel_us_total"], row["phases_us"])
                for kernel in row["top"][:30]:
                    print("   ", kernel)
                for phase, kernels in row.get("by_phase", {}).items():
                    print("  ", phase)
                    for kernel in kernels:
                        print("     ", kernel)
            elif "tree" in row:
                print(row)


if __name__ == "__main__":
    main()
