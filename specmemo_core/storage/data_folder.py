"""The per-user data folder (models, data sets, chat history, caches): no torch needed to find it."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """Per-user data folder; SPECMEMO_DATA_DIR overrides it so tests stay isolated."""
    override = os.environ.get("SPECMEMO_DATA_DIR")
    if override:
        return Path(override).expanduser()
    import platformdirs

    return platformdirs.user_data_path("specmemo")
