"""The window's commands in one table: the menus, their shortcuts and Help ▸ Keyboard shortcuts come from it."""

from __future__ import annotations

import html
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMainWindow

Key = str | None  # a portable key sequence, "Ctrl+N" (Ctrl is ⌘ on macOS)


@dataclass(frozen=True)
class Command:
    menu: str  # "&Chat", "&Model", "&View", "&Help"
    text: str
    slot: Callable[[], object]
    key: Key = None


# keys the input box handles itself (no QAction): listed with the others in the help
TYPING_KEYS = (("Enter", "Send the message"), ("Shift+Enter", "New line in the message"))


def key_text(key: Key) -> str:
    if key is None:
        return ""
    return QKeySequence(key).toString(QKeySequence.SequenceFormat.NativeText)


def build_menus(window: QMainWindow, commands: list[Command]) -> dict[str, QAction]:
    """Add every command to its menu (menus in first-use order); returns the actions by text."""
    menus, actions = {}, {}
    for command in commands:
        if command.menu not in menus:
            menus[command.menu] = window.menuBar().addMenu(command.menu)
        action = QAction(command.text, window)
        action.triggered.connect(command.slot)
        if command.key is not None:
            action.setShortcut(QKeySequence(command.key))
        menus[command.menu].addAction(action)
        actions[command.text] = action
    return actions


def shortcuts_html(commands: list[Command]) -> str:
    """A two-column table of every shortcut: the typing keys, then each command that has one."""
    rows = list(TYPING_KEYS) + [(key_text(c.key), c.text.rstrip("…")) for c in commands if key_text(c.key)]
    cells = "".join(f"<tr><td><b>{html.escape(k)}</b>&nbsp;&nbsp;</td><td>{html.escape(t)}</td></tr>"
                    for k, t in rows)
    return f"<table cellpadding='3'>{cells}</table>"


def about_html() -> str:
    try:
        version = metadata.version("specmemo-chat")
    except metadata.PackageNotFoundError:
        version = "development copy"
    return ("<h3>SpecMemo Chat</h3>"
            f"<p>Version {html.escape(version)}</p>"
            "<p>An offline chat app: a local language model, sped up by speculative decoding (draft heads and "
            "lookup chains verified as a tree), with a memory planner that fits the conversation to your "
            "device. Nothing you type leaves this computer.</p>")
