"""The ways a per-call (dispatch) tier says vLLM's choice is not known here, or that vLLM raised on the batch,
shared by the probes that write the tiers and the host that judges them. Standard library only.

A tier is vLLM's choice as text (a kernel, a backend, a block size), or one of:

* ``needs GPU: <why>``: only a device can make the choice (an autotuned tactic, a measured timing, a gate that
  reads device pointers); a claim about it is *not judged here*, never guessed;
* ``not resolved: <why>``: vLLM's function could not be called under simulation (moved, or it needed more than
  shapes); a claim about it is *not judged*, and the reason says what stopped it;
* ``vLLM raises: <exception>``: vLLM's own code raised on this batch (an assertion or check of its policy): a
  server given it fails there; a claim about it is REFUSED, as for a construction vLLM refuses.

and the words that mark a model's own step path (a path of its own that serves some steps in place of the stock
lanes): the serving path's tier of a step it takes ends with ``: <its name>`` (:func:`step_path`), of a step it
could take and does not with ``: stock path (<its name> not taken)`` (:func:`stock_path`); its own lane's tier of a
step it leaves to the stock path is :func:`not_taken`.
"""
from __future__ import annotations

NEEDS_GPU = "needs GPU"
NOT_RESOLVED = "not resolved"
RAISES = "vLLM raises"
NOT_TAKEN = "not taken"
STOCK_PATH = "stock path"


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


def not_taken(why: str) -> str:
    """The tier of a step a model's own step path leaves to the stock path, and why."""
    return f"{NOT_TAKEN}: {why}"


def step_path(choice: str, name: str) -> str:
    """*choice* (the serving path's tier) for a step the model's step path *name* takes."""
    return f"{choice}: {name}"


def stock_path(choice: str, name: str) -> str:
    """*choice* (the serving path's tier) for a step the model's step path *name* could take and does not."""
    return f"{choice}: {STOCK_PATH} ({name} {NOT_TAKEN})"


def takes_step_path(choice: str, name: str) -> bool:
    """Whether the serving path's tier *choice* says the step path *name* takes the step."""
    return choice.endswith(f": {name}")


def inactive(choice: str) -> bool:
    """Whether a tier says its lane takes nothing at this batch (a step the step path leaves, or does not take)."""
    return choice.startswith((NOT_TAKEN + ":", STOCK_PATH + " ("))


def annotated(choice: str) -> str | None:
    """The choice a tier annotates with a step path that does not take the step (``X: stock path (...)`` -> X), or
    None."""
    head, sep, tail = choice.rpartition(": ")
    return head if sep and inactive(tail) else None
