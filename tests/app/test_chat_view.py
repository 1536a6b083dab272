"""The chat view: Markdown rendering, code blocks, streaming appends."""

from __future__ import annotations

from app.chat_view import CODE_BACKGROUND, ChatView, close_fences


def test_cut_off_code_fence_is_closed_for_display():
    assert close_fences("```python\ndef f():") == "```python\ndef f():\n```"
    assert close_fences("```\nx\n```\ntext") == "```\nx\n```\ntext"


def test_code_blocks_are_shaded_and_text_streams_in(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.set_messages([("user", "show code")])
    view.begin_reply()
    for piece in ("Here:\n\n", "```python\n", "print('hi')\n", "```\n", "Done **now**."):
        view.append_text(piece)
    view.render()
    assert view.reply_text.endswith("Done **now**.")
    text = view.toPlainText()
    assert "print('hi')" in text and "Done now." in text and "**" not in text  # Markdown, not raw
    block = view.document().begin()
    shaded = []
    while block.isValid():
        if block.blockFormat().background().color() == CODE_BACKGROUND:
            shaded.append(block.text())
        block = block.next()
    assert shaded == ["print('hi')"]
