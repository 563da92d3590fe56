"""The wheels a pin names, kept under the audit cache: found by their bytes, never by their name alone.

A wheel from PyPI is kept under its file name (``wheels/<name>``); one from a URL, whose name need not be
unique, under its sha256 (``wheels/sha256/<sha256>/<name>``). :meth:`WheelCache.find` answers only with a
file whose sha256 is the pinned one; hashes are remembered per file stat (``fsutil.memo_hash``) so a cached
9 GB environment's wheel is not re-read on every audit. ``lock add`` stores what it downloaded here, and
the local runtime finds it here: both depend on this module, not on each other."""
from __future__ import annotations

import os
from pathlib import Path

from audit.fsutil import load_memo, memo_hash, save_memo, sha256_file
from audit.errors import UnsafeLockPath
from audit.pins.lock import Pin, contained, unsafe_path_field


class WheelCache:
    def __init__(self, root: Path):
        self.root = root
        self.dir = root / "wheels"
        #: downloads land here before their bytes are checked
        self.incoming = self.dir / "incoming"
        #: remember hashes per file stat (False: hash every file, as ``--no-cache`` asks)
        self.stat_memo = True

    def locations(self, pin: Pin) -> list[Path]:
        """Where a wheel with the pinned bytes may be: by file name (PyPI downloads), then by sha256."""
        bad = unsafe_path_field(pin)
        if bad:
            raise UnsafeLockPath(pin=pin.name, field=bad[0], value=bad[1], root=str(self.root))
        by_sha = self.dir / "sha256" / pin.wheel_sha256
        return [contained(self.dir / pin.wheel, self.dir, pin, "wheel", pin.wheel),
                contained(by_sha / pin.wheel, by_sha, pin, "wheel", pin.wheel)]

    def find(self, pin: Pin) -> Path | None:
        """A cached file with exactly the pinned bytes, if there is one."""
        memo_path = self.root / "runtime-cache" / "wheel-hashes.json"
        memo = load_memo(memo_path) if self.stat_memo else None
        before = dict(memo or {})
        found = next((path for path in self.locations(pin)
                      if path.is_file() and memo_hash(path, memo, sha256_file) == pin.wheel_sha256), None)
        if memo is not None and memo != before:
            save_memo(memo_path, memo)
        return found

    def store(self, path: Path, filename: str, sha256: str) -> Path:
        """Keep a verified download (*sha256* already computed from its bytes) where :meth:`find` looks,
        unless a file with those bytes is cached already."""
        incoming = Pin(name="incoming", version="0", wheel=filename, wheel_sha256=sha256)
        existing = self.find(incoming)
        if existing:
            return existing
        dest = self.locations(incoming)[1]
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        return dest
