"""The core never imports Qt: the GUI wraps the core, not the other way round."""

import pkgutil
import subprocess
import sys

import specmemo_core


def test_no_core_module_imports_qt():
    names = [m.name for m in pkgutil.walk_packages(specmemo_core.__path__, "specmemo_core.")]
    code = ("import importlib, sys\n"
            f"for n in {names!r}: importlib.import_module(n)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'app')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
