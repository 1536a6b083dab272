"""The sidebar: search, the conversations (newest first), and New / Rename / Delete."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout, QInputDialog, QLineEdit, QListWidget, QListWidgetItem, QMessageBox, QPushButton, QVBoxLayout,
    QWidget,
)

from specmemo_core.storage.chatstore import ChatStore


class ConversationList(QWidget):
    """Shows ``store``'s conversations; emits ``selected(id)`` and ``new_requested``."""

    selected = Signal(int)
    new_requested = Signal()
    deleted = Signal(int)

    def __init__(self, store: ChatStore, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        v = QVBoxLayout(self)
        v.setContentsMargins(0, 0, 0, 0)
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search chats…")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.refresh)
        v.addWidget(self.search)
        self.list = QListWidget()
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.currentItemChanged.connect(self._current_changed)
        v.addWidget(self.list, 1)
        row = QHBoxLayout()
        for text, slot in (("New", self.new_requested.emit), ("Rename", self._rename_clicked),
                           ("Delete", self._delete_clicked)):
            button = QPushButton(text)
            button.clicked.connect(slot)
            row.addWidget(button)
        v.addLayout(row)
        self._quiet = False

    def refresh(self, *_: object, select: int | None = None) -> None:
        """Reload from the store, keeping (or moving to) the selected conversation."""
        keep = select if select is not None else self.current_id()
        text = self.search.text().strip()
        conversations = self.store.search(text) if text else self.store.list()
        self._quiet = True
        self.list.clear()
        for conv in conversations:
            item = QListWidgetItem(conv.title)
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            self.list.addItem(item)
            if conv.id == keep:
                self.list.setCurrentItem(item)
        self._quiet = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return int(item.data(Qt.ItemDataRole.UserRole)) if item is not None else None

    def ids(self) -> list[int]:
        return [int(self.list.item(i).data(Qt.ItemDataRole.UserRole)) for i in range(self.list.count())]

    def titles(self) -> list[str]:
        return [self.list.item(i).text() for i in range(self.list.count())]

    def select(self, conversation_id: int) -> None:
        for i in range(self.list.count()):
            if int(self.list.item(i).data(Qt.ItemDataRole.UserRole)) == conversation_id:
                self.list.setCurrentRow(i)
                return

    def rename(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        self.refresh()

    def delete(self, conversation_id: int) -> None:
        self.store.delete(conversation_id)
        self.refresh()
        self.deleted.emit(conversation_id)

    def _current_changed(self, current: QListWidgetItem | None, _previous: object) -> None:
        if current is not None and not self._quiet:
            self.selected.emit(int(current.data(Qt.ItemDataRole.UserRole)))

    def _rename_clicked(self) -> None:
        conv_id = self.current_id()
        if conv_id is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=self.list.currentItem().text())
        if ok:
            self.rename(conv_id, title)

    def _delete_clicked(self) -> None:
        conv_id = self.current_id()
        if conv_id is None:
            return
        answer = QMessageBox.question(self, "Delete chat", f"Delete “{self.list.currentItem().text()}” and all "
                                      "its messages? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete(conv_id)
