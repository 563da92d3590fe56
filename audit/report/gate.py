"""The pin-bump gate: a candidate build audited against a baseline pin the release owner trusts.

Two questions, answered apart:

* **Did serving change?** The rows of the routing diff (``audit/report/diff.py``) whose kind gates, as the
  classification table (``audit/report/changes.py``) decides: a new or removed path, an experts class, a kernel, a
  refusal (construction, load or a batch vLLM raises on), a simulation stop, probe drift, an availability answer
  beside a selection that moved, a per-call tier. This module decides nothing about a difference itself; it does
  not depend on any claim: a regression no claim describes still fails the gate.
* **Are there new findings?** The failing verdicts (``verdicts.FAILING``) and required probe drift, less the
  findings the release owner accepted once (``accepted findings``: a file the way linters keep a baseline;
  ``serving-truth accept PIN`` writes it from an audited pin's report). A finding is matched on what it says
  (claim, system, layout, lane, batch size, verdict and what runs there), so a claim that now fails against
  another backend is new.

Cells the two audits do not share are listed (never silently passed): the gate covers the cells both
audited.

Accepted-findings file (TOML)::

    schema = 1
    [[finding]]
    claim = "moe-w4a16-marlin"     # "" for a row no claim covers (a refusal of the whole cell)
    system = "b200_sxm"
    layout = "tp8"
    lane = "moe"
    at = ""                         # a claim's batch size ("decode 8"), "" for every batch size
    verdict = "MISMATCH"
    actual = "flashinfer_trtllm_gen"
    note = "..."                    # optional: why it is accepted
"""
from __future__ import annotations

import json
from pathlib import Path

from audit.errors import InputFileError
from audit.report.verdicts import FAILING

ACCEPTED_SCHEMA = 1
_FINDING_KEYS = ("claim", "system", "layout", "lane", "at", "verdict", "actual")


class AcceptedFindingsError(InputFileError):
    """A problem in an accepted-findings file."""


def finding_key(row: dict) -> tuple:
    return tuple(str(row.get(k) or "") for k in _FINDING_KEYS)


def findings(routing: dict) -> list[dict]:
    """The failing verdict rows of an audit (one per distinct key) and its required probe drift."""
    out: dict[tuple, dict] = {}
    for r in (routing.get("verdicts") or {}).get("rows", []):
        if r["verdict"] in FAILING:
            out.setdefault(finding_key(r), {**{k: r.get(k) or "" for k in _FINDING_KEYS}, "why": r.get("why", "")})
    for cell in routing.get("cells", []):
        for d in cell.get("drift", []):
            if d.get("required", True):
                row = {"claim": "", "system": cell["system"], "layout": cell["layout"], "lane": "probe drift",
                       "at": "", "verdict": "DRIFT", "actual": d["target"],
                       "why": f"required probe target {d['target']} drifted: the audit could not look where it must"}
                out.setdefault(finding_key(row), row)
    return [out[k] for k in sorted(out)]


