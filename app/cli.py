"""``specmemo-chat`` / ``python -m app``: start the window, or run ``--self-test`` without one."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specmemo-chat", description="SpecMemo Chat: offline desktop chat")
    p.add_argument("--self-test", action="store_true",
                   help="load the model, plan, generate 16 tokens with speculation, print one line, exit")
    p.add_argument("--model", default=None, help="'default', a .gguf file or a model folder (overrides settings)")
    p.add_argument("--history", default=None, help="chat history file (default: in the user data folder)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the model (default: the cores not busy now)")
    p.add_argument("--screenshot", default=None, metavar="PNG",
                   help="save the window to PNG once the model is loaded (at most 300 s), then quit: installer checks")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from specmemo_core.errors import SpecMemoError
    from specmemo_core.storage.data_folder import data_dir

    from specmemo_core.planning.threads import apply_threads

    apply_threads(args.threads or 0)  # before any model loads: the cores free now, or --threads
    folder = data_dir()
    if args.self_test:
        from .self_test import run_self_test

        try:
            print(run_self_test(folder, args.model or "default"), flush=True)
        except Exception as exc:  # noqa: BLE001 - any failure is the self-test's answer
            print(f"self-test FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    return run_app(folder, args, SpecMemoError)


def run_app(folder: Path, args: argparse.Namespace, error_type: type) -> int:
    from PySide6.QtWidgets import QApplication, QMessageBox

    from specmemo_core.storage.chatstore import ChatStore

    from .main_window import MainWindow
    from .settings import load_settings

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("SpecMemo Chat")
    app.setStyle("Fusion")  # NOTE: the one built-in style that draws the light and dark palettes alike everywhere
    try:
        store = ChatStore(Path(args.history) if args.history else None)
    except error_type as exc:
        QMessageBox.critical(None, "SpecMemo Chat", str(exc))
        return 2
    settings = load_settings(folder)
    if args.model:
        settings = settings.with_(model=args.model)
    window = MainWindow(store, settings, folder)
    if store.recovered_from is not None:
        window.say(f"The chat history was damaged; it was set aside as {store.recovered_from} and a new one "
                   "was started.", "warning")
    window.show()
    window.start()
    if args.screenshot:
        _screenshot_when_ready(app, window, Path(args.screenshot), timeout_s=300.0)
    code = app.exec()
    store.close()
    return code


def _screenshot_when_ready(app, window, path: Path, timeout_s: float) -> None:
    """Grab the window once its runtime is loaded (or the time is up), save it and quit."""
    import time

    from PySide6.QtCore import QTimer

    deadline = time.monotonic() + timeout_s
    timer = QTimer(window)

    def check() -> None:
        if window.runtime is None and time.monotonic() < deadline:
            return
        timer.stop()
        path.parent.mkdir(parents=True, exist_ok=True)
        window.grab().save(str(path))
        app.quit()

    timer.timeout.connect(check)
    timer.start(100)


if __name__ == "__main__":
    sys.exit(main())
