"""No function in specmemo_core over 60 lines or with more than 6 positional parameters."""

import importlib.util
from pathlib import Path

import specmemo_core

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_code_shape.py"


def _checker():
    spec = importlib.util.spec_from_file_location("check_code_shape", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_function_in_core_is_too_long_or_takes_too_many_positional_parameters():
    assert _checker().offenders(Path(specmemo_core.__file__).parent) == []


def test_the_checker_names_each_kind_of_offender(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "m.py").write_text(
        "def ok(a, b, c, d, e, f, *, g, h):\n    return a\n\n"
        "class K:\n    def wide(self, a, b, c, d, e, f, g):\n        return a\n\n"
        f"def long():\n{body}\n\n"
        "@triton.jit\ndef kernel(a, b, c, d, e, f, g, h):\n    pass\n\n"
        f"@triton.jit\ndef long_kernel():\n{body}\n")
    found = _checker().offenders(tmp_path)
    assert sorted(line.split(" ", 1)[1] for line in found) == ["long lines=61 positional=0", "long_kernel lines=61 positional=0",
                                                                      "wide lines=2 positional=7"]