def load_accepted(path: str | Path, *, model: str = "", layouts: tuple[str, ...] = ()) -> set[tuple]:
    """The finding keys of an accepted-findings file; bad content names the file and line. With *model* and
    *layouts* (the audited model's), a file that names another model, or accepts a finding in a layout this
    model does not have, is refused: it is another model's file, and subtracting it would accept nothing real."""
    from audit.tomlpos import header_lines, key_line, read_toml

    text, data = read_toml(path, AcceptedFindingsError,
                           hint="write it with: serving-truth accept PIN (or make accept PIN=...)")
    sp = str(path)
    if data.get("schema") != ACCEPTED_SCHEMA:
        raise AcceptedFindingsError(f"schema is {data.get('schema')!r}, this harness reads {ACCEPTED_SCHEMA}",
                                    path=sp, line=key_line(text, 1, "schema") or 1)
    named = data.get("model")
    if model and named not in (None, "", model):
        raise AcceptedFindingsError(f"the accepted findings of the model {named!r}, not of {model}", path=sp,
                                    line=key_line(text, 1, "model") or 1,
                                    hint=f"name {model}'s own file (expectations/{model}.accepted.toml), or "
                                         "`--accepted none`")
    rows = data.get("finding", [])
    if not isinstance(rows, list):
        raise AcceptedFindingsError("'finding' must be an array of tables ([[finding]])", path=sp,
                                    line=key_line(text, 1, "finding"))
    headers = header_lines(text, "[[finding]]")
    out = set()
    for i, raw in enumerate(rows):
        line = headers[i] if i < len(headers) else None
        unknown = sorted(set(raw) - set(_FINDING_KEYS) - {"note"})
        if unknown:
            raise AcceptedFindingsError(f"unknown key {unknown[0]!r} in [[finding]]", path=sp,
                                        line=key_line(text, (line or 0) + 1, unknown[0]) if line else None,
                                        hint="known: " + ", ".join((*_FINDING_KEYS, "note")))
        for k in ("system", "layout", "lane", "verdict"):
            if not isinstance(raw.get(k), str) or not raw.get(k):
                raise AcceptedFindingsError(f"[[finding]] needs a non-empty {k!r}", path=sp, line=line)
        for k in ("claim", "at", "actual", "note"):
            if not isinstance(raw.get(k, ""), str):
                raise AcceptedFindingsError(f"{k!r} must be a string", path=sp,
                                            line=key_line(text, (line or 0) + 1, k) if line else None)
        if layouts and raw["layout"] not in layouts:
            raise AcceptedFindingsError(f"a finding in the layout {raw['layout']!r}, which {model or 'this model'} "
                                        f"does not have (its layouts: {', '.join(layouts)}): the accepted findings "
                                        "of another model?", path=sp,
                                        line=key_line(text, (line or 0) + 1, "layout") if line else None)
        out.add(finding_key(raw))
    return out


def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def accepted_text(routing: dict, *, source: str, keep_notes: dict[tuple, str] | None = None) -> str:
    """An accepted-findings file holding every finding of *routing* (its notes kept where a key was noted)."""
    pin = (routing.get("pin") or {}).get("name", "?")
    lines = [f"# Findings accepted for the pin-bump gate: every failing verdict and required probe drift of {pin}",
             f"# (from {source}). The gate against a baseline fails only on findings not listed here.",
             f"# Written by `serving-truth accept {pin}`; remove a [[finding]] to stop accepting it.",
             f"schema = {ACCEPTED_SCHEMA}", f"model = {_toml_str(str(routing.get('model') or ''))}", ""]
    for f in findings(routing):
        lines.append("[[finding]]")
        lines += [f"{k} = {_toml_str(str(f[k]))}" for k in _FINDING_KEYS]
        note = (keep_notes or {}).get(finding_key(f))
        if note:
            lines.append(f"note = {_toml_str(note)}")
        lines.append("")
    return "\n".join(lines)


def judge_gate(baseline: dict, routing: dict, accepted: set[tuple] | None, profile, *, accepted_path: str = "",
               diff: dict | None = None) -> dict:
    """The gate's answer for *routing* against *baseline* (both *profile*'s model's): serving changes (diff rows),
    new findings, and which cells it could not compare. *diff*: the two routings' diff where the caller computed
    it already."""
    from audit.report.diff import diff_routings

    d = diff if diff is not None else diff_routings(baseline, routing, profile)
    changes = [c for c in d["changes"] if c["serving"]]
    accepted = accepted or set()
    before = {finding_key(f) for f in findings(baseline)}
    new = [{**f, "in_baseline": finding_key(f) in before} for f in findings(routing) if finding_key(f) not in accepted]
    known = [f for f in findings(routing) if finding_key(f) in accepted]
    return {"baseline": d["from"], "candidate": d["to"], "serving_changes": changes,
            "by_class": d["by_class"], "information_changes": d["information_changes"], "headline": d["headline"],
            # new findings split the one way that keeps the counts consistent: failing only now, or failing in the
            # baseline too but not in the accepted-findings file
            "newly_failing": sum(1 for f in new if not f["in_baseline"]),
            "new_findings": new, "accepted_findings": len(known), "accepted_file": accepted_path,
            "cells_compared": d["cells_compared"], "only_in_baseline": d["only_in_from"],
            "only_in_candidate": d["only_in_to"],
            # a judgment has a size: a gate that compared no cell judged nothing, and never passes
            "passed": not changes and not new and d["cells_compared"] > 0}
