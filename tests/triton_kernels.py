"""What the tests of our Triton kernels share: they run on the GPU where there is one, else in
Triton's interpreter on the CPU, in a process of their own (Triton reads ``TRITON_INTERPRET`` as
it is imported, and the rest of the suite must run without it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_HERE = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
# a test that runs the kernels: here on a GPU or in the interpreter's process, else skipped
kernels = pytest.mark.skipif(not RUNS_HERE, reason="on a CPU: in the interpreter (test_in_tritons_interpreter)")
# the test that starts that process, and the ones about a machine where the kernels cannot run
elsewhere = pytest.mark.skipif(RUNS_HERE, reason="the kernels run in this process")


def run_in_interpreter(test_file: str, *, passed: int) -> None:
    """Run ``test_file``'s kernel tests in Triton's interpreter; all ``passed`` of them must pass."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
                          "-k", "not interpreter"], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert f"{passed} passed" in run.stdout


def assert_probe_falls_back(probe, caplog, *, says: tuple[str, ...]) -> None:
    """On a machine where Triton cannot launch (here: no GPU driver) ``probe`` logs why, with
    every phrase of ``says``, and answers False, so the step keeps its torch path."""
    with caplog.at_level("WARNING", logger="specmemo_core.runtime.kernel_probe"):
        assert probe(torch.device(DEVICE), torch.float32) is False
    assert all(phrase in caplog.text for phrase in says), caplog.text


def compile_for_hopper(kernel, *, constexprs: dict, types: dict[str, str] | None = None, warps: int = 4,
                       stages: int = 5):
    """``kernel`` (a ``triton.jit`` function) built for an H100/H200 (sm_90) by Triton's own compiler and
    ptxas, no GPU needed: its parameters named in ``constexprs`` fixed, the others of the Triton types
    ``types`` gives (unnamed: ``*bf16`` pointers, i32 scalars). Catches code the interpreter runs but
    the GPU's compiler refuses. Skips where this Triton lacks the NVIDIA backend."""
    import inspect

    import triton
    from triton.backends import backends
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend to build for sm_90")

    names = list(inspect.signature(kernel.fn).parameters)
    signature = {name: "constexpr" if name in constexprs
                 else (types or {}).get(name, "*bf16" if name.endswith("_ptr") else "i32") for name in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
