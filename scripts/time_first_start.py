"""Time the app's first and later starts to a ready window (issue 16's goal: ≤ 45 s and ≤ 5 s).

"First start after the download": a fresh data folder holding only the downloaded GGUF (no
checksum stamp, no cache, no device timing), so checksum, unpacking, planning and the window
are all counted. "Later start": the same folder again. Each start is
``python -m app --screenshot PNG`` (the window saves the PNG the moment its model is loaded,
then quits): ready = the PNG's file time less the launch time; the process's own end is
reported too (``process_exit``).

    QT_QPA_PLATFORM=offscreen python scripts/time_first_start.py --runs 3 --out docs/results/first_start_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed_start(data_folder: Path) -> tuple[float, float]:
    """(ready, exited): seconds from launch until the window was ready — its screenshot,
    saved the moment its model is loaded, has that file time — and until the process ended
    (after the window closed: saving the conversation, stopping a background timing)."""
    env = {**os.environ, "SPECMEMO_DATA_DIR": str(data_folder), "QT_QPA_PLATFORM": os.environ.get(
        "QT_QPA_PLATFORM", "offscreen")}
    png = data_folder / "ready.png"
    launched = time.time()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "app", "--screenshot", str(png)], cwd=REPO,
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    exited = time.perf_counter() - start
    if not png.is_file():
        raise RuntimeError("the window saved no screenshot: it did not get ready")
    ready = png.stat().st_mtime - launched
    png.unlink()
    return ready, exited


def summary(values: list[float]) -> dict[str, float | list[float]]:
    return {"median_s": round(statistics.median(values), 2), "min_s": round(min(values), 2),
            "max_s": round(max(values), 2), "runs_s": [round(v, 2) for v in values]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from specmemo_core.storage.sources import ensure_default_model

    gguf = ensure_default_model()  # the download, not timed
    first, later = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="specmemo-start-") as tmp:
            folder = Path(tmp)
            (folder / "models").mkdir()
            shutil.copy2(gguf, folder / "models" / gguf.name)
            first.append(timed_start(folder))
            later.append(timed_start(folder))
            print(f"first {first[-1][0]:.1f} s, later {later[-1][0]:.1f} s to a ready window", file=sys.stderr,
                  flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {"first_start": summary([r for r, _ in first]), "later_start": summary([r for r, _ in later]),
              "process_exit": {"first_start": summary([e for _, e in first]),
                               "later_start": summary([e for _, e in later])},
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "load_average_1min_after": load}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
