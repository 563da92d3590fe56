"""Where vLLM's own code refuses a deployment, in one place: at construction (building the model raised), at load
(a post-load step raised) or at dispatch (a per-call choice raises on a batch: a server given that batch fails).

Read from a cell of ``routing.json`` (and, for dispatch, its profile's judged lanes: which dispatch lanes refine
which lane); the ledger's headline and per-system tables, the verdicts, the labels, the diff and the PR summary
all ask here. A simulation limit is never a refusal.
"""
from __future__ import annotations

from audit import engines
from audit.lanevalue import short
from audit.report import dispatch
from probes.core import tiers

STAGES = ("construction", "load", "dispatch")


def cell_refused(cell: dict, engine: str = "") -> str | None:
    """Why the engine (*engine*: its name, the first engine's where not given) refuses to serve this cell's
    configuration at all (its own check raised at construction or at load), or None. A simulation limit is no
    refusal: the layers it reached keep their labels."""
    engine = engine or engines.get(engines.DEFAULT).title
    r = cell.get("load_refused")
    if r:
        return (f"{engine} refuses to load it: {r.get('function', '')} raised {short(r.get('type', ''))}: "
                f"{r.get('message', '')}")
    f = cell.get("failure") or {}
    if f.get("outcome") == "refused":
        return (f"{engine} refuses to build it ({f.get('stage', '')}): {short(f.get('type', ''))}: "
                f"{f.get('message', '')}")
    return None


def refused_stage(cell: dict) -> str | None:
    """construction or load where vLLM refuses the whole deployment, else None."""
    if cell.get("load_refused"):
        return "load"
    if (cell.get("failure") or {}).get("outcome") == "refused":
        return "construction"
    return None


def _judged(profile, lane: str):
    return next((j for j in profile.judged if j.lane == lane), None)


def raise_at(cell: dict, lane: str, group: dict, workload: str, profile) -> str | None:
    """vLLM's raise on the batch *workload* in one of the dispatch lanes that refine *lane* (its profile's
    ``JudgedLane.dispatch``), for the group's layers, with the lane it came from; None when none raised."""
    judged = _judged(profile, lane)
    titles = dispatch.lane_titles(profile)
    for dlane, _prefix in (judged.dispatch if judged is not None else ()):
        found = dispatch.tier_choice(cell, dlane, group["layers"], workload)
        if found is not None and tiers.refused(found[0]):
            return f"{titles.get(dlane, dlane)} at {workload}: {found[0]}"
    return None


def dispatch_raise(cell: dict, lane: str, group: dict, profile) -> dict | None:
    """Where vLLM raises on the batches *lane* serves for the group's layers: ``{"at": "prefill 512–8192", "why":
    vLLM's raise (the first), "workloads": [...]}``, or None."""
    judged = _judged(profile, lane)
    if judged is None:
        return None
    every = list((cell.get("dispatch") or {}).get("workloads", []))
    raised: dict[str, str] = {}
    for w in every:
        if w.split(" ")[0] not in judged.workloads:
            continue
        for dlane, _prefix in judged.dispatch:
            found = dispatch.tier_choice(cell, dlane, group["layers"], w)
            if found is not None and tiers.refused(found[0]):
                raised[w] = found[0]
                break
    if not raised:
        return None
    works = list(raised)
    return {"at": dispatch.fold(works, every), "workloads": works, "why": raised[works[0]]}


def cell_refusals(cell: dict, profile) -> list[dict]:
    """Every refusal of the cell: ``{"stage", "why", "raised", "lanes": [...], "at": ...}`` (``raised``: the exception
    alone, ``why``: in a sentence); a deployment refused at
    construction or load is one entry (it serves nothing); raises at dispatch are one entry per (raise, batches)
    with the lanes it stops."""
    stage = refused_stage(cell)
    if stage is not None:
        r = cell.get("load_refused") if stage == "load" else cell.get("failure") or {}
        return [{"stage": stage, "why": cell_refused(cell, engines.get(profile.engine).title), "lanes": [], "at": "",
                 "raised": f"{short(r.get('type', ''))}: {r.get('message', '')}"}]
    out: dict[tuple, dict] = {}
    for lane, groups in (cell.get("lanes") or {}).items():
        for g in groups:
            value = g.get("value")
            raised = (value or {}).get("raises") if isinstance(value, dict) else None
            if raised is None:
                continue
            entry = out.setdefault((raised["why"], raised["at"]), {
                "stage": "dispatch", "why": raised["why"], "lanes": [], "at": raised["at"],
                "workloads": list(raised.get("workloads") or []),
                "raised": raised["why"].split(": ", 1)[1] if tiers.refused(raised["why"]) else raised["why"]})
            if lane not in entry["lanes"]:
                entry["lanes"].append(lane)
    return [out[k] for k in sorted(out)]
