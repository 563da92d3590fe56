"""The two ways a per-call (dispatch) tier says vLLM's choice is not known here, shared by the probes that write
the tiers and the host that judges them. Standard library only.

A tier is vLLM's choice as text (a kernel, a backend, a block size), or one of:

* ``needs GPU: <why>``: only a device can make the choice (an autotuned tactic, a measured timing, a gate that
  reads device pointers); a claim about it is *not judged here*, never guessed;
* ``not resolved: <why>``: vLLM's function could not be called under simulation (moved, or it needed more than
  shapes); a claim about it is *not judged*, and the reason says what stopped it.
"""
from __future__ import annotations

NEEDS_GPU = "needs GPU"
NOT_RESOLVED = "not resolved"


def needs_gpu(why: str) -> str:
    """The tier of a choice only a device makes, and why."""
    return f"{NEEDS_GPU}: {why}"


def not_resolved(why: str) -> str:
    """The tier of a choice vLLM's function could not be asked for here, and why."""
    return f"{NOT_RESOLVED}: {why}"


def unknown(choice: str) -> str | None:
    """:data:`NEEDS_GPU` or :data:`NOT_RESOLVED` when *choice* is such a tier, else None (vLLM's own choice)."""
    for kind in (NEEDS_GPU, NOT_RESOLVED):
        if choice.startswith(kind + ":"):
            return kind
    return None
