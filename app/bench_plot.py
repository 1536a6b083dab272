"""A PNG chart of a ``specmemo bench --json`` report, drawn with Qt (the core has no Qt).

    specmemo bench ... --json > bench.json
    python -m app.bench_plot bench.json bench.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPen
from PySide6.QtWidgets import QApplication

from specmemo_core.tools.bench import HF_METHODS
from specmemo_core.errors import SpecMemoError


def plot_png(result: dict[str, dict[str, Any]], path: str | Path, title: str = "specmemo bench") -> Path:
    """A bar chart of tokens/s (median) with min–max whiskers, drawn with Qt offscreen
    (no plotting library needed)."""
    # A QApplication (not just a QGuiApplication): a process that later opens a window
    # (the app, or pytest-qt) must find a QApplication or Qt aborts.
    app = QApplication.instance() or QApplication(["specmemo-bench", "-platform", "offscreen"])  # noqa: F841
    # the tree is named when the method's name does not say it already ("plan": which tree)
    rows = [(n if r["tree"] is None or n.startswith(r["tree"]) else f"{n}: {r['tree']}", r["tokens_per_s"])
            for n, r in result.items() if not n.startswith("_")]
    if not rows:
        raise SpecMemoError("nothing to plot: the report has no methods")
    width, height = max(640, 130 * len(rows) + 120), 440
    left, right, top, bottom = 70, 20, 40, 80
    image = QImage(width, height, QImage.Format.Format_ARGB32)
    image.fill(QColor("white"))
    painter = QPainter(image)
    try:
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setFont(QFont("sans", 10))
        top_value = max(s["max"] for _, s in rows) * 1.15 or 1.0
        plot_h = height - top - bottom
        y = lambda v: top + plot_h * (1 - v / top_value)  # noqa: E731
        painter.setPen(QPen(QColor("#cccccc"), 1))
        for k in range(6):
            v = top_value * k / 5
            painter.drawLine(QPointF(left, y(v)), QPointF(width - right, y(v)))
            painter.setPen(QPen(QColor("black"), 1))
            painter.drawText(QRectF(0, y(v) - 8, left - 6, 16), Qt.AlignmentFlag.AlignRight, f"{v:.0f}")
            painter.setPen(QPen(QColor("#cccccc"), 1))
        painter.setPen(QPen(QColor("black"), 1))
        painter.drawText(QRectF(0, 8, width, 24), Qt.AlignmentFlag.AlignCenter, f"{title} — tokens/s (median, min–max)")
        slot = (width - left - right) / len(rows)
        for i, (name, s) in enumerate(rows):
            x0 = left + i * slot + slot * 0.2
            bar_w = slot * 0.6
            color = QColor("#9e9e9e") if name in HF_METHODS else QColor("#3f7fbf")  # transformers grey, ours blue
            painter.fillRect(QRectF(x0, y(s["median"]), bar_w, y(0) - y(s["median"])), color)
            cx = x0 + bar_w / 2
            painter.setPen(QPen(QColor("black"), 2))
            painter.drawLine(QPointF(cx, y(s["min"])), QPointF(cx, y(s["max"])))
            for v in (s["min"], s["max"]):
                painter.drawLine(QPointF(cx - 8, y(v)), QPointF(cx + 8, y(v)))
            painter.setPen(QPen(QColor("black"), 1))
            painter.drawText(QRectF(x0 - 20, y(s["max"]) - 20, bar_w + 40, 16), Qt.AlignmentFlag.AlignCenter,
                             f"{s['median']:.1f}")
            # long names wrap (at "+" and ":" too) within the bar's slot
            painter.drawText(QRectF(left + i * slot + 2, y(0) + 6, slot - 4, bottom - 10),
                             Qt.AlignmentFlag.AlignHCenter | Qt.AlignmentFlag.AlignTop | Qt.TextFlag.TextWordWrap,
                             name.replace("+", "+\u200b").replace(": ", ":\n"))
        painter.drawLine(QPointF(left, y(0)), QPointF(width - right, y(0)))
    finally:
        painter.end()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not image.save(str(path), "PNG"):
        raise SpecMemoError(f"{path}: could not write the PNG")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.bench_plot", description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="the JSON that `specmemo bench --json` printed")
    parser.add_argument("png", type=Path)
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    try:
        result = json.loads(args.report.read_text())
        run = result.get("_run", {})
        title = args.title or f"specmemo bench, {run.get('model', '')}, {run.get('device', '')} {run.get('dtype', '')}"
        plot_png(result, args.png, title.strip(", "))
    except (OSError, ValueError, KeyError, SpecMemoError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
