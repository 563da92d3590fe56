"""Evidence cached by content: a repeated audit with unchanged inputs reuses each cell's evidence.

A cell's evidence is a function of its inputs alone: the pinned build (wheel hash, the environment built
from it and verified, the stub libcuda), the probes' code, the cell's plan (system, layout, ``vllm
serve`` arguments, targets, stops), the model config it builds and the environment the agent is given.
The key is the sha256 of all of that, so any change of input invalidates exactly the cells it touches;
nothing that only shapes the report (expectations, templates, verdicts) is part of it, so editing
expectations never re-runs probes.

Layout: ``<cache>/evidence-cache/<key>/`` holds the cell's evidence directory as the run left it and
``entry.json`` (the run it came from, its date, the inputs, and the sha256 of every file beside it). Entries
are written to a sibling first and renamed into place, so a reader never sees half an entry.

An entry is **sealed** like a content-addressed store: before it is reused, the entry directory must be a
real directory holding exactly the files ``entry.json`` names (regular files, no links, nothing extra), each
with the digest recorded when it was written, and its evidence must be that cell's, model's, pin's and wheel's
(what the run's evidence identity check would demand later). Anything else (an edited,
truncated, planted, swapped or linked entry; a FIFO) is a miss: the entry is taken out of the cache, the cell
runs again and its fresh evidence replaces the entry. Nothing damaged is ever reused, and nothing needs a
manual delete. ``--no-cache`` runs every cell and refreshes the entries it ran.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from audit.fsutil import sha256_file

CACHE_SCHEMA = 2
ENTRY = "entry.json"
#: plan fields that change what a cell records (parallelism and warm-up lists only change speed)
PLAN_FIELDS = ("probes", "extra_targets", "model_probes", "stop_after", "serve_args", "slice", "observe_install", "harness_env",
               "redact_env", "postload_every_layer", "draft_weights", "pin")
#: files of a cell's evidence directory worth keeping
KEEP = ("evidence-", "agent.log", "imported-modules.json")


def cache_dir(root: Path) -> Path:
    """``<cache>/evidence-cache``, or ``$SERVING_TRUTH_EVIDENCE_CACHE`` (tests keep theirs apart)."""
    return Path(os.environ.get("SERVING_TRUTH_EVIDENCE_CACHE") or Path(root) / "evidence-cache")


def probes_digest() -> str:
    """sha256 over the probes package's sources (what runs inside the serving process)."""
    from audit.evidence.sources import probe_sources

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


