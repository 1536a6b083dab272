"""What an empty chat shows: example prompts when a model is ready, the loading stage while one loads,
and, when none is loaded, what happened and the two ways to load one."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QPushButton, QStackedWidget, QVBoxLayout, QWidget

EXAMPLES = (
    "Write a Python function that checks whether a number is prime.",
    "Explain speculative decoding to a ten-year-old.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Summarise the difference between a list and a tuple in Python.",
)


def _label(text: str, name: str = "muted") -> QLabel:
    label = QLabel(text)
    label.setObjectName(name)
    label.setWordWrap(True)
    label.setAlignment(Qt.AlignmentFlag.AlignCenter)
    return label


class WelcomePanel(QWidget):
    """Three pages — ready, loading, no model — switched by ``show_ready``/``show_loading``/``show_no_model``."""

    prompt_chosen = Signal(str)
    load_default = Signal()
    choose_file = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        v = QVBoxLayout(self)
        v.addStretch(1)
        v.addWidget(_label("SpecMemo Chat", "welcomeTitle"))
        self.subtitle = _label("A private assistant that runs on this computer. Nothing you type leaves it.")
        v.addWidget(self.subtitle)
        v.addSpacing(18)
        self.pages = QStackedWidget()
        self.pages.addWidget(self._examples_page())
        self.loading = _label("Loading the model …")
        self.pages.addWidget(self.loading)
        self.pages.addWidget(self._no_model_page())
        v.addWidget(self.pages)
        v.addStretch(2)

    def _examples_page(self) -> QWidget:
        page = QWidget()
        grid = QGridLayout(page)
        grid.setSpacing(10)
        self.examples: list[QPushButton] = []
        for i, text in enumerate(EXAMPLES):
            button = QPushButton(text)
            button.setObjectName("example")
            button.setMinimumHeight(54)
            button.setToolTip("Send this to the assistant")
            button.clicked.connect(lambda _=False, t=text: self.prompt_chosen.emit(t))
            grid.addWidget(button, i // 2, i % 2)
            self.examples.append(button)
        return page

    def _no_model_page(self) -> QWidget:
        page = QWidget()
        v = QVBoxLayout(page)
        heading = _label("No model loaded", "welcomeTitle")
        v.addWidget(heading)
        self.reason = _label("")
        v.addWidget(self.reason)
        row = QHBoxLayout()
        row.addStretch(1)
        self.load_default_button = QPushButton("Load the default model")
        self.load_default_button.setObjectName("primary")
        self.load_default_button.clicked.connect(self.load_default)
        self.choose_file_button = QPushButton("Choose a model file…")
        self.choose_file_button.clicked.connect(self.choose_file)
        row.addWidget(self.load_default_button)
        row.addWidget(self.choose_file_button)
        row.addStretch(1)
        v.addLayout(row)
        return page

    @property
    def state(self) -> str:
        """"ready", "loading" or "no_model": which page shows."""
        return ("ready", "loading", "no_model")[self.pages.currentIndex()]

    def show_ready(self) -> None:
        self.pages.setCurrentIndex(0)

    def show_loading(self, text: str) -> None:
        self.loading.setText(text)
        self.pages.setCurrentIndex(1)

    def show_no_model(self, reason: str) -> None:
        self.reason.setText(reason)
        self.pages.setCurrentIndex(2)
