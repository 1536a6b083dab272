"""The chat view: Markdown rendering, code blocks, streaming appends."""

from __future__ import annotations

from app.chat_view import ChatView, bubble_colour, close_fences, code_background


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
        if block.blockFormat().background().color() == code_background(view.palette()):
            shaded.append(block.text())
        block = block.next()
    assert shaded == ["print('hi')"]


def frames_by_text(view: ChatView) -> dict[str, object]:
    """Each turn's frame format, keyed by the turn's text (title line excluded)."""
    out = {}
    for frame in view.document().rootFrame().childFrames():
        cursor = frame.firstCursorPosition()
        cursor.setPosition(frame.lastPosition(), cursor.MoveMode.KeepAnchor)
        out[cursor.selectedText().split("\u2029", 1)[-1]] = frame.frameFormat()
    return out


def test_turns_are_set_off_yours_right_and_tinted(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(800, 600)
    view.set_messages([("user", "a question"), ("assistant", "an answer")])
    frames = frames_by_text(view)
    user, reply = frames["a question"], frames["an answer"]
    assert user.leftMargin() > 100 and user.rightMargin() == 0  # pushed to the right
    assert reply.rightMargin() > 100 and reply.leftMargin() == 0  # kept on the left
    assert user.background().color() == bubble_colour(view.palette(), user=True)
    assert reply.background().color() == bubble_colour(view.palette(), user=False)
    assert user.background().color() != reply.background().color() != view.palette().base().color()
