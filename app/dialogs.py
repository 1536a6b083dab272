"""Questions and notices as dialogs. The window calls them through one object so tests can answer."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox, QWidget

from specmemo_core.errors import SpecMemoError


def describe(exc: BaseException) -> str:
    """Our typed errors say what to do; anything else is named by its type (a bug or a broken file)."""
    if isinstance(exc, SpecMemoError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class Dialogs:
    """``ask`` returns the chosen button's text (None if closed); ``tell`` warns; ``inform`` just informs."""

    def __init__(self, parent: QWidget) -> None:
        self.parent = parent

    def ask(self, title: str, text: str, choices: list[str]) -> str | None:
        box = QMessageBox(QMessageBox.Icon.Warning, title, text, parent=self.parent)
        buttons = {box.addButton(c, QMessageBox.ButtonRole.AcceptRole if i == 0 else
                                 QMessageBox.ButtonRole.RejectRole if c == "Cancel" else
                                 QMessageBox.ButtonRole.ActionRole): c for i, c in enumerate(choices)}
        box.exec()
        return buttons.get(box.clickedButton())

    def tell(self, title: str, text: str) -> None:
        QMessageBox.warning(self.parent, title, text)

    def inform(self, title: str, rich_text: str) -> None:
        """A plain information box (help, about): no question, no warning icon."""
        box = QMessageBox(QMessageBox.Icon.NoIcon, title, rich_text, parent=self.parent)
        box.setTextFormat(Qt.TextFormat.RichText)
        box.exec()
