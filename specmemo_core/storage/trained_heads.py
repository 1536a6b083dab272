"""Where draft heads trained on this computer live: ``<data folder>/heads/<model>-<fingerprint>/``.

Beside the model caches, one folder per model (its name and weight fingerprint), filled by
``tools/train/speed_up.py`` (the app's "Speed up this model", ``specmemo speed-up``). The
card is written last, so a folder without one is a run still going or stopped half-way.
"""

from __future__ import annotations

import re
from pathlib import Path

CARD_FILE = "card.json"
HEADS_FILE = "heads.safetensors"


def trained_heads_dir(data_folder: Path, name: str, fingerprint: str) -> Path:
    """The folder for heads of the model (name, fingerprint) trained here."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"
    return Path(data_folder) / "heads" / f"{safe}-{fingerprint}"


def finished(folder: Path) -> bool:
    """Heads trained and calibrated to the end (the card is written last)."""
    return (folder / CARD_FILE).exists() and (folder / HEADS_FILE).exists()