def _regular(path: Path) -> bool:
    """A regular file, not a link, FIFO or device (lstat: a link is never followed)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def check(root: Path, key: str, cell: tuple[str, str] | None = None, model: str = "",
          expect: dict | None = None) -> tuple[dict | None, str]:
    """``(entry, "")`` for a sound entry of *key*; ``(None, "")`` when there is none; ``(None, why)`` when one is
    there but cannot be trusted (the seal is broken, or its evidence is of another cell, another *model*, or says
    other header fields than *expect* holds: the pin by name, the wheel's sha256).

    An entry another audit replaces while this one reads it (:func:`store` renames the old one aside and the new
    one in) can look torn for a moment; a torn reading is taken once more before the entry is judged damaged."""
    entry, why = _check_once(root, key, cell, model, expect or {})
    if why:
        entry, why = _check_once(root, key, cell, model, expect or {})
    return entry, why


def _header_mismatch(name: str, header: dict, cell, model: str, expect: dict) -> str:
    got = header.get("cell") or {}
    if cell is not None and (got.get("system"), got.get("layout")) != tuple(cell):
        return f"{name} is the evidence of {got.get('system')}/{got.get('layout')}, not {cell[0]}/{cell[1]}"
    if model and header.get("model") != model:
        return f"{name} is the evidence of the model {header.get('model')!r}, not {model}"
    for field, want in sorted(expect.items()):
        if want and header.get(field) != want:
            return f"{name} says {field} {str(header.get(field))[:24]!r}, this audit's is {str(want)[:24]!r}"
    return ""


def _check_once(root: Path, key: str, cell, model: str, expect: dict) -> tuple[dict | None, str]:
    d = cache_dir(root) / key
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"the entry cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return None, "the entry is not a directory (a link or another kind of file)"
    if not _regular(d / ENTRY):
        return None, f"{ENTRY} is missing or not a regular file"
    try:
        entry = json.loads((d / ENTRY).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None, f"{ENTRY} is not readable JSON"
    files = entry.get("files") if isinstance(entry, dict) else None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(files, dict):
        return None, f"{ENTRY} is not this key's (or was written without a seal)"
    try:
        present = {p.name for p in d.iterdir()} - {ENTRY}
    except OSError as exc:
        return None, f"the entry cannot be listed ({exc.strerror})"
    if present != set(files):
        extra, lost = sorted(present - set(files)), sorted(set(files) - present)
        return None, "files differ from the seal: " + "; ".join(
            x for x in (f"extra {', '.join(extra)}" if extra else "", f"missing {', '.join(lost)}" if lost else "") if x)
    if not any(name.startswith("evidence-") for name in files):
        return None, "the entry holds no evidence file"
    for name, digest in sorted(files.items()):
        if not _regular(d / name):
            return None, f"{name} is not a regular file"
        if sha256_file(d / name) != digest:
            return None, f"{name} does not match its recorded sha256"
    if cell is not None or model or expect:
        for name in sorted(files):
            if name.startswith("evidence-"):
                try:
                    with open(d / name, encoding="utf-8") as fh:
                        header = json.loads(fh.readline())
                except (OSError, ValueError):
                    return None, f"{name} has no readable header"
                if not isinstance(header, dict):
                    return None, f"{name} has no readable header"
                mismatch = _header_mismatch(name, header, cell, model, expect)
                if mismatch:
                    return None, mismatch
    return entry, ""


def lookup(root: Path, key: str, cell: tuple[str, str] | None = None, model: str = "",
           expect: dict | None = None) -> dict | None:
    """The sound entry for *key*, or None (a damaged one is discarded: :func:`discard`)."""
    entry, why = check(root, key, cell, model, expect)
    if why:
        discard(root, key)
    return entry


def discard(root: Path, key: str) -> None:
    """Take an entry out of the cache: renamed aside in one step (so no reader sees it again), then removed."""
    d = cache_dir(root) / key
    aside = d.with_name(f".discarded-{key[:16]}-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        os.rename(d, aside)
    except OSError:
        return
    if os.path.islink(aside) or not aside.is_dir():
        try:
            os.unlink(aside)
        except OSError:
            pass
    else:
        shutil.rmtree(aside, ignore_errors=True)


def restore(root: Path, key: str, dest: Path, entry: dict) -> None:
    """Copy a checked entry's evidence into *dest* (a cell directory of the new run): only the sealed files."""
    src = cache_dir(root) / key
    dest.mkdir(parents=True, exist_ok=True)
    for name in sorted(entry["files"]):
        shutil.copyfile(src / name, dest / name, follow_symlinks=False)


def has_harness_fault(path: Path) -> bool:
    """Whether an evidence file records a harness fault (a record of kind ``harness_fault``)."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if '"harness_fault"' in line and json.loads(line).get("kind") == "harness_fault":
                    return True
    except (OSError, ValueError):
        return True  # unreadable: not kept
    return False


def store(root: Path, key: str, cell_dir: Path, *, run: str, date: str, inputs: dict, info: dict) -> bool:
    """Keep a finished cell's evidence under *key*, sealed, replacing any entry there; False when there is
    nothing to keep or no room."""
    files = [p for p in sorted(Path(cell_dir).iterdir()) if _regular(p) and p.name.startswith(KEEP)]
    if not any(p.name.startswith("evidence-") for p in files):
        return False
    if any(has_harness_fault(p) for p in files if p.name.startswith("evidence-")):
        return False  # a cell the harness's own code broke is never served again
    base = cache_dir(root)
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}.", dir=base))
        try:
            for p in files:
                shutil.copyfile(p, tmp / p.name)
            seal = {p.name: sha256_file(tmp / p.name) for p in files}
            (tmp / ENTRY).write_text(json.dumps({"key": key, "run": run, "date": date, "inputs": inputs, "info": info,
                                                 "files": seal}, indent=1, sort_keys=True), encoding="utf-8")
            if os.path.lexists(base / key):
                discard(root, key)  # an older or damaged entry: this run's evidence replaces it
            try:
                os.rename(tmp, base / key)
            except OSError:  # another audit stored the same key meanwhile: theirs is as good
                shutil.rmtree(tmp, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError:
        return False  # a cache that cannot be written only costs speed
    return True


__all__ = ["cell_key", "check", "dir_digest", "discard", "lookup", "probes_digest", "restore", "store"]
