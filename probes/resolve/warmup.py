"""Warm forks: after a cell, its SM process imports the modules that cell imported lazily (and those
earlier runs learned), so later cells fork warm. A speed-up, never a change of state a cell could see."""
from __future__ import annotations

import importlib
import json
import os
import sys

IMPORTED_FILE = "imported-modules.json"


def _read_imported(out: str) -> list[str]:
    try:
        with open(os.path.join(out, IMPORTED_FILE), encoding="utf-8") as fh:
            return list(json.load(fh))
    except (OSError, ValueError):
        return []


def warm_up(modules, failures: list | None = None) -> tuple[int, int]:
    """Import, in this SM's process, modules a cell imported lazily, so later cells fork with them.

    Safe because import-time state in vLLM depends on the platform (the same SM here) and the
    environment, not on the VllmConfig (no vLLM module reads the current config at import time).
    A module that fails here is skipped; the cell that needs it imports it itself.
    """
    ok = failed = 0
    for name in modules:
        if name in sys.modules or name.startswith(("probes", "__main__", "__mp_main__")):
            continue
        try:
            importlib.import_module(name)
            ok += 1
        except Exception as exc:  # an optimisation must never break the run
            failed += 1
            if failures is not None:
                failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
    return ok, failed
