"""What an evidence file may say, declared: the header's fields, each record kind's required fields and their types.

Seals (the closing record's count and sha256) catch a file cut short or changed by accident; they are plain
digests, so whoever edits a file can reseal it. What protects the judgment is this: every record is checked
against the kind it claims to be (a kind the schema does not know, a required field missing or of the wrong type
refuses the file with its path and line), and the header against the run (``audit/core.py``:
``check_evidence_identity``). Standard library only.

Types: ``str``, ``int``, ``bool``, ``num`` (int or float), ``list``, ``dict``, ``any``; a trailing ``?`` also
allows null. Fields not declared are allowed (a probe may say more); declared ones must be as declared.
"""
from __future__ import annotations

#: the evidence schema this harness reads and the probes write (kept in step by a test): 3 declares every record
#: kind and requires the header to name its model, pin, wheel, cell and role
SCHEMA = 3

#: header fields every evidence file carries (resolve mode; observe mode's processes know no pin or wheel)
HEADER = {"schema": "int", "mode": "str", "role": "str", "pid": "int", "python": "str", "model": "str", "cell": "dict"}
HEADER_RESOLVE = {"pin": "str", "wheel_sha256": "str", "argv": "list"}
#: the roles a header may name, per mode (a prefix where a role carries the process's name)
ROLES = {"resolve": ("resolve-agent",), "observe": ("vllm-process:",)}

_ERROR = "dict"
#: record kind -> its required fields and their types
KINDS: dict[str, dict[str, str]] = {
    # how far a cell got, and what stopped it
    "stage": {"stage": "str", "ok": "bool", "seconds": "num", "error": "dict?"},
    "platform": {"cls": "str"},
    "config": {},
    "distributed": {"world_size": "int"},
    "job": {"argv": "list", "system": "dict", "layout": "dict"},
    "model": {"cls": "str"},
    # a speculative draft beside its target: how vLLM numbers its layers, which target modules it holds
    "draft": {"cls": "str", "numbering": "dict", "shares": "list"},
    "warm_imports": {},
    "shared_parent": {},
    "probes": {"installed": "bool"},
    # what vLLM chose, and among what
    "select": {"target": "str", "scope": "str", "result": "any"},
    "candidates": {"target": "str", "scope": "str"},
    "candidate": {"target": "str", "scope": "str", "cls": "str", "backend": "str", "supported": "bool",
                  "reason": "str?"},
    "construct": {"target": "str", "scope": "str", "cls": "str", "attrs": "dict"},
    "scope": {"target": "str", "prefix": "str", "cls": "str"},
    "module": {"name": "str", "layer": "int?", "facts": "dict"},
    "raise": {"target": "str", "scope": "str", "error": _ERROR},
    "activation_check": {"scope": "str", "result": "bool?"},
    "target": {"target": "str", "status": "str"},
    "contract": {"checks": "list"},
    # post-load
    "postload": {"steps": "int", "ok": "int", "refused": "int", "limit": "int"},
    "postload-step": {"step": "str", "fn": "str", "outcome": "str", "layer": "int?"},
    "postload-module": {"name": "str", "layer": "int?", "what": "str", "facts": "dict"},
    "postload-model": {"role": "str"},
    "postload-carry": {"fn": "str", "ran": "list", "carried": "list"},
    "postload-comm": {},
    "postload-drift": {"missing": "list"},
    # per-call dispatch
    "dispatch-stage": {"workloads": "list", "errors": "dict"},
    "dispatch": {"lane": "str", "group": "str", "layers": "list", "tiers": "list", "role": "str"},
    # the environment and the simulation
    "availability": {},
    "availability_why": {"items": "dict"},
    "fingerprint": {"packages": "dict"},
    "simulated": {"items": "dict"},
    "standin_fit": {"items": "dict"},
    "fence": {"on": "bool", "pieces": "dict", "planted": "list"},
    "harness_fault": {"piece": "str", "type": "str", "message": "str"},
    "probe_error": {"where": "str", "error": _ERROR},
    # observe mode
    "plugin": {"event": "str"},
    "observe-status": {"targets": "dict"},
    "observe-phase-check": {},
    "observe-profiler-check": {},
    "exec": {"lane": "str", "path": "str"},
    "graph": {"key": "any", "replays": "int", "paths": "list"},
    "workload": {"ok": "bool"},
    "phase-start": {"phase": "str"},
    "kernel-map": {"entries": "list"},
    "profiler-traces": {"traces": "list"},
}

_TYPES = {"str": str, "int": int, "bool": bool, "num": (int, float), "list": list, "dict": dict}


def _is(value, declared: str) -> bool:
    if declared.endswith("?"):
        if value is None:
            return True
        declared = declared[:-1]
    if declared == "any":
        return True
    if declared in ("int", "num") and isinstance(value, bool):
        return False
    return isinstance(value, _TYPES[declared])


def problems(record: dict, fields: dict[str, str]) -> str:
    """What is wrong with a record against its declared *fields*, or ""."""
    for name, declared in fields.items():
        if name not in record:
            if declared.endswith("?"):
                continue
            return f"has no {name!r}"
        if not _is(record[name], declared):
            return f"{name!r} is {type(record[name]).__name__}, the schema declares {declared.rstrip('?')}"
    return ""


def check_record(record: dict) -> str:
    """Why a (non-header, non-closing) record is not evidence this harness reads, or ""."""
    kind = record.get("kind")
    if kind not in KINDS:
        return f"a record of kind {kind!r}, which the evidence schema does not declare"
    if not isinstance(record.get("seq"), int) or isinstance(record.get("seq"), bool):
        return f"a {kind!r} record without its sequence number"
    wrong = problems(record, KINDS[kind])
    return f"a {kind!r} record {wrong}" if wrong else ""


def check_header(header: dict) -> str:
    """Why a header is not one this harness reads, or "": its fields, its mode and role from the declared set."""
    wrong = problems(header, HEADER)
    if wrong:
        return f"the header {wrong}"
    mode = header["mode"]
    if mode not in ROLES:
        return f"the header names mode {mode!r} (known: {', '.join(ROLES)})"
    if not header["model"]:
        return "the header names no model"
    if not header["role"].startswith(ROLES[mode]):
        return f"the header names role {header['role']!r}, not one of {mode} mode's ({', '.join(ROLES[mode])})"
    if not {"system", "layout"} <= set(header["cell"]):
        return "the header's cell names no system and layout"
    if mode == "resolve":
        wrong = problems(header, HEADER_RESOLVE)
        if wrong:
            return f"the header {wrong}"
    return ""
