"""Functions too long or with too many positional parameters: the code-shape rule of specmemo_core.

No function over ``MAX_LINES`` lines, none with more than ``MAX_POSITIONAL`` positional
parameters (``self``/``cls`` not counted): past a few, parameters are keyword-only (``*``).
A Triton kernel (``@triton.jit``) is held to the line limit only: Triton passes a kernel its
pointers, sizes and strides positionally, and keyword-only parameters are not its language.
Usage: ``python scripts/check_code_shape.py [DIR ...]`` (default ``specmemo_core``); prints one
line per offender and exits 1 if there is any. ``tests/core/test_code_shape.py`` runs the same walk.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_LINES = 60
MAX_POSITIONAL = 6


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated ``@triton.jit`` (or ``@triton.jit(...)``)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def offenders(root: Path) -> list[str]:
    """``path:line name lines=N positional=P`` for each function of ``root``'s .py files over a limit."""
    found = []
    for path in sorted(Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                positional = [a for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                too_wide = len(positional) > MAX_POSITIONAL and not _is_triton_kernel(node)
                if lines > MAX_LINES or too_wide:
                    found.append(f"{path}:{node.lineno} {node.name} lines={lines} positional={len(positional)}")
    return found


def main(argv: list[str]) -> int:
    found = [line for root in (argv or ["specmemo_core"]) for line in offenders(Path(root))]
    print("\n".join(found) if found else "no offenders")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
