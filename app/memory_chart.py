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


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.0f} MiB"


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
        p.setPen(QPen(QColor("#c8c8c8")))
        p.setBrush(QColor("#f7f7f7"))
        p.drawRect(QRectF(1, 1, width, self.BAR_HEIGHT))
        x = 1.0
        for key, _, colour in TERMS:
            w = width * self.terms.get(key, 0) / total
            if w > 0:
                p.fillRect(QRectF(x, 1, w, self.BAR_HEIGHT), QColor(colour))
                x += w
        if 0 < self.budget < total:
            bx = 1 + width * self.budget / total
            p.setPen(QPen(QColor("#202020"), 2, Qt.PenStyle.DashLine))
            p.drawLine(int(bx), 0, int(bx), self.BAR_HEIGHT + 2)
        p.setPen(QPen(self.palette().text().color()))
        col_w = max(width / 3, 1)
        for i, (key, label, colour) in enumerate(TERMS):
            cx, cy = 1 + (i % 3) * col_w, self.BAR_HEIGHT + 8 + (i // 3) * 22
            p.fillRect(QRectF(cx, cy + 2, 12, 12), QColor(colour))
            p.drawText(QRectF(cx + 16, cy, col_w - 18, 18), Qt.AlignmentFlag.AlignVCenter,
                       f"{label} {gib(self.terms.get(key, 0))}")
        p.end()
