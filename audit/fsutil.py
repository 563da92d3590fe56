"""Atomic file writes: a reader sees the old file or the new one, never a partial one."""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from audit.errors import UsageError


def cache_root() -> Path:
    """Where environments, wheels, runs and the evidence cache live: ``$SERVING_TRUTH_CACHE``, else
    ``~/.cache/serving-truth``."""
    root = os.environ.get("SERVING_TRUTH_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "serving-truth"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; reports are ordinary files
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def write_all_atomic(files: dict[Path, str]) -> list[Path]:
    """Write several files; every one is rendered to a temporary name first, then all are renamed.

    If rendering or writing any file fails, no target file is touched.
    """
    staged: list[tuple[str, Path]] = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            staged.append((tmp, path))
            with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o666 & ~_umask())
    except BaseException:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    for tmp, path in staged:
        os.replace(tmp, path)
    return [p for _, p in staged]


#: FS_IOC_GETFLAGS and the inode flags that make a file impossible to remove or replace
_FS_IOC_GETFLAGS = 0x80086601
_FS_IMMUTABLE_FL, _FS_APPEND_FL = 0x10, 0x20
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _pinned_files(directory: Path) -> list[Path]:
    """Files under *directory* the kernel will not let us remove (immutable or append-only)."""
    import fcntl
    import struct

    out = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            flags = struct.unpack("l", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, struct.pack("l", 0)))[0]
        except OSError:  # the filesystem keeps no such flags
            flags = 0
        finally:
            os.close(fd)
        if flags & (_FS_IMMUTABLE_FL | _FS_APPEND_FL):
            out.append(path)
    return out


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directory entries in one step (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem or kernel cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(target: str | Path, files: dict[str, str]) -> Path:
    """Replace directory *target* by one holding exactly *files* (relative name -> text), as a unit.

    Every file is written and synced in a sibling directory first; the sibling then takes the target's
    place in one rename (exchanged with the old directory where the kernel can), and the old one is
    removed. A reader sees the old report or the new one, never a mix. If the old report cannot be
    removed (a file in it is immutable) nothing is changed and ``PermissionError`` says which file.
    """
    import shutil

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(20, "exists and is not a directory", str(target))
    if target.is_dir():
        pinned = _pinned_files(target)
        if pinned:
            raise PermissionError(1, "immutable or append-only file (chattr) in the report", str(pinned[0]))
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.new-", dir=target.parent))
    try:
        for rel, text in sorted(files.items()):
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w", encoding="utf-8", newline="\n") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(path, 0o666 & ~_umask())
        os.chmod(staging, 0o777 & ~_umask())
        if not target.exists():
            os.rename(staging, target)
            return target
        if not _exchange(staging, target):
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "x")
            os.rename(staging, target)
            staging = old
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)  # now the old report
    return target


class DirLock:
    """An exclusive advisory lock on ``<parent>/.<name>.lock`` while a report is rendered and replaced, so
    two audits of one pin never interleave their writes (the later one waits)."""

    def __init__(self, target: str | Path, on_wait=None):
        """*on_wait*: called once, before blocking, when another process holds the lock (a progress line)."""
        target = Path(target)
        self.path = target.parent / f".{target.name}.lock"
        self._fd = None
        self._on_wait = on_wait

    def __enter__(self):
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self._on_wait is not None:
                self._on_wait()
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        import fcntl

        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        return False


_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def read_regular(path: str | Path) -> str:
    """The text of a regular file; anything else (a FIFO, which would block the read forever, a directory, a device)
    raises ``OSError`` naming what it is, before it is opened."""
    import stat

    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise OSError(f"{path} is {kind}, not a file this harness reads")
    return Path(path).read_text(encoding="utf-8")


def report_dir_for(reports_dir: str | Path, pin: str) -> Path:
    """``reports/<pin>``; a pin name that is no plain directory name (or is ``diffs``) is refused."""
    if not _SAFE_NAME.match(pin) or pin == "diffs" or ".." in pin:
        raise UsageError(f"pin name {pin!r} cannot name a report directory",
                         hint="pin names are letters, digits and . _ + - (not 'diffs', no '..')")
    return Path(reports_dir) / pin


# -- file hashes, remembered per stat ------------------------------------------------------------
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def memo_hash(path: Path, memo: dict | None, compute) -> str:
    """``compute(path)``, or, with *memo* (path -> [inode, size, mtime_ns, ctime_ns, hash]), the hash recorded
    when the file last had this inode, size, mtime and ctime (git's index does the same: any write, rename
    over or chmod moves ctime, which no user-level call can set). New hashes are added to *memo*."""
    if memo is None:
        return compute(path)
    st = path.stat()
    stamp = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    key = str(path)
    if memo.get(key, [None])[:4] != stamp:
        memo[key] = [*stamp, compute(path)]
    return memo[key][4]


def load_memo(path: Path) -> dict:
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def save_memo(path: Path, memo: dict) -> None:
    write_atomic(path, json.dumps(memo, sort_keys=True))
