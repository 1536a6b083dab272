"""The settings dialog: turns ↔ speed slider with a live plan and memory chart, reply and model options."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
    QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSlider, QSpinBox, QVBoxLayout, QWidget,
)

from specmemo_core.planning.planner import Plan

from .memory_chart import MemoryChart, gib
from .plan_text import layers_text, split_text, turns_text
from .planning import PlanInputs, make_plan
from .settings import PRECISION_CHOICES, ChatSettings, heads_path_problem, model_path_problem

AUTO = "auto (planner)"


def serve_url(port: int) -> str:
    """The base_url an OpenAI client uses for "Serve on localhost" on ``port``."""
    from specmemo_core.serving.server import DEFAULT_HOST, url_of

    return url_of(DEFAULT_HOST, port)


def describe_plan(plan: Plan, settings: ChatSettings, max_context: int) -> str:
    if not plan.fits:
        return "Does not fit: " + "; ".join(plan.suggestions)
    tree = (settings.tree or plan.tree) if settings.speculate else None
    speed = f"{plan.predicted_tokens_per_s:.1f} tokens/s predicted" if plan.predicted_tokens_per_s else \
        "speed not measured"
    mode = f"tree {tree} ({plan.tree_nodes} nodes)" if tree else "plain decoding"
    return (f"<b>{html.escape(turns_text(plan, settings.turns, max_context))}</b> ({plan.kv_tokens} tokens of "
            f"context) · {speed}<br>"
            f"{mode} · {plan.precision} · {gib(plan.total_bytes)} of {gib(plan.budget_bytes)} usable"
            + (f"<br>{html.escape(layers_text(plan))}" if plan.streamed_layers else "")
            + (f"<br>{html.escape(split_text(plan))}" if len(plan.split) > 1 else ""))


def _spin(spin: QSpinBox | QDoubleSpinBox, low: float, high: float, value: float,
          on_change) -> QSpinBox | QDoubleSpinBox:
    """``spin`` limited to [low, high], showing ``value``, calling ``on_change`` when it changes."""
    spin.setRange(low, high)
    spin.setValue(value)
    spin.valueChanged.connect(on_change)
    return spin


def _error_label() -> QLabel:
    """A red, wrapping label that says why a chosen path was refused."""
    label = QLabel()
    label.setWordWrap(True)
    label.setStyleSheet("color: palette(bright-text)")  # the theme's warning colour
    return label


class SettingsDialog(QDialog):
    """Edits a ChatSettings; ``inputs`` (None before a model is loaded) lets it re-plan live."""

    def __init__(self, settings: ChatSettings, inputs: PlanInputs | None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("SpecMemo Chat — Settings")
        self.setMinimumWidth(540)
        self.inputs = inputs
        self.original = settings
        self.plan: Plan | None = None
        layout = QVBoxLayout(self)
        layout.addWidget(self._plan_group(settings))
        layout.addWidget(self._reply_group(settings))
        layout.addWidget(self._model_group(settings))
        layout.addWidget(self._advanced_group(settings))
        layout.addWidget(self._server_group(settings))
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.replan()

    # -- groups ----------------------------------------------------------------
    def _plan_group(self, s: ChatSettings) -> QGroupBox:
        box = QGroupBox("Memory plan")
        v = QVBoxLayout(box)
        row = QHBoxLayout()
        row.addWidget(QLabel("More turns"))
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, 100)
        self.slider.setValue(round(s.prefer * 100))
        self.slider.valueChanged.connect(self.replan)
        row.addWidget(self.slider, 1)
        row.addWidget(QLabel("More speed"))
        v.addLayout(row)
        form = QFormLayout()
        self.turns = _spin(QSpinBox(), 1, 1000, s.turns, self.replan)
        form.addRow("Turns wanted", self.turns)
        v.addLayout(form)
        self.plan_label = QLabel()
        self.plan_label.setWordWrap(True)
        v.addWidget(self.plan_label)
        self.chart = MemoryChart()
        v.addWidget(self.chart)
        return box

    def _reply_group(self, s: ChatSettings) -> QGroupBox:
        box = QGroupBox("Replies")
        form = QFormLayout(box)
        # replans on a change: sampling keeps every node's distribution
        self.temperature = _spin(QDoubleSpinBox(), 0.0, 2.0, s.temperature, self.replan)
        self.temperature.setSingleStep(0.1)
        form.addRow("Temperature", self.temperature)
        self.max_reply = _spin(QSpinBox(), 1, 8192, s.max_reply_tokens, self.replan)
        form.addRow("Max reply length (tokens)", self.max_reply)
        self.system_prompt = QPlainTextEdit(s.system_prompt)
        self.system_prompt.setPlaceholderText("Optional: how the assistant should behave (applies to new chats)")
        self.system_prompt.setFixedHeight(60)
        form.addRow("System prompt", self.system_prompt)
        return box

    def _model_group(self, s: ChatSettings) -> QGroupBox:
        box = QGroupBox("Model")
        v = QVBoxLayout(box)
        row = QHBoxLayout()
        self.model = QLineEdit(s.model)
        self.model.setReadOnly(True)
        row.addWidget(self.model, 1)
        for text, slot in (("Default", lambda: self.choose_model("default")), ("GGUF file…", self._browse_file),
                           ("Folder…", self._browse_folder)):
            button = QPushButton(text)
            button.clicked.connect(slot)
            row.addWidget(button)
        v.addLayout(row)
        self.model_error = _error_label()
        v.addWidget(self.model_error)
        self.speculate = QCheckBox("Speculative decoding (draft heads and lookup, verified as a tree)")
        self.speculate.setChecked(s.speculate)
        self.speculate.toggled.connect(self.replan)
        v.addWidget(self.speculate)
        return box

    def _advanced_group(self, s: ChatSettings) -> QGroupBox:
        box = QGroupBox("Advanced overrides")
        form = QFormLayout(box)
        self.tree = QComboBox()
        self.tree.addItem(AUTO)
        for option in (self.inputs.trees if self.inputs else ()):
            self.tree.addItem(option.name)
        if s.tree and self.tree.findText(s.tree) < 0:
            self.tree.addItem(s.tree)
        self.tree.setCurrentText(s.tree or AUTO)
        self.tree.currentTextChanged.connect(self.replan)
        form.addRow("Tree", self.tree)
        row = QHBoxLayout()
        self.heads = QLineEdit(s.heads)
        self.heads.setToolTip("auto (the heads shipped for this model), none, or a heads folder")
        self.heads.editingFinished.connect(lambda: self.choose_heads(self.heads.text().strip() or "auto"))
        row.addWidget(self.heads, 1)
        browse = QPushButton("Folder…")
        browse.clicked.connect(self._browse_heads)
        row.addWidget(browse)
        form.addRow("Heads", row)
        self.heads_error = _error_label()
        form.addRow("", self.heads_error)
        self.precision = QComboBox()
        for p in PRECISION_CHOICES:
            self.precision.addItem(p or AUTO)
        self.precision.setCurrentText(s.precision or AUTO)
        self.precision.currentTextChanged.connect(self.replan)
        form.addRow("Precision", self.precision)
        return box

    def _server_group(self, s: ChatSettings) -> QGroupBox:
        box = QGroupBox("Local server (OpenAI API)")
        form = QFormLayout(box)
        self.serve = QCheckBox("Serve on localhost")
        self.serve.setToolTip("Other programs on this computer (editor plugins, scripts) can use the loaded model "
                              "through the OpenAI API; nothing is reachable from other computers.")
        self.serve.setChecked(s.serve_on_localhost)
        self.serve.toggled.connect(self._show_url)
        form.addRow(self.serve)
        self.serve_port = _spin(QSpinBox(), 1, 65535, s.serve_port, self._show_url)
        form.addRow("Port", self.serve_port)
        self.serve_url = QLabel()
        self.serve_url.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        form.addRow("URL", self.serve_url)
        self._show_url()
        return box

    def _show_url(self) -> None:
        on = self.serve.isChecked()
        self.serve_url.setText(serve_url(self.serve_port.value()) if on else "off")
        self.serve_port.setEnabled(on)

    # -- behaviour -------------------------------------------------------------
    def choose_model(self, path: str) -> bool:
        """Take ``path`` as the model if it can be one; else say why and keep the previous choice."""
        problem = model_path_problem(path)
        if problem:
            self.model_error.setText(problem + " The previous model stays.")
            return False
        self.model_error.clear()
        self.model.setText(path)
        return True

    def choose_heads(self, path: str) -> bool:
        """Take ``path`` as the heads if it can be; else say why and keep the previous choice."""
        problem = heads_path_problem(path)
        if problem:
            self.heads_error.setText(problem + f" Keeping {self.original.heads}.")
            self.heads.setText(self.original.heads)
            return False
        self.heads_error.clear()
        self.heads.setText(path)
        return True

    def _browse_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.choose_model(path)

    def _browse_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a Hugging Face model folder")
        if path:
            self.choose_model(path)

    def _browse_heads(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a heads folder")
        if path:
            self.choose_heads(path)

    def settings(self) -> ChatSettings:
        tree = self.tree.currentText()
        precision = self.precision.currentText()
        heads = self.heads.text().strip() or "auto"
        return self.original.with_(
            prefer=self.slider.value() / 100, turns=self.turns.value(), temperature=self.temperature.value(),
            max_reply_tokens=self.max_reply.value(), system_prompt=self.system_prompt.toPlainText().strip(),
            model=self.model.text(), speculate=self.speculate.isChecked(),
            tree=None if tree == AUTO else tree, heads=heads if heads_path_problem(heads) is None else
            self.original.heads, precision=None if precision == AUTO else precision,
            serve_on_localhost=self.serve.isChecked(), serve_port=self.serve_port.value())

    def replan(self) -> None:
        """Re-run the (pure, fast) planner for the settings on screen."""
        if self.inputs is None:
            self.plan = None
            self.plan_label.setText("Load a model to see the plan.")
            return
        settings = self.settings()
        self.plan = make_plan(self.inputs, settings)
        self.plan_label.setText(describe_plan(self.plan, settings, self.inputs.model.max_context))
        self.chart.set_plan(self.plan.predicted_bytes, self.plan.budget_bytes)
