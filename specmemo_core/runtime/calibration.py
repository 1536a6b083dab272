"""Reading heads' calibration: measured path acceptance, and the trees built from it.

``tools/train/calibrate.py`` measures and writes ``calibration.json`` beside the heads;
the runtime and the planner only read it, through this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specmemo_core.runtime.tree import Tree

CALIBRATION_NAME = "calibration.json"


def expected_accepted(tree: Tree, rates: dict[tuple[int, ...], float]) -> float:
    """Expected tokens per verify step: the bonus token plus each node's acceptance rate."""
    return 1.0 + sum(rates.get(p, 0.0) for p in tree.paths)


def tree_from_calibration(record: dict[str, Any], nodes: int, max_depth: int | None = None) -> Tree:
    """The tree of ``nodes`` nodes (root included) with the highest expected acceptance."""
    chosen: list[tuple[int, ...]] = []
    have = set()
    for path, _rate in record["paths"]:
        p = tuple(path)
        if len(chosen) >= nodes - 1:
            break
        if max_depth is not None and len(p) > max_depth:
            continue
        if len(p) > 1 and p[:-1] not in have:  # only possible on exact ties; keep it a tree
            continue
        chosen.append(p)
        have.add(p)
    return Tree.from_paths(chosen, name=f"calibrated-{len(chosen) + 1}")


def load_calibration(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / CALIBRATION_NAME
    return json.loads(path.read_text()) if path.exists() else None


def rates_of(record: dict[str, Any]) -> dict[tuple[int, ...], float]:
    """The record's acceptance rate of every path."""
    return {tuple(p): r for p, r in record["paths"]}
