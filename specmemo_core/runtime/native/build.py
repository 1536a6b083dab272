"""Compile ``forward.c`` once per machine, for the CPU it runs on (``-march=native``: AVX-512
VNNI where there is one, else AVX2 with or without AVX-VNNI, else plain C), into the user's
cache folder, keyed by the source's hash and the compiler's target, and load it with ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import platformdirs

from specmemo_core.errors import SpecMemoError

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("forward.c")
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE")


class NativeBuildError(SpecMemoError):
    """The native CPU forward could not be built here (no C compiler, or it failed)."""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def available() -> bool:
    """The forward builds (or is built already) for this CPU: a compiler that takes the
    flags (gcc or clang with OpenMP; Apple's clang has none) and the CPU's instructions."""
    try:
        library()
    except NativeBuildError as e:  # said where it is decided, so a user learns why a CPU chat runs slower
        log.warning("%s (4-bit GGUFs then run on llama.cpp or torch, 2-7x slower on a CPU)", e)
        return False
    return True


def _target(cc: str, march: str) -> str:
    """What ``-march=<march>`` means on this machine (so a cache shared between machines
    never loads another CPU's build)."""
    out = subprocess.run([cc, f"-march={march}", "-Q", "--help=target"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else os.uname().machine


@functools.cache
def library(march: str = "native") -> ctypes.CDLL:
    """The forward built for ``march`` (gcc's ``-march``: this CPU's own instructions by
    default; ``x86-64-v3`` for AVX2 alone, ``x86-64`` for plain C, as tests check them)."""
    cc = compiler()
    if cc is None:
        raise NativeBuildError("the native CPU forward needs a C compiler (apt install gcc); "
                               "or run with --backend llamacpp or --backend torch")
    flags = (*FLAGS, f"-march={march}")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + _target(cc, march).encode()).hexdigest()[:16]
    folder = Path(platformdirs.user_cache_dir("specmemo")) / "native"
    lib = folder / f"forward-{key}.so"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built = Path(tmp) / lib.name
            out = subprocess.run([cc, *flags, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
            if out.returncode != 0:
                raise NativeBuildError(f"building the native CPU forward failed ({cc}): {out.stderr.strip()[-800:]}; "
                                       "run with --backend llamacpp or --backend torch")
            os.replace(built, lib)  # atomic: a second process sees the whole file or none
    return ctypes.CDLL(str(lib))
