"""The conversation as Markdown (Qt's own parser), re-rendered as tokens stream in."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QTimer
from PySide6.QtGui import QColor, QFontDatabase, QTextBlockFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import QTextBrowser, QWidget

RENDER_DELAY_MS = 40  # tokens arriving within this window are rendered together
ROLE_TITLES = {"user": "You", "assistant": "Assistant", "notice": "Note"}
CODE_BACKGROUND = QColor("#f2f4f7")


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
        parts = []
        for e in self.entries:
            title = ROLE_TITLES.get(e.role, e.role)
            body = close_fences(e.text) if e.text else "…"
            if e.role == "notice":
                parts.append(f"> *{body}*")
            else:
                parts.append(f"#### {title}\n\n{body}")
        return "\n\n---\n\n".join(parts) + "\n"

    def render(self) -> None:
        self._timer.stop()
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.document().setMarkdown(self.markdown())
        self._style_code_blocks()
        if at_bottom:
            bar.setValue(bar.maximum())

    def _style_code_blocks(self) -> None:
        """Give fenced code a tinted background and a monospace font."""
        block = self.document().begin()
        cursor = QTextCursor(self.document())
        while block.isValid():
            fmt = block.blockFormat()
            if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
                cursor.setPosition(block.position())
                shaded = QTextBlockFormat()
                shaded.setBackground(CODE_BACKGROUND)
                shaded.setLeftMargin(12)
                cursor.mergeBlockFormat(shaded)
                cursor.select(QTextCursor.SelectionType.BlockUnderCursor)
                char = cursor.charFormat()
                char.setFont(self._mono, char.FontPropertiesInheritanceBehavior.FontPropertiesSpecifiedOnly)
                cursor.mergeCharFormat(char)
            block = block.next()
