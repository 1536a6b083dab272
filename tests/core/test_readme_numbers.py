"""README figures that come from a results file say what the file says."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_start_up_times_in_the_readme_are_the_measured_ones():
    measured = json.loads((REPO / "docs/results/first_start_cpu.json").read_text(encoding="utf-8"))
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for start in ("first_start", "later_start"):
        s = measured[start]
        figure = f"**{s['median_s']:.1f} s** median ({s['min_s']:.1f}–{s['max_s']:.1f})" if start == "first_start" \
            else f"**{s['median_s']:.1f} s** ({s['min_s']:.1f}–{s['max_s']:.1f})"
        assert figure in readme, f"README's {start} figure is not {figure}"


def test_serve_throughput_in_the_readme_is_the_measured_one():
    measured = json.loads((REPO / "docs/results/serve_throughput_cpu.json").read_text(encoding="utf-8"))
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for run in measured["runs"]:
        figure = f"**{run['total_tokens_per_s']:.1f} tok/s** with {run['clients']} client"
        assert figure in readme, f"README's serve throughput is not {figure}"
    direct = f"{measured['direct']['total_tokens_per_s']:.1f} tok/s for the same"
    assert direct in readme, f"README's decoding without the server is not {direct}"
