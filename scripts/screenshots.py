"""Screenshots of SpecMemo Chat for the README, light and dark: the welcome state, the main window
mid-conversation (real model), the settings panel and the Speed up this model dialog with its estimate.

    SPECMEMO_DATA_DIR=... xvfb-run -a python scripts/screenshots.py [--out docs/screenshots] [--only speed_up]

Uses the real default model (SPECMEMO_DATA_DIR as usual) and a throw-away chat history; the saved
theme in the data folder is left as it was. Writes welcome.png, main_window.png, main_window_dark.png,
settings.png, settings_dark.png and speed_up.png (light; the estimate times the default model on this
device, up to a minute or two on a CPU; nothing is trained). ``--only speed_up`` writes speed_up.png alone.
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


def settle(app, seconds: float = 0.3) -> None:
    """Let pending renders and re-polishing run before a grab."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents()
        time.sleep(0.02)


def converse(app, window, out: Path) -> None:
    """Ask QUESTIONS; grab the window while the last reply streams (main_window.png)."""
    for i, question in enumerate(QUESTIONS):
        before = len(window.view.entries)
        window.input.setPlainText(question)
        window.send()
        if i == len(QUESTIONS) - 1:  # catch the last reply while it streams
            wait(app, lambda: (len(window.view.entries) >= before + 2 and len(window.view.reply_text) > 60)
                 or not window.generating)
            window.view.render()
            settle(app, 0.1)
            window.grab().save(str(out / "main_window.png"))
        wait(app, lambda: not window.generating)


def grab_settings(app, window, path: Path) -> None:
    dialog = window.settings_dialog()
    dialog.show()
    settle(app)
    dialog.adjustSize()
    settle(app)
    dialog.grab().save(str(path))
    dialog.close()


def grab_speed_up(app, window, path: Path) -> None:
    """Model ▸ Speed up this model… once its estimate is shown."""
    from app.heads_training import job_for_runtime

    dialog = window.open_speed_up(job_for_runtime(window.runtime, window.data_folder),
                                  model_name=window.runtime.backend.name)
    wait(app, lambda: dialog.state in ("ready", "failed"))
    if dialog.state == "failed":
        raise RuntimeError(f"the estimate failed: {dialog.message.text()}")
    settle(app)
    dialog.adjustSize()
    settle(app)
    dialog.grab().save(str(path))
    dialog.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--reply-tokens", type=int, default=140)
    parser.add_argument("--only", choices=["speed_up"], help="write only this screenshot")
    args = parser.parse_args()
    from PySide6.QtWidgets import QApplication

    from app.main_window import MainWindow
    from app.settings import ChatSettings, load_settings, save_settings
    from specmemo_core.storage.chatstore import ChatStore
    from specmemo_core.storage.data_folder import data_dir

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    app = QApplication(sys.argv[:1])
    app.setApplicationName("SpecMemo Chat")
    app.setStyle("Fusion")
    saved = load_settings(data_dir())
    with tempfile.TemporaryDirectory() as tmp:
        store = ChatStore(Path(tmp) / "history.sqlite3")
        window = MainWindow(store, ChatSettings(max_reply_tokens=args.reply_tokens, theme="light"), data_dir())
        window.resize(1180, 780)
        window.show()
        window.start()
        wait(app, lambda: window.runtime is not None)
        settle(app)
        names = ["speed_up"]
        if args.only is None:
            window.grab().save(str(out / "welcome.png"))
            converse(app, window, out)
            grab_settings(app, window, out / "settings.png")
        grab_speed_up(app, window, out / "speed_up.png")
        if args.only is None:
            window.set_theme("dark")
            settle(app)
            window.grab().save(str(out / "main_window_dark.png"))
            grab_settings(app, window, out / "settings_dark.png")
            names = ["welcome", "main_window", "main_window_dark", "settings", "settings_dark", "speed_up"]
        window.close()
        store.close()
    save_settings(data_dir(), saved)  # the screenshots' theme and reply length are not the user's
    print(f"saved {', '.join(f'{n}.png' for n in names)} in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
