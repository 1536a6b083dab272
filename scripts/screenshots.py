"""Screenshots of SpecMemo Chat for the README: the main window mid-conversation (real model) and Settings.

    xvfb-run -a python scripts/screenshots.py [--out docs/screenshots]

Uses the real default model (SPECMEMO_DATA_DIR as usual) and a throw-away chat history.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = ("Write a Python function that checks whether a number is prime.",
             "Explain how it works in two sentences.")


def wait(app, condition, timeout: float = 300.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("the app did not get there in time")
        app.processEvents()
        time.sleep(0.02)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--reply-tokens", type=int, default=140)
    args = parser.parse_args()
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.settings import ChatSettings
    from specmemo_core.storage.chatstore import ChatStore
    from specmemo_core.storage.sources import data_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication(sys.argv[:1])
    app.setApplicationName("SpecMemo Chat")
    with tempfile.TemporaryDirectory() as tmp:
        store = ChatStore(Path(tmp) / "history.sqlite3")
        window = MainWindow(store, ChatSettings(max_reply_tokens=args.reply_tokens), data_dir())
        window.resize(1180, 780)
        window.show()
        window.start()
        wait(app, lambda: window.runtime is not None)
        for i, question in enumerate(QUESTIONS):
            before = len(window.view.entries)
            window.input.setPlainText(question)
            window.send()
            if i == len(QUESTIONS) - 1:  # catch the last reply while it streams
                wait(app, lambda: (len(window.view.entries) >= before + 2 and len(window.view.reply_text) > 60)
                     or not window.generating)
                window.view.render()
                app.processEvents()
                window.grab().save(str(out / "main_window.png"))
            wait(app, lambda: not window.generating)
        dialog = window.settings_dialog()
        dialog.show()
        app.processEvents()
        dialog.adjustSize()
        app.processEvents()
        dialog.grab().save(str(out / "settings.png"))
        dialog.close()
        window.close()
        store.close()
    print(f"saved {out / 'main_window.png'} and {out / 'settings.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
