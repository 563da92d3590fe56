"""Lane values as records: what a lane group of ``routing.json`` says vLLM chose, as fields, and the one sentence a
reader sees, derived from them. The vocabulary only (what a record holds, its identity, its sentence, how a recorded
answer becomes one): the post-load readings of the shared code and of the profiles build records with it, and
``audit/report/values.py`` fills in what a record takes from its cell (family, refusals, raises).

A lane group's ``value`` is a record::

    {"kernel": "MarlinExperts",      # what runs: the kernel function or class; for a lane whose answer is a
                                     # setting (a fusion, a deferral, an activation) the setting vLLM chose
     "detail": "",                   # what else of the answer decides serving (a prepare/finalize class, a
                                     # token cap, "weights transformed"); part of the identity
     "note": "",                     # what the answer also says that decides nothing (how a check was recorded)
     "backend": "MARLIN",            # vLLM's own selector value where the lane has one (an enum member's name,
                                     # a backend string), else ""
     "family": "marlin",             # the backend family in the perf database's words ("" where unknown)
     "flags": [],                    # FLAGS below
     "raises": {"at": ..., "why": ...}   # only with the raises-at-dispatch flag: where vLLM raises and why
    }

The identity of a value (what a comparison of two audits asks) is its kernel, detail and whether it is inactive;
its sentence is ``kernel detail (note)``. The evidence level stays on the group (``level``), the evidence the value
was read from on ``raw``. Nothing here decides what vLLM chose: the records are read from evidence by
``audit/report/routing.py`` and the post-load readings; this module only names their parts and words them.
Standard library only.
"""
from __future__ import annotations

import json
import re

#: what a flag on a lane value means (the ledger's key and README say the same)
FLAGS = {
    "inactive": "the lane takes nothing here (not requested, not exercised in this layout)",
    "refused": "vLLM refuses this deployment (at construction or at load): what was built does not serve",
    "raises-at-dispatch": "vLLM raises on some batches this lane serves: a server given such a batch fails there",
    "needs-gpu": "the value is decided on the device (an autotuner, a measured timing): resolve mode cannot name it",
}
FIELDS = ("kernel", "detail", "note", "backend", "family", "flags")
#: the record's schema: routing.json's schema 3 holds lane values as these records (schema 2 held sentences)
ROUTING_SCHEMA = 3


def make(kernel: str = "", *, detail: str = "", note: str = "", backend: str = "", flags=()) -> dict:
    """A lane value record (family and the cell-level flags are filled in by :func:`finish`)."""
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
        raise ValueError(f"unknown lane value flag(s) {unknown}: known {sorted(FLAGS)}")
    return {"kernel": str(kernel or ""), "detail": str(detail or ""), "note": str(note or ""),
            "backend": str(backend or ""), "family": "", "flags": sorted(set(flags))}


def inactive(state: str, *, kernel: str = "", backend: str = "", note: str = "") -> dict:
    """A value that says the lane takes nothing here (*state*: "not requested", "not exercised: why", ...)."""
    return make(kernel, detail=state, note=note, backend=backend, flags=("inactive",))


def is_inactive(value: dict) -> bool:
    return "inactive" in (value or {}).get("flags", ())


def identity(value: dict | None) -> tuple:
    """What of a value decides serving, (its kernel and detail in words, whether it is inactive): two values with the
    same identity serve the same way (a schema 2 value upgraded to a record, whose parts were never split, compares
    equal to today's record of the same answer)."""
    if not value:
        return ()
    if is_inactive(value):  # what would run there is no part of it: nothing runs
        return (value.get("detail", ""), True)
    return (" ".join(p for p in (value.get("kernel", ""), value.get("detail", "")) if p), False)


def sentence(value: dict | None) -> str:
    """The value in words: ``kernel detail (note)``; an inactive value says its state (``detail``) only."""
    if not value:
        return "—"
    if is_inactive(value):
        text = value.get("detail", "") or "takes nothing"
        return text + (f" ({value['note']})" if value.get("note") else "")
    head = " ".join(p for p in (value.get("kernel", ""), value.get("detail", "")) if p) or "—"
    return head + (f" ({value['note']})" if value.get("note") else "")


def text(group: dict) -> str:
    """A lane group's sentence (its value's; a group from observe mode says its path)."""
    value = group.get("value")
    return sentence(value) if isinstance(value, dict) else str(value if value is not None else "—")


def key(value: dict) -> str:
    """A stable key of a whole record (layers with the same record collapse into one group)."""
    return json.dumps(value, sort_keys=True)


def cut(text: str, n: int) -> str:
    """*text* cut to at most about *n* characters at a word's end, "…" where something was left out (never mid-word)."""
    text = str(text or "")
    if len(text) <= n:
        return text
    head = text[:n].rsplit(" ", 1)[0].rstrip(" ,;:-")
    return (head or text[:n]) + " …"


# --- display names of evidence values -------------------------------------------------------------------------
def short(value) -> str:
    """Display form: enum member name, class name; lists joined with ' / '."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " / ".join(short(v) for v in value)
    text_ = str(value)
    if ":" in text_ and not text_.startswith("<"):
        return text_.rsplit(":", 1)[1].rsplit(".", 1)[-1]
    if re.fullmatch(r"[A-Za-z_][\w]*\.[A-Z][A-Z0-9_]+", text_):  # Enum.MEMBER
        return text_.split(".", 1)[1]
    if re.fullmatch(r"[a-z_][\w]*(\.[\w]+)+\.[A-Z]\w*", text_):  # dotted class path
        return text_.rsplit(".", 1)[1]
    return text_


def _is_class(v) -> bool:
    """A ``module:Class`` path (how the probes record a class)."""
    return isinstance(v, str) and ":" in v and not v.startswith("<") and " " not in v


def _is_enum(v) -> bool:
    return isinstance(v, str) and bool(re.fullmatch(r"[A-Za-z_][\w]*\.[A-Z][A-Z0-9_]+", v))


def from_fields(fields: list, *, label: str = "", kernels: dict | None = None) -> dict:
    """The record of a selector's or a built object's answer (a lane source's ``fields``, as recorded): the first
    class it names is what runs; an enum member or a plain string beside it is vLLM's backend value; a backend value
    with no class is the kernel *kernels* says it enters (the profile's ``backend_labels`` for the lane), else
    itself. A source's ``label`` is a note ("MegaMoE"); on an answer with no class it words the answer ("fused
    decode kernel supported: no")."""
    classes = [short(f) for f in fields if _is_class(f)]
    plain = [f for f in fields if f is not None and not _is_class(f)]
    backend = short(plain[0]) if plain else ""
    if classes:
        return make(classes[0], backend=backend, note=label)
    answer = " / ".join(short(f) for f in fields)
    entered = None
    if plain and kernels:
        entered = kernels.get(plain[0]) if isinstance(plain[0], (str, bool)) else None
    if entered:
        return make(entered, backend=backend, note=f"{label} {answer}".strip() if label else "")
    return make(answer, backend=backend if backend != answer else "", note=label)


def from_modules(items: list[list]) -> dict:
    """The record of linear layers read off built modules: ``[[leaf, quant method], ...]`` -> what each runs."""
    return make(", ".join(f"{leaf}: {short(v)}" for leaf, *vals in items for v in vals[:1]))
