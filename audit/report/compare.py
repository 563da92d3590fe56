"""Two engines side by side: for one model, the committed routing of a pin of one engine beside a pin of another,
one table per system and layout, each lane's kernel under each engine with the evidence level of each.

What is compared is declared, not guessed: a lane is the same lane where both engines' profiles give it the same id
(the ledger's lane ids: ``moe``, ``mla.decode``, ...); a layout is the same deployment where both profiles name a
layout alike (``tp8``, ``dep8``, ...), and each table shows both engines' flags for it. A lane or a layout only one
engine declares is listed as such, never matched by its title. Values are each engine's own (the ledger's lane
values); nothing is translated from one engine's words into the other's. Where either engine built a speculative
draft, the draft's own lanes follow the target's, marked "(draft)".

Written as ``reports/compare/<pin>..<pin>.md`` with its data (``.json``); the same two routings render the same
bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

from audit import engines, models
from audit.fsutil import write_atomic
from audit.report.diff import load_routing
from audit.report.render import NONE_BUILT, _env, _lane_summary
from audit.systems import SYSTEMS

#: under reports/: the comparisons
FOLDER = "compare"


def _side(pin: str, profile, reports_dir: Path) -> dict:
    routing = load_routing(models.reports_root(reports_dir, profile), pin, profile)
    engine = engines.get(profile.engine)
    return {"pin": pin, "engine": engine.title, "version": engine.version_of(routing["pin"]), "profile": profile,
            "routing": routing, "cells": {(c["system"], c["layout"]): c for c in routing["cells"]},
            "titles": routing.get("lane_titles") or {}, "order": routing.get("lane_order") or []}


def _value(side: dict, system: str, layout: str, lane: str, *, draft: bool = False) -> tuple[str, str]:
    """(what runs, evidence) of *lane* in one engine's cell (``draft``: its speculative draft's lane); why there is
    none where it has no value."""
    cell = side["cells"].get((system, layout))
    if cell is None:
        return "not audited", "—"
    if cell["status"] == "INCOMPLETE":
        return "INCOMPLETE (no routing)", "—"
    if draft and not cell.get("draft"):
        return "no draft built", cell["evidence"]
    lanes = (cell.get("draft") or {}).get("lanes") if draft else cell.get("lanes")
    groups = (lanes or {}).get(lane) or []
    levels = sorted({g.get("level") for g in groups if g.get("level")})
    evidence = ", ".join([cell["evidence"], *levels]) if groups else cell["evidence"]
    return _lane_summary(groups, cell), evidence


def compare(reports_dir: str | Path, left: str, left_profile, right: str, right_profile) -> dict:
    """The comparison of two committed routings of one model (data; :func:`render` words it)."""
    if left_profile.name != right_profile.name:
        from audit.errors import UsageError

        raise UsageError(f"a comparison is of one model: {left_profile.name} and {right_profile.name} differ")
    reports_dir = Path(reports_dir)
    a, b = _side(left, left_profile, reports_dir), _side(right, right_profile, reports_dir)
    lanes = [lane for lane in a["order"] if lane in b["order"]]
    right_ids = {lane.id for lane in right_profile.lanes}
    declared = [lane.id for lane in left_profile.lanes if lane.id in right_ids]
    titles_of = {lane.id: lane.title for lane in (*left_profile.lanes, *right_profile.lanes)}
    titles = {**b["titles"], **a["titles"]}
    shared_layouts = [n for n in left_profile.layouts if n in right_profile.layouts]
    tables = []
    for system in SYSTEMS.values():
        for name in shared_layouts:
            if (system.name, name) not in a["cells"] and (system.name, name) not in b["cells"]:
                continue
            rows = []
            for lane in lanes:
                va, ea = _value(a, system.name, name, lane)
                vb, eb = _value(b, system.name, name, lane)
                if va == vb == NONE_BUILT:  # a lane of a kind neither engine built in this cell (a draft's own)
                    continue
                title = a["titles"].get(lane) or b["titles"].get(lane) or lane
                rows.append({"lane": lane, "title": title, "left": va, "left_evidence": ea, "right": vb,
                             "right_evidence": eb})
            # a speculative draft's own lanes, where either engine built one: the lanes both profiles declare that
            # either draft has a value for
            drafts = [side["cells"].get((system.name, name), {}).get("draft") or {} for side in (a, b)]
            for lane in [lane for lane in declared if any(lane in (d.get("lanes") or {}) for d in drafts)]:
                va, ea = _value(a, system.name, name, lane, draft=True)
                vb, eb = _value(b, system.name, name, lane, draft=True)
                title = a["titles"].get(lane) or b["titles"].get(lane) or titles_of.get(lane, lane)
                rows.append({"lane": lane, "draft": True, "title": f"{title} (draft)", "left": va, "left_evidence": ea,
                             "right": vb, "right_evidence": eb})
            tables.append({"system": system.name, "device": system.device_name,
                           "sm": f"{system.capability[0]}.{system.capability[1]}", "layout": name,
                           "left_args": list(left_profile.layouts[name].serve_args),
                           "right_args": list(right_profile.layouts[name].serve_args),
                           "left_title": left_profile.layouts[name].title,
                           "right_title": right_profile.layouts[name].title, "rows": rows})
    only = {"left": [n for n in left_profile.layouts if n not in right_profile.layouts],
            "right": [n for n in right_profile.layouts if n not in left_profile.layouts],
            "left_lanes": [titles.get(lane, lane) for lane in a["order"] if lane not in b["order"]],
            "right_lanes": [titles.get(lane, lane) for lane in b["order"] if lane not in a["order"]]}
    return {"model": left_profile.name, "title": left_profile.title,
            "left": {**{k: a[k] for k in ("pin", "engine", "version")},
                     "source": str(models.reports_root("reports", left_profile) / left / "routing.json")},
            "right": {**{k: b[k] for k in ("pin", "engine", "version")},
                      "source": str(models.reports_root("reports", right_profile) / right / "routing.json")},
            "serve": {"left": engines.get(left_profile.engine).serve, "right": engines.get(right_profile.engine).serve},
            "lanes": lanes, "tables": tables, "only": only}


def render(data: dict) -> str:
    return _env([]).get_template("compare.md.j2").render(c=data)


def write_compare(reports_dir: str | Path, left: str, left_profile, right: str, right_profile) -> tuple[Path, dict]:
    """Write ``reports/compare/<left>..<right>.md`` and ``.json`` (atomically); returns the markdown's path."""
    data = compare(reports_dir, left, left_profile, right, right_profile)
    folder = Path(reports_dir) / FOLDER
    stem = f"{left}..{right}" if left_profile.name == models.DEFAULT else f"{left_profile.name}--{left}..{right}"
    md = folder / f"{stem}.md"
    write_atomic(md, render(data))
    write_atomic(folder / f"{stem}.json", json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return md, data
