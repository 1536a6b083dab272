"""Entry point of the frozen (PyInstaller) app: ``specmemo-chat`` = app.cli:main.

NOTE: in a bundle ``sys.executable`` is this program, not a Python. The GPU probe
(specmemo_core/planning/device.py) runs ``sys.executable -c CODE`` in a child process so a hung
driver cannot stall the app; this entry point answers that one form like Python would.
"""

import multiprocessing
import sys


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "-c":
        code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 - python -c semantics
        return 0
    from app.cli import main as app_main

    return app_main()


if __name__ == "__main__":
    multiprocessing.freeze_support()
    sys.exit(main())
