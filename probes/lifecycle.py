"""Children die with their parent: no probe process outlives the harness that started it.

Two mechanisms, both standard library:

* :func:`die_with_parent` asks Linux to SIGKILL this process when the process that forked it ends
  (``prctl(PR_SET_PDEATHSIG)``), and exits at once if that parent is already gone. The agent calls it in
  every process it forks (SM processes, cells), so killing any of them takes its subtree with it.
* :func:`watch_stdin` is for the agent's own process, whose parent may be out of reach (a container's
  entry point, a batch job): the harness keeps the agent's standard input open and never writes to it;
  when the harness dies its end closes, the read returns EOF and the agent kills its process group.
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


def watch_stdin() -> bool:
    """When the runtime asked for it, end this process group once standard input reaches EOF."""
    if os.environ.get(WATCHDOG_ENV) != "stdin":
        return False
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


__all__ = ["WATCHDOG_ENV", "die_with_parent", "watch_stdin"]
