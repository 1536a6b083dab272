"""The conversation as Markdown (Qt's own parser), re-rendered as tokens stream in."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import (
    QColor, QFont, QFontDatabase, QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextFormat,
    QTextFrameFormat,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

RENDER_DELAY_MS = 40  # tokens arriving within this window are rendered together
ROLE_TITLES = {"user": "You", "assistant": "Assistant", "notice": "Note"}
INDENT = 0.18  # of the view's width: the side a turn leaves free (yours on the right, replies on the left)


def _mix(a: QColor, b: QColor, t: float) -> QColor:
    """``a`` moved a fraction ``t`` of the way to ``b``."""
    return QColor.fromRgbF(*(x + (y - x) * t for x, y in zip(a.getRgbF()[:3], b.getRgbF()[:3])))


def bubble_colour(palette: QPalette, user: bool) -> QColor:
    """Your turns tinted with the accent colour, the assistant's with the alternate base colour."""
    base = palette.base().color()
    return _mix(base, palette.highlight().color(), 0.16) if user else palette.alternateBase().color()


def code_background(palette: QPalette) -> QColor:
    return _mix(palette.base().color(), palette.text().color(), 0.11)


def close_fences(text: str) -> str:
    """Close a code fence the text left open (a reply cut short), so later messages stay prose."""
    fences = sum(1 for line in text.splitlines() if line.lstrip().startswith(("```", "~~~")))
    return text + "\n```" if fences % 2 else text


@dataclass
class Entry:
    role: str  # "user" | "assistant" | "notice"
    text: str


class ChatView(QTextBrowser):
    """Read-only view of one conversation; the last assistant entry grows while a reply streams."""

    rendered = Signal()  # after every render: the window shows its welcome panel while there are no entries

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.entries: list[Entry] = []
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(RENDER_DELAY_MS)
        self._timer.timeout.connect(self.render)
        self._mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)

    def set_messages(self, messages: list[tuple[str, str]]) -> None:
        self.entries = [Entry(role, text) for role, text in messages]
        self.render()

    def add(self, role: str, text: str) -> None:
        self.entries.append(Entry(role, text))
        self.render()

    def begin_reply(self) -> None:
        self.add("assistant", "")

    def append_text(self, text: str) -> None:
        """Add streamed text to the reply in progress; rendering is coalesced."""
        if not self.entries or self.entries[-1].role != "assistant":
            self.entries.append(Entry("assistant", ""))
        self.entries[-1].text += text
        if not self._timer.isActive():
            self._timer.start()

    def drop_last(self, role: str) -> Entry | None:
        """Remove the last entry if it has ``role`` (a reply that failed, a message sent back)."""
        if self.entries and self.entries[-1].role == role:
            entry = self.entries.pop()
            self.render()
            return entry
        return None

    @property
    def reply_text(self) -> str:
        """The last assistant entry's text (what has streamed so far)."""
        replies = [e.text for e in self.entries if e.role == "assistant"]
        return replies[-1] if replies else ""

    def markdown(self) -> str:
        """The conversation as one Markdown text (what Copy-all and exports of the view would carry)."""
        parts = []
        for e in self.entries:
            body = close_fences(e.text) if e.text else "…"
            parts.append(f"> *{body}*" if e.role == "notice" else f"#### {ROLE_TITLES.get(e.role, e.role)}\n\n{body}")
        return "\n\n---\n\n".join(parts) + "\n"

    def render(self) -> None:
        """Rebuild the document: each turn a tinted frame (yours on the right, the assistant's on the
        left), its text through Qt's Markdown parser; notices centred and muted."""
        self._timer.stop()
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        doc = self.document()
        doc.clear()
        doc.setDocumentMargin(14)
        cursor = QTextCursor(doc)
        for i, entry in enumerate(self.entries):
            if i:
                cursor.movePosition(QTextCursor.MoveOperation.End)
            self._insert_entry(cursor, entry)
        self._style_code_blocks()
        if at_bottom:
            bar.setValue(bar.maximum())
        self.rendered.emit()

    def _insert_entry(self, cursor: QTextCursor, entry: Entry) -> None:
        palette = self.palette()
        frame = QTextFrameFormat()
        frame.setPadding(10)
        frame.setBottomMargin(10)
        width = max(self.viewport().width(), 400)
        if entry.role == "user":
            frame.setBackground(bubble_colour(palette, user=True))
            frame.setLeftMargin(width * INDENT)
        elif entry.role == "assistant":
            frame.setBackground(bubble_colour(palette, user=False))
            frame.setRightMargin(width * INDENT)
        cursor.insertFrame(frame)
        title = QTextCharFormat()
        title.setFontWeight(QFont.Weight.DemiBold)
        title.setForeground(palette.placeholderText())
        if entry.role == "notice":
            centred = QTextBlockFormat()
            centred.setAlignment(Qt.AlignmentFlag.AlignCenter)
            cursor.setBlockFormat(centred)
            title.setFontItalic(True)
            title.setFontWeight(QFont.Weight.Normal)
            cursor.insertText(entry.text, title)
            return
        cursor.insertText(ROLE_TITLES.get(entry.role, entry.role), title)
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        cursor.insertMarkdown(close_fences(entry.text) if entry.text else "…")

    def _style_code_blocks(self) -> None:
        """Give fenced code a tinted background and a monospace font."""
        block = self.document().begin()
        cursor = QTextCursor(self.document())
        background = code_background(self.palette())
        while block.isValid():
            fmt = block.blockFormat()
            if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
                cursor.setPosition(block.position())
                shaded = QTextBlockFormat()
                shaded.setBackground(background)
                shaded.setLeftMargin(12)
                cursor.mergeBlockFormat(shaded)
                cursor.select(QTextCursor.SelectionType.BlockUnderCursor)
                char = cursor.charFormat()
                char.setFont(self._mono, char.FontPropertiesInheritanceBehavior.FontPropertiesSpecifiedOnly)
                cursor.mergeCharFormat(char)
            block = block.next()

    def resizeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().resizeEvent(event)
        self._timer.start()  # the bubbles' margins follow the width

    def changeEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:
            self.render()
