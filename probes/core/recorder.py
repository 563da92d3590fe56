"""Per-process evidence: one versioned JSON Lines file per process, combined on the host.

The first record of every file is a header carrying the schema version and what the evidence is of (the
pin, the wheel's sha256, the cell); the host refuses files whose version it does not know and checks the rest
against the run and the lock. Every write ends with a closing record: how many records precede it, the
sha256 of their lines, and whether it was the process's last write; evidence cut short (no closing record),
changed after it was written (the count or the digest disagree) or left by a process that never made its last
write is told from evidence that is whole. Records are buffered in memory and
written at flush/exit, so recording a selection costs a list append.
"""
from __future__ import annotations

import atexit
import enum
import hashlib
import json
import os
import secrets
import socket
import sys
import threading
from contextvars import ContextVar

from probes import EVIDENCE_SCHEMA

#: the model-layer prefix currently under construction (pushed by scope probes)
current_scope: ContextVar[tuple[str, ...]] = ContextVar("serving_truth_scope", default=())


def describe(value, _depth: int = 0):
    """A stable, JSON-able description of a selector's argument or result.

    Enum members become ``Class.MEMBER``, classes ``module:qualname``; objects their class. Never
    raises and never calls user ``__repr__`` (which could touch devices).
    """
    try:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, enum.Enum):
            return f"{type(value).__name__}.{value.name}"
        if isinstance(value, type):
            return f"{value.__module__}:{value.__qualname__}"
        if _depth < 6 and isinstance(value, (list, tuple)):
            return [describe(v, _depth + 1) for v in value]
        if _depth < 6 and isinstance(value, dict):
            return {str(k): describe(v, _depth + 1) for k, v in value.items()}
        if callable(value) and hasattr(value, "__qualname__"):
            return f"{getattr(value, '__module__', '?')}:{value.__qualname__}"
        cls = type(value)
        return f"<{cls.__module__}:{cls.__qualname__}>"
    except Exception:  # pragma: no cover - describing must never fail
        return "<undescribable>"


def closing(lines: list[str], final: bool) -> dict:
    """The closing record of a file whose lines (header first) are ``lines``."""
    digest = hashlib.sha256(("\n".join(lines) + "\n").encode("utf-8")).hexdigest()
    return {"kind": "end", "records": len(lines) - 1, "sha256": digest, "final": bool(final)}


class Recorder:
    """Collects evidence records of one process and writes them as one JSON Lines file."""

    def __init__(self, out_dir: str | None, *, role: str = "process", meta: dict | None = None):
        self.out_dir = out_dir
        self.role = role
        self._records: list[dict] = []
        self._lock = threading.Lock()
        self._seq = 0
        self.path: str | None = None
        self._header = {
            "kind": "header",
            "schema": EVIDENCE_SCHEMA,
            "role": role,
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            **(meta or {}),
        }
        if out_dir:
            atexit.register(self.flush, final=True)

    def retarget(self, out_dir: str, **meta) -> None:
        """Send this (possibly forked) recorder's records to a new file, with more header fields."""
        with self._lock:
            if not self.out_dir:
                atexit.register(self.flush, final=True)
            self.out_dir = out_dir
            self.path = None
            self._header = {**self._header, **meta, "pid": os.getpid()}

    def forked(self) -> None:
        """In a forked child: a new file for this process, none of the parent's records."""
        self._lock = threading.Lock()  # the parent's lock may have been held by another thread
        self._records = []
        self._seq = 0
        self.path = None
        self._header = {**self._header, "pid": os.getpid(), "parent_pid": self._header.get("pid")}

    def drop(self, *kinds: str) -> None:
        """Forget the records of these kinds (a snapshot about to be re-emitted replaces them). The records kept are
        numbered again, in their order, so the file stays numbered 1, 2, ... as the evidence schema requires."""
        with self._lock:
            kept = [r for r in self._records if r.get("kind") not in kinds]
            self._records = [{**r, "seq": i} for i, r in enumerate(kept, 1)]
            self._seq = len(self._records)

    def update_header(self, **fields) -> None:
        with self._lock:
            self._header.update(fields)

    def emit(self, kind: str, **fields) -> None:
        with self._lock:
            self._seq += 1
            self._records.append({"kind": kind, "seq": self._seq, **fields})

    def about(self, model: str):
        """A context in which every record emitted says it is about *model* (``role``: a speculative draft, beside
        the target that records name none), unless it names one itself. Applied when the context ends, so the hot
        path pays nothing."""
        return _About(self, model)

    def records(self) -> list[dict]:
        with self._lock:
            return [self._header, *self._records]

    def flush(self, final: bool = False) -> str | None:
        """Write everything recorded so far (rewrites the process's file atomically), ending with the closing
        record. ``final``: the process's last write (a periodic flush of a running process is not)."""
        if not self.out_dir:
            return None
        with self._lock:
            if self.path is None:
                host = socket.gethostname().split(".")[0] or "host"
                name = f"evidence-{host}-{os.getpid()}-{secrets.token_hex(3)}.jsonl"
                self.path = os.path.join(self.out_dir, name)
            lines = [json.dumps(r, sort_keys=True, default=str) for r in (self._header, *self._records)]
            lines.append(json.dumps(closing(lines, final), sort_keys=True))
            os.makedirs(self.out_dir, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write("\n".join(lines) + "\n")
            os.replace(tmp, self.path)
            return self.path


class _About:
    """``Recorder.about``: remembers where the records stood, and tags the ones emitted since when it ends."""

    def __init__(self, rec: "Recorder", model: str):
        self.rec, self.model, self.start = rec, model, 0

    def __enter__(self):
        with self.rec._lock:
            self.start = self.rec._seq
        return self

    def __exit__(self, *exc) -> bool:
        with self.rec._lock:
            for r in self.rec._records:
                if r["seq"] > self.start:
                    r.setdefault("role", self.model)
        return False
