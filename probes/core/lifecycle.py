"""Children die with their parent: no probe process outlives the harness that started it.

Two mechanisms, both standard library:

* :func:`die_with_parent` asks Linux to SIGKILL this process when the process that forked it ends
  (``prctl(PR_SET_PDEATHSIG)``), and exits at once if that parent is already gone. The agent calls it in
  every process it forks (SM processes, cells), so killing any of them takes its subtree with it.
* :func:`watch_parent` is for the agent's own process, whose parent may be out of reach (a container's
  entry point, a batch job): the harness keeps the agent's standard input open and never writes to it
  (when the harness dies its end closes, the read returns EOF), or, for a batch job on another node,
  rewrites a heartbeat file; either way the agent then kills its whole process group.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
#: set by a runtime that keeps the agent's standard input open as a lifeline
WATCHDOG_ENV = "SERVING_TRUTH_WATCHDOG"


def die_with_parent(expected_parent: int | None = None) -> bool:
    """SIGKILL this process when its parent ends; True when the kernel accepted the request."""
    ok = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(137)  # the parent died before the request took effect
    return ok


def _kill_group() -> None:
    try:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    finally:
        os._exit(137)


def watch_parent() -> bool:
    """Start the lifeline the runtime asked for in ``SERVING_TRUTH_WATCHDOG``:

    * ``stdin``: end this process group once standard input reaches EOF (local runtime, containers);
    * ``heartbeat:SECONDS:PATH``: end it when the file at PATH (on a filesystem the harness shares, e.g. a
      batch job's run directory) has not changed for SECONDS, as measured by this process's own clock, so
      clocks of different nodes never matter (Slurm jobs whose harness waits for them).
    """
    how = os.environ.get(WATCHDOG_ENV, "")
    if how == "stdin":
        return watch_stdin()
    if how.startswith("heartbeat:"):
        _, seconds, path = how.split(":", 2)
        return watch_heartbeat(path, float(seconds))
    return False


def watch_heartbeat(path: str, stale_after: float, *, poll: float = 2.0) -> bool:
    import time

    def beat():
        try:
            with open(path, "rb") as fh:
                return fh.read(64)
        except OSError:
            return None

    def wait_for_silence():
        last, changed = beat(), time.monotonic()
        while True:
            time.sleep(poll)
            now = beat()
            if now != last:
                last, changed = now, time.monotonic()
            elif time.monotonic() - changed > stale_after:
                print(f"[serving-truth] the harness stopped its heartbeat ({path}) {stale_after:.0f}s ago; "
                      "ending this job", file=sys.stderr, flush=True)
                _kill_group()

    threading.Thread(target=wait_for_silence, name="serving-truth-heartbeat", daemon=True).start()
    return True


def watch_stdin() -> bool:
    """End this process group once standard input reaches EOF."""
    try:
        fd = os.dup(0)
    except OSError:
        return False

    def wait_for_eof():
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        _kill_group()

    threading.Thread(target=wait_for_eof, name="serving-truth-watchdog", daemon=True).start()
    return True


__all__ = ["WATCHDOG_ENV", "die_with_parent", "watch_heartbeat", "watch_parent", "watch_stdin"]
