"""The ways a per-call (dispatch) tier says vLLM's choice is not known here, or that vLLM raised on the batch,
shared by the probes that write the tiers and the host that judges them. Standard library only.

A tier is vLLM's choice as text (a kernel, a backend, a block size), or one of:

* ``needs GPU: <why>``: only a device can make the choice (an autotuned tactic, a measured timing, a gate that
  reads device pointers); a claim about it is *not judged here*, never guessed;
* ``not resolved: <why>``: vLLM's function could not be called under simulation (moved, or it needed more than
  shapes); a claim about it is *not judged*, and the reason says what stopped it;
* ``vLLM raises: <exception>``: vLLM's own code raised on this batch (an assertion or check of its policy): a
  server given it fails there; a claim about it is REFUSED, as for a construction vLLM refuses.
"""
from __future__ import annotations

NEEDS_GPU = "needs GPU"
NOT_RESOLVED = "not resolved"
RAISES = "vLLM raises"


def needs_gpu(why: str) -> str:
    """The tier of a choice only a device makes, and why."""
    return f"{NEEDS_GPU}: {why}"


def not_resolved(why: str) -> str:
    """The tier of a choice vLLM's function could not be asked for here, and why."""
    return f"{NOT_RESOLVED}: {why}"


def raises(exc_text: str) -> str:
    """The tier of a batch vLLM's own code raised on (its refusal to serve it), with the exception."""
    return f"{RAISES}: {exc_text}"


def refused(choice: str) -> bool:
    """Whether *choice* is vLLM's raise on the batch (:func:`raises`)."""
    return choice.startswith(RAISES + ":")


def unknown(choice: str) -> str | None:
    """:data:`NEEDS_GPU` or :data:`NOT_RESOLVED` when *choice* is such a tier, else None (vLLM's own choice)."""
    for kind in (NEEDS_GPU, NOT_RESOLVED):
        if choice.startswith(kind + ":"):
            return kind
    return None
