"""Evidence cached by content: a repeated audit with unchanged inputs reuses each cell's evidence.

A cell's evidence is a function of its inputs alone: the pinned build (wheel hash, the environment built
from it and verified, the stub libcuda), the probes' code, the cell's plan (system, layout, ``vllm
serve`` arguments, targets, stops), the model config it builds and the environment the agent is given.
The key is the sha256 of all of that, so any change of input invalidates exactly the cells it touches;
nothing that only shapes the report (expectations, templates, verdicts) is part of it, so editing
expectations never re-runs probes.

Layout: ``<cache>/evidence-cache/<key>/`` holds the cell's evidence directory as the run left it and
``entry.json`` (the run it came from, its date, the inputs). Entries are written to a sibling first and
renamed into place, so a reader never sees half an entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CACHE_SCHEMA = 1
ENTRY = "entry.json"
#: plan fields that change what a cell records (parallelism and warm-up lists only change speed)
PLAN_FIELDS = ("probes", "extra_targets", "stop_after", "serve_args", "slice", "observe_install", "harness_env",
               "redact_env")
#: files of a cell's evidence directory worth keeping
KEEP = ("evidence-", "agent.log", "imported-modules.json")


def cache_dir(root: Path) -> Path:
    """``<cache>/evidence-cache``, or ``$SERVING_TRUTH_EVIDENCE_CACHE`` (tests keep theirs apart)."""
    return Path(os.environ.get("SERVING_TRUTH_EVIDENCE_CACHE") or Path(root) / "evidence-cache")


def probes_digest() -> str:
    """sha256 over the probes package's sources (what runs inside the serving process)."""
    from .runtimes.base import probe_sources

    h = hashlib.sha256()
    for rel, data in probe_sources():
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def dir_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cell_key(identity: dict, plan: dict, cell: dict, model_digest: str, probes: str) -> tuple[str, dict]:
    """The cache key of one cell and the inputs it was computed from."""
    inputs = {
        "schema": CACHE_SCHEMA,
        "environment": identity,
        "probes": probes,
        "plan": {k: plan.get(k) for k in PLAN_FIELDS},
        "system": cell["system"],
        "layout": cell["layout"],
        "model": model_digest,
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest(), inputs


def lookup(root: Path, key: str) -> dict | None:
    """The entry for *key*, or None (also for a damaged entry, which is then ignored)."""
    d = cache_dir(root) / key
    try:
        entry = json.loads((d / ENTRY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not any(d.glob("evidence-*.jsonl")):
        return None
    return entry


def restore(root: Path, key: str, dest: Path) -> None:
    """Copy a cached cell's evidence into *dest* (a cell directory of the new run)."""
    src = cache_dir(root) / key
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name.startswith(KEEP):
            shutil.copy2(p, dest / p.name)


def store(root: Path, key: str, cell_dir: Path, *, run: str, date: str, inputs: dict, info: dict) -> bool:
    """Keep a finished cell's evidence under *key*; False when there is nothing to keep or no room."""
    files = [p for p in sorted(Path(cell_dir).iterdir()) if p.is_file() and p.name.startswith(KEEP)]
    if not any(p.name.startswith("evidence-") for p in files):
        return False
    base = cache_dir(root)
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", dir=base))
        try:
            for p in files:
                shutil.copy2(p, tmp / p.name)
            (tmp / ENTRY).write_text(json.dumps({"key": key, "run": run, "date": date, "inputs": inputs, "info": info},
                                                indent=1, sort_keys=True), encoding="utf-8")
            try:
                os.rename(tmp, base / key)
            except OSError:  # another audit stored the same key first: theirs is as good
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError:
        return False  # a cache that cannot be written only costs speed
    return True


__all__ = ["cell_key", "dir_digest", "lookup", "probes_digest", "restore", "store"]
