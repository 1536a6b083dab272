"""Light and dark palettes, and which one applies: the user's choice, or the system's colour scheme.

The palette is set on the application (menus, dialogs and tooltips follow it); widgets that paint
their own colours (the chat bubbles, the memory chart) read them from the palette, never from constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

@dataclass(frozen=True)
class Colours:
    window: str
    base: str
    alternate: str
    text: str
    muted: str
    button: str
    accent: str
    accent_text: str
    success: str
    warning: str


LIGHT = Colours(window="#f5f6f8", base="#ffffff", alternate="#eef1f5", text="#1d2230", muted="#6b7280",
                button="#ffffff", accent="#2f6fed", accent_text="#ffffff", success="#1f7a3d", warning="#9a4d00")
DARK = Colours(window="#1e2127", base="#262a31", alternate="#2e333b", text="#e6e8ec", muted="#9aa3b2",
               button="#30353d", accent="#5b8cff", accent_text="#ffffff", success="#5fce84", warning="#f0a35e")


def resolve(choice: str) -> str:
    """"light" or "dark": the choice itself, or for "system" the platform's scheme (light when unknown)."""
    if choice in ("light", "dark"):
        return choice
    scheme = QGuiApplication.styleHints().colorScheme()
    return "dark" if scheme == Qt.ColorScheme.Dark else "light"


def colours(scheme: str) -> Colours:
    return DARK if scheme == "dark" else LIGHT


def palette(c: Colours) -> QPalette:
    p = QPalette()
    roles = {
        QPalette.ColorRole.Window: c.window, QPalette.ColorRole.WindowText: c.text,
        QPalette.ColorRole.Base: c.base, QPalette.ColorRole.AlternateBase: c.alternate,
        QPalette.ColorRole.Text: c.text, QPalette.ColorRole.Button: c.button,
        QPalette.ColorRole.ButtonText: c.text, QPalette.ColorRole.ToolTipBase: c.base,
        QPalette.ColorRole.ToolTipText: c.text, QPalette.ColorRole.PlaceholderText: c.muted,
        QPalette.ColorRole.Highlight: c.accent, QPalette.ColorRole.HighlightedText: c.accent_text,
        QPalette.ColorRole.Link: c.accent, QPalette.ColorRole.BrightText: c.warning,
        QPalette.ColorRole.Mid: c.muted, QPalette.ColorRole.Midlight: c.alternate,
        QPalette.ColorRole.Dark: c.muted, QPalette.ColorRole.Light: c.base,
    }
    for role, colour in roles.items():
        p.setColor(role, QColor(colour))
    for role in (QPalette.ColorRole.Text, QPalette.ColorRole.WindowText, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(c.muted))
    return p


def rgba(colour: str, alpha: int) -> str:
    """``colour`` ("#rrggbb") with ``alpha`` (0–255) for a style sheet (whose 8-digit hex is #aarrggbb)."""
    q = QColor(colour)
    return f"rgba({q.red()}, {q.green()}, {q.blue()}, {alpha})"


def stylesheet(c: Colours) -> str:
    """Rounded controls, an accent Send button, the model chip and the example-prompt cards."""
    return f"""
    QPushButton {{ padding: 5px 12px; border-radius: 6px; border: 1px solid {rgba(c.muted, 0x55)};
                   background: {c.button}; }}
    QPushButton:hover {{ border-color: {c.accent}; }}
    QPushButton:disabled {{ color: {c.muted}; border-color: {rgba(c.muted, 0x33)}; }}
    QPushButton#primary {{ background: {c.accent}; color: {c.accent_text}; border: none; font-weight: 600; }}
    QPushButton#primary:disabled {{ background: {rgba(c.accent, 0x66)}; }}
    QPushButton#example {{ text-align: left; padding: 10px 14px; border-radius: 10px; background: {c.alternate}; }}
    QToolButton#chip {{ border-radius: 11px; padding: 3px 10px; background: {c.alternate}; color: {c.text};
                        border: 1px solid {rgba(c.muted, 0x44)}; }}
    QToolButton#chip:hover {{ border-color: {c.accent}; }}
    QPlainTextEdit, QLineEdit, QListWidget {{ border: 1px solid {rgba(c.muted, 0x55)}; border-radius: 8px;
                                             padding: 4px; background: {c.base}; }}
    QPlainTextEdit:focus, QLineEdit:focus {{ border-color: {c.accent}; }}
    QTextBrowser {{ border: none; background: {c.base}; }}
    QListWidget::item {{ padding: 6px 4px; border-radius: 6px; }}
    QListWidget::item:selected {{ background: {rgba(c.accent, 0x33)}; color: {c.text}; }}
    QLabel#muted {{ color: {c.muted}; }}
    QLabel#welcomeTitle {{ font-size: 20pt; font-weight: 600; }}
    """


def apply(choice: str) -> Colours:
    """Set the palette and style sheet for ``choice`` ("system", "light" or "dark") on the application."""
    c = colours(resolve(choice))
    app = QApplication.instance()
    app.setPalette(palette(c))
    app.setStyleSheet(stylesheet(c))
    return c
