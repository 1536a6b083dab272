"""A stacked bar of a plan's predicted memory, term by term, against the usable budget."""

from __future__ import annotations

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

TERMS = (  # (plan term, label, colour)
    ("weights", "weights", "#4e79a7"),
    ("heads", "heads", "#f28e2b"),
    ("kv_cache", "KV cache", "#59a14f"),
    ("tree_buffers", "tree buffers", "#e15759"),
    ("activations", "activations", "#b07aa1"),
    ("overhead", "overhead", "#9c9c9c"),
)


MIN_SLICE_PX = 6.0  # a non-zero term is never thinner than this (the tree buffers are a few MiB of GiBs)


def gib(n: float) -> str:
    if n >= 2**28:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 or n == 0 else f"{n / 2**10:.0f} KiB"


def slice_widths(values: list[int], width: float, minimum: float = MIN_SLICE_PX) -> list[float]:
    """Widths of ``values`` side by side in ``width``: proportional, except that every non-zero value
    gets at least ``minimum`` (taken from the wider slices in proportion), zeros get 0."""
    total = sum(values)
    if total <= 0:
        return [0.0] * len(values)
    raw = [width * v / total for v in values]
    small = [v > 0 and w < minimum for v, w in zip(values, raw)]
    reserved = minimum * sum(small)
    rest = sum(w for w, s in zip(raw, small) if not s)
    scale = max(width - reserved, 0.0) / rest if rest > 0 else 0.0
    return [minimum if s else w * scale for w, s in zip(raw, small)]


class MemoryChart(QWidget):
    """Paints ``terms`` (bytes by plan term) as one full-width bar with a legend; when the plan
    exceeds ``budget`` the bar spans both and a dashed line marks where the budget ends."""

    BAR_HEIGHT = 26

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.terms: dict[str, int] = {}
        self.budget = 0
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumHeight(self.sizeHint().height())

    def sizeHint(self) -> QSize:
        return QSize(420, self.BAR_HEIGHT + 22 * ((len(TERMS) + 2) // 3) + 12)

    def set_plan(self, terms: dict[str, int], budget: int) -> None:
        self.terms, self.budget = dict(terms), budget
        self.setToolTip("\n".join(f"{label}: {gib(terms.get(key, 0))}" for key, label, _ in TERMS)
                        + f"\nusable: {gib(budget)}")
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        width = self.width() - 2
        total = max(sum(self.terms.values()), 1)
        p.setPen(QPen(self.palette().mid().color()))
        p.setBrush(self.palette().base())
        p.drawRect(QRectF(1, 1, width, self.BAR_HEIGHT))
        x = 1.0
        widths = slice_widths([self.terms.get(key, 0) for key, _, _ in TERMS], width)
        for (_, _, colour), w in zip(TERMS, widths):
            if w > 0:
                p.fillRect(QRectF(x, 1, w, self.BAR_HEIGHT), QColor(colour))
                x += w
        if 0 < self.budget < total:  # NOTE: placed by bytes; the minimum slice widths shift it a pixel or two
            bx = 1 + width * self.budget / total
            p.setPen(QPen(self.palette().text().color(), 2, Qt.PenStyle.DashLine))
            p.drawLine(int(bx), 0, int(bx), self.BAR_HEIGHT + 2)
        p.setPen(QPen(self.palette().text().color()))
        col_w = max(width / 3, 1)
        for i, (key, label, colour) in enumerate(TERMS):
            cx, cy = 1 + (i % 3) * col_w, self.BAR_HEIGHT + 8 + (i // 3) * 22
            p.fillRect(QRectF(cx, cy + 2, 12, 12), QColor(colour))
            p.drawText(QRectF(cx + 16, cy, col_w - 18, 18), Qt.AlignmentFlag.AlignVCenter,
                       f"{label} {gib(self.terms.get(key, 0))}")
        p.end()
