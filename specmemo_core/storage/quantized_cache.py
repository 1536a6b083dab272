"""Decoder weights kept at their planned precision (int8/int4) beside a model file's cache.

Why: quantizing is most of a large model's load. A Llama-3-8B-shaped Q4_0 file on a
2-core CPU (``docs/results/synthetic_8b_load_cpu.json``) loads into int4 in 93–163 s
(de-quantizing every tensor ~40 s, torchao's int4 quantization the rest), on every start
without this cache; with it, a later start takes 6.6 s. It keeps what the engine runs —
the quantized tensors torchao made, saved and read back with torch's own serialization
(``torch.load(weights_only=True)``, memory-mapped) — never a float copy: 5.23 GB for
that model in int4 on CPU.

A file is named by what decides its bytes (``key``: precision, group size, device type,
torch and torchao versions); any other file of the folder is left alone. A damaged file
is deleted and rebuilt by the next load.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

import torch

log = logging.getLogger(__name__)
PREFIX = "weights-"


def path_for(folder: Path, key: str) -> Path:
    return folder / f"{PREFIX}{key}.pt"


def read(folder: Path, key: str, device: torch.device) -> dict[str, torch.Tensor] | None:
    """The tensors saved under ``key``, mapped from the file (None: none saved, or damaged)."""
    path = path_for(folder, key)
    if not path.is_file():
        return None
    try:
        tensors = torch.load(path, map_location=device, mmap=device.type == "cpu", weights_only=True)
    except MemoryError:
        raise
    except Exception as exc:  # a cut or foreign file: rebuilt by this load
        log.warning("ignoring damaged quantized weights %s (%s)", path, exc)
        path.unlink(missing_ok=True)
        return None
    return tensors if isinstance(tensors, dict) else None


def write(folder: Path, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Save ``tensors`` under ``key``: written beside, then renamed in, so a reader never
    sees half a file. A full disk only costs the next start its speed."""
    path = path_for(folder, key)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(dict(tensors), tmp)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the quantized weights in %s (%s); the next start quantizes again", path, exc)
        tmp.unlink(missing_ok=True)
