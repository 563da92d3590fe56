"""Render routing.json into the markdown ledger (jinja2 templates shipped as package data).

The renderer only formats: every fact comes from the routing model, which comes from evidence.
The same routing always renders the same bytes (stable ordering, no clock).
"""
from __future__ import annotations

import functools
import json
import re

import jinja2

from audit.pins.hosts import FACTS as HOST_FACTS
from probes.core.stages import NO_DEVICE_CODE
from audit import __version__, engines
from audit.report import dispatch
from audit.errors import RenderError
from audit.report.fit import fit
from audit.lanevalue import FLAGS, short, text
from audit.report.routing import EVIDENCE_LEVELS, RESOLVE_LEVELS, STAGE_MEANING, STAGE_ORDER, format_ranges
from probes.core import tiers
from audit.systems import SYSTEMS
from audit.report.verdicts import VERDICTS, grouped


def _md(text) -> str:
    """Escape a value for a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _env(layout_order: list[str]) -> jinja2.Environment:
    """The templates' environment; ``layout_order`` orders layouts in collapsed cell lists (the model's own
    layout order)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("audit.report", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["md"] = _md
    env.filters["short"] = short
    env.filters["ranges"] = format_ranges
    env.filters["cells"] = functools.partial(collapse_cells, layout_order=layout_order)
    return env


def collapse_cells(cells: list[str], audited: list[str] | None, layout_order: list[str]) -> str:
    """``system/layout`` ids, shortened: grouped by layout; a layout on every system of the audit reads "every
    audited system" (never a subset: a layout only some systems have names their SMs), a whole SM (all audited systems of one capability) reads "SM 10.0"; layouts with the same
    systems share one entry ("tp8, tp16: SM 10.0, h100_sxm")."""
    cells = [c for c in cells if c != "—/—"]  # a claim judged in no cell of this run (the row says why)
    if not cells:
        return "—"
    by_layout: dict[str, set[str]] = {}
    for c in cells:
        system, _, layout = c.partition("/")
        by_layout.setdefault(layout, set()).add(system)
    audited_by: dict[str, set[str]] = {}
    for c in audited or cells:
        system, _, layout = c.partition("/")
        audited_by.setdefault(layout, set()).add(system)
    everyone = {c.partition("/")[0] for c in audited or cells}
    order = {name: i for i, name in enumerate(SYSTEMS)}
    lay_order = {name: i for i, name in enumerate(layout_order)}

    def systems_text(layout: str, systems: set[str]) -> str:
        present = audited_by.get(layout, systems)
        if systems == everyone and len(systems) > 1:
            return "every audited system"
        parts, done = [], set()
        for name in sorted(systems, key=lambda n: order.get(n, 99)):
            if name in done:
                continue
            sm = SYSTEMS[name].sm if name in SYSTEMS else None
            family = {n for n in present if n in SYSTEMS and SYSTEMS[n].sm == sm}
            if sm is not None and len(family) > 1 and family <= systems:
                parts.append(f"SM {sm}")
                done |= family
            else:
                parts.append(name)
                done.add(name)
        return ", ".join(parts)

    grouped: dict[str, list[str]] = {}
    for layout in sorted(by_layout, key=lambda l: lay_order.get(l, 99)):
        grouped.setdefault(systems_text(layout, by_layout[layout]), []).append(layout)
    return "; ".join(f"{', '.join(layouts)}: {text}" for text, layouts in grouped.items())


def _shown(group: dict) -> str:
    """A lane group's value in words (audit/lanevalue.py); where vLLM raises on some of the batches it serves, that
    first (a server given such a batch fails); observed groups carry their own level and phase, so no row passes an
    observation off as a resolution or a capture as an eager execution."""
    value = group.get("value") if isinstance(group.get("value"), dict) else {}
    words = text(group)
    raised = value.get("raises")
    if raised:
        cause = raised["why"].split(": ", 1)[1] if tiers.refused(raised["why"]) else raised["why"]
        words = f"raises at {raised['at']}: {cause} (built: {words})"
    if "evidence" not in group:
        return words
    return f"{words} [{group['evidence']}, {group.get('phase', '?')}]"


def _levels(cell: dict) -> set[str]:
    return {g["evidence"] for gs in cell["lanes"].values() for g in gs if "evidence" in g} or {cell["evidence"]}


#: what a lane says in a cell that built no layer of its kind
NONE_BUILT = "— (none built here)"


def _lane_summary(groups: list[dict], cell: dict, read_after: bool = False) -> str:
    """``read_after``: the lane is read off the built modules once construction finished, so a stop leaves it
    unread (the layers before the stop were built; nothing read them)."""
    stopped = cell["status"] == "PARTIAL"
    failure = cell.get("failure") or {}
    if not groups and stopped and read_after:
        return (f"not read: {failure.get('stage', '?')} raised {short(failure.get('type', ''))} before the "
                f"built modules were inspected")
    if not groups:
        if stopped and failure.get("outcome") == "limit":
            return f"not built: simulation limit ({failure.get('stage', '?')} raised {short(failure.get('type', ''))})"
        if stopped:
            return f"not built: {failure.get('stage', '?')} raised {short(failure.get('type', ''))}"
        return NONE_BUILT
    # a deployment vLLM refuses at load serves nothing: what construction built is marked so
    mark = "(refused at load) " if cell.get("load_refused") else ""
    if len(groups) == 1 and not stopped:
        return mark + _shown(groups[0])
    text = "; ".join(f"{_shown(g)} (layers {g['ranges']})" for g in groups)
    return mark + (f"{text}, then construction stopped" if stopped else text)


def _load_summary(c: dict | None) -> str:
    """Whether vLLM's post-load path accepts the cell: its refusal, or how far the simulation went."""
    if c is None:
        return "not audited"
    post = c.get("postload")
    if c["status"] == "INCOMPLETE":
        return "INCOMPLETE"
    if not post:
        return "not reached: construction did not finish" if c["status"] == "PARTIAL" else "not run"
    r = c.get("load_refused")
    if r:
        where = f" (layer {r['layer']})" if r.get("layer") is not None else ""
        return f"REFUSED by vLLM{where}: {short(r['type'])}: {r['message']}"
    if not post["ran"]:
        return f"not run: {post['error']['type']}"
    if post["limit"]:
        return (f"{post['limit']} of {post['steps']} steps stopped at a simulation limit; no refusal in the "
                f"{post['ok']} that ran to the end")
    return f"simulated to the end: {post['steps']} steps, no refusal"


def _uniform(cells: list[dict], getter):
    """The value every complete cell agrees on, or None with the disagreeing values."""
    values = {json.dumps(getter(c), sort_keys=True) for c in cells if c.get("status") != "INCOMPLETE"}
    if len(values) == 1:
        return json.loads(values.pop()), []
    return None, sorted(values)


def _dispatch_refusals(cells: list[dict], profile) -> list[dict]:
    """The batches vLLM raises on (audit/report/refusals.py), grouped: {"at", "raised", "lanes", "cells"}."""
    from audit.report.refusals import cell_refusals

    out: dict[tuple, dict] = {}
    for c in cells:
        for r in cell_refusals(c, profile):
            if r["stage"] == "dispatch":
                e = out.setdefault((r["at"], r["raised"]), {"at": r["at"], "raised": r["raised"], "lanes": [],
                                                            "cells": []})
                e["cells"].append(f"{c['system']}/{c['layout']}")
                e["lanes"] += [lane for lane in r["lanes"] if lane not in e["lanes"]]
    return [out[k] for k in sorted(out)]


def glance(routing: dict, changes: dict | None, profile=None) -> dict:
    """The opening summary a reviewer reads first: what moved since the baseline, what vLLM refuses and where,
    which claim failures are new and which predate it, and how far the evidence goes (every stop counted)."""
    from audit.report.verdicts import FAILING

    cells = [c for c in routing["cells"] if c["status"] != "INCOMPLETE"]
    ids = lambda cs: [f"{c['system']}/{c['layout']}" for c in cs]  # noqa: E731
    refused_construct = [c for c in cells if c["status"] == "PARTIAL" and (c.get("failure") or {}).get("outcome") == "refused"]
    sim_construct = [c for c in cells if c["status"] == "PARTIAL" and (c.get("failure") or {}).get("outcome") != "refused"]
    raising = _dispatch_refusals(cells, profile) if profile is not None else []
    reached = [c for c in cells if c.get("postload")]
    refused_load = [c for c in reached if c.get("load_refused")]
    post_limits = [c for c in reached if not c.get("load_refused") and (c["postload"].get("limit") or not c["postload"].get("ran"))]
    stops: dict[tuple, list[str]] = {}
    for c in post_limits:
        post = c["postload"]
        for g in post.get("limits") or [{"raised_in": "post-load did not run"}]:
            k = (g.get("raised_in") or "?", ", ".join(g.get("steps") or []), g.get("count", 0), post.get("steps", 0))
            stops.setdefault(k, []).append(f"{c['system']}/{c['layout']}")
    out = {"cells": len(routing["cells"]), "refused_construct": ids(refused_construct), "sim_construct": ids(sim_construct),
           "reached": len(reached), "refused_load": ids(refused_load), "refused_dispatch": raising,
           "postload_clean": len(reached) - len(refused_load) - len(post_limits),
           # (where, the step(s) it stopped in, how many of how many steps, cells): "1 of 1279 steps", never "stopped"
           "postload_stops": [{"where": k[0], "steps": k[1], "stopped": k[2], "of": k[3], "cells": sorted(set(v))}
                              for k, v in sorted(stops.items())],
           "observed": sum(1 for c in cells if str(c.get("evidence", "")).startswith("observed")),
           "workloads": sorted({w for c in cells for w in (c.get("dispatch") or {}).get("workloads", [])},
                               key=lambda w: (w.split(" ")[0] != "decode", w.split(" ")[0],
                                              int(w.split(" ")[1]) if w.split(" ")[1:2] and w.split(" ")[1].isdigit()
                                              else 0, w)),
           "failing_now": sum(n for k, n in ((routing.get("verdicts") or {}).get("summary") or {}).items() if k in FAILING)}
    if changes and not changes.get("unavailable"):
        from audit.report.verdicts import verdict_before

        rows = changes.get("changes", [])
        verdict_rows = [r for r in rows if r["facet"] == "verdict"]
        # the diff already classed every row and every verdict turn: read them, never re-derive
        from audit.pins.hosts import label as host_label

        a, b = changes["from"].get("host") or "", changes["to"].get("host") or ""
        label = host_label(changes["from"]["pin"], a, always=a != b)
        out["since"] = {"pin": label, "anchor": "changes-since-" + re.sub(r"[^a-z0-9 -]", "", label.lower()).replace(" ", "-"),
                        "serving_rows": [r for r in rows if r.get("serving")],
                        "headline": changes.get("headline", ""),
                        "serving_cells": changes["serving_cells"],
                        "new_failures": [{**r, "before": verdict_before(changes, r)} for r in verdict_rows
                                         if r.get("turn") == "newly failing"],
                        "fixed": [r for r in verdict_rows if r.get("turn") == "no longer failing"]}
    return out


def check_model(routing: dict, profile) -> None:
    """A routing is rendered, judged and labelled in the words of its own model's profile only: the profile handed
    down must be the one the routing names (a routing that names none is refused, never read as some model's)."""
    named = routing.get("model")
    if not named:
        raise RenderError(f"this routing names no model (rendering it as {profile.name!r} would be a guess); no "
                          "report file was changed")
    if named != profile.name:
        raise RenderError(f"this routing is of the model {named!r}, not of {profile.name!r}; no report file was "
                          "changed")


def _matrices(routing: dict, cells: list[dict], systems, layouts, lane_ids, profile) -> list[dict]:
    """Per layout, one row per lane with a column per system (the "what it runs" tables)."""
    by = {(c["system"], c["layout"]): c for c in cells}
    lane_titles = routing.get("lane_titles", {})
    lane_levels = routing.get("lane_levels", {})
    read_after = routing.get("lanes_read_after_construction", ())
    out = []
    for layout in layouts:
        rows = []
        if any(by.get((s.name, layout.name), {}).get("postload") for s in systems):
            rows.append(["Weights load (post-load)"] + [
                _load_summary(by.get((s.name, layout.name))) if layout.applies_to(s) else f"n/a ({layout.scope})"
                for s in systems])
        here = [c for c in (by.get((s.name, layout.name)) for s in systems) if c is not None]
        for lane in lane_ids:
            if not any(c["lanes"].get(lane) for c in here) and any(
                    ((c.get("draft") or {}).get("lanes") or {}).get(lane) for c in here):
                continue  # only this layout's draft has the lane: its draft row says it
            level = lane_levels.get(lane, "construction")
            row = [lane_titles.get(lane, lane) + ("" if level == "construction" else f" ({level})")]
            for s in systems:
                c = by.get((s.name, layout.name))
                if c is None:
                    row.append(f"n/a ({layout.scope})" if not layout.applies_to(s) else "not audited")
                elif c["status"] == "INCOMPLETE":
                    row.append("INCOMPLETE")
                else:
                    row.append(_lane_summary(c["lanes"].get(lane, []), c, lane in read_after)
                               + dispatch.serving_mark(c, lane, profile))
            rows.append(row)
        rows += _draft_matrix_rows(by, systems, layout, lane_ids, lane_titles, read_after)
        levels = sorted(set().union(*[_levels(by[(s.name, layout.name)]) for s in systems
                                      if (s.name, layout.name) in by]))
        out.append({"layout": layout, "rows": rows, "levels": levels})
    return out


def _draft_matrix_rows(by: dict, systems, layout, lane_ids, lane_titles: dict, read_after) -> list[list[str]]:
    """A layout's speculative draft rows (its own, never under a target lane): its class, then each lane it has."""
    cells = {s.name: by.get((s.name, layout.name)) for s in systems}
    drafts = {n: c.get("draft") for n, c in cells.items() if c is not None and c.get("draft")}
    if not drafts:
        return []

    def cell(s, what) -> str:
        c = cells[s.name]
        if c is None:
            return f"n/a ({layout.scope})" if not layout.applies_to(s) else "not audited"
        if c["status"] == "INCOMPLETE":
            return "INCOMPLETE"
        return what(c.get("draft") or {})

    rows = [["Speculative draft (class, its layers)"] + [cell(s, lambda d: f"{short(d['cls'])} ({format_ranges(d['layers'])})"
                                                      if d else "— (none built)") for s in systems]]
    for lane in lane_ids:
        if any((d.get("lanes") or {}).get(lane) for d in drafts.values()):
            rows.append([f"{lane_titles.get(lane, lane)} (draft)"] + [
                cell(s, lambda d, lane=lane: _lane_summary((d.get("lanes") or {}).get(lane, []), cells[s.name],
                                                           lane in read_after)) for s in systems])
    return rows


def _family(group: dict, engine: str) -> str:
    """A group's backend family (the perf database's words) with the engine's own selector value beside it."""
    value = group.get("value") if isinstance(group.get("value"), dict) else {}
    family, backend = value.get("family") or "—", value.get("backend")
    return f"{family} ({engine}: `{backend}`)" if backend and backend.lower() != family else family


def _details(routing: dict, cells: list[dict], systems, layouts, lane_ids, profile) -> list[dict]:
    """Per system, per layout: every lane group with its layers, value, family and evidence level."""
    by = {(c["system"], c["layout"]): c for c in cells}
    lane_titles = routing.get("lane_titles", {})
    engine = engines.get(profile.engine).title
    out = []
    for s in systems:
        entries = []
        for layout in layouts:
            c = by.get((s.name, layout.name))
            if c is None:
                continue
            lanes = _lane_rows(c, c["lanes"], lane_ids, lane_titles,
                               lambda lane: dispatch.serving_mark(c, lane, profile), engine)
            draft = c.get("draft")
            if draft:  # a speculative draft's rows are its own, never under a target layer
                draft = {**draft, "rows": _lane_rows(c, draft.get("lanes") or {}, lane_ids, lane_titles, lambda _: "",
                                                     engine)}
            entries.append({"layout": layout, "cell": c, "lanes": lanes, "draft": draft})
        out.append({"system": s, "entries": entries})
    return out


def _lane_rows(c: dict, lanes: dict, lane_ids, lane_titles: dict, mark, engine: str) -> list[dict]:
    """One model's lane groups as table rows (title, layers, value, family with *engine*'s own value, evidence)."""
    rows = []
    for lane in lane_ids:
        for g in lanes.get(lane, []):
            rows.append({"title": lane_titles.get(lane, lane), "ranges": g["ranges"],
                         "value": _shown({k: v for k, v in g.items() if k != "evidence"}) + mark(lane),
                         "family": _family(g, engine),
                         "evidence": f"{g['evidence']} ({g.get('phase', '?')})" if "evidence" in g
                         else (f"{c['evidence']}, {g['level']}" if g.get("level") else c["evidence"])})
    return rows


def _across(cells: list[dict], key, each) -> list[dict]:
    """The same item (by *key*) across cells as one entry listing its cells; *each* yields a cell's items."""
    out: dict = {}
    for c in cells:
        for item in each(c):
            out.setdefault(key(item), {**item, "cells": []})["cells"].append(f"{c['system']}/{c['layout']}")
    return [out[k] for k in sorted(out, key=str)]


def _problems(cells: list[dict]) -> dict:
    """Drifted probe targets, probe errors, harness faults and the fences, across cells."""
    drift = _across(cells, lambda d: d["target"], lambda c: c["drift"])
    probe_errors = _across(cells, lambda e: (e["where"], e["type"], e["message"]), lambda c: (
        {"where": e.get("where"), "type": (e.get("error") or {}).get("type") or "",
         "message": (e.get("error") or {}).get("message") or ""} for e in c.get("probe_errors", [])))
    faults = _across(cells, lambda e: (e["piece"], e["type"], e["message"]), lambda c: c.get("harness_faults") or [])
    evidenced = [c for c in cells if c["status"] != "INCOMPLETE" or c.get("harness_faults")]
    fences = {"cells": len(evidenced), "on": sum(1 for c in evidenced if (c.get("fence") or {}).get("on")),
              "pieces": max([(c.get("fence") or {}).get("pieces", 0) for c in evidenced] or [0]),
              "faults": len(faults),
              "planted": sorted({p for c in evidenced for p in (c.get("fence") or {}).get("planted") or []})}
    return {"drift": sorted(drift, key=lambda d: d["target"]), "probe_errors": probe_errors,
            "harness_faults": faults, "fences": fences}


def _postload_limits(cells: list[dict]) -> list[dict]:
    """The places the simulation could not go further, across cells."""
    limits: dict[tuple, dict] = {}
    for c in cells:
        for g in (c.get("postload") or {}).get("limits", []):
            e = limits.setdefault((g["raised_in"], g["type"], g["message"]), {**g, "count": 0, "cells": []})
            e["count"] += g["count"]
            e["cells"].append(f"{c['system']}/{c['layout']}")
    return sorted(limits.values(), key=lambda e: (-e["count"], e["raised_in"], e["message"]))


def _declared_limits(routing: dict) -> list[dict]:
    """The declared simulation limits (audit/limits.py) the routing's cells met, with those cells."""
    from audit import limits

    known = {lim.id: lim for lim in limits.LIMITS}
    return [{"id": k, "library": known[k].library if k in known else "?",
             "versions": list(known[k].versions) if k in known else [],
             "raised_in": known[k].raised_in.strip("^$").replace("\\", "") if k in known else "?",
             "why": known[k].why if k in known else "(no longer declared)", "cells": v}
            for k, v in sorted((routing.get("declared_limits") or {}).items())]


def _environment(cells: list[dict], routing: dict, profile) -> dict:
    """What every complete cell agrees on about the environment, and what the simulation stood in for."""
    complete = [c for c in cells if c["status"] != "INCOMPLETE"]
    fingerprint, fp_diff = _uniform(complete, lambda c: c.get("fingerprint", {}))
    availability, av_diff = _uniform(complete, lambda c: c.get("availability", {}))
    why: dict[str, str] = {}
    for c in complete:
        for k, v in (c.get("availability_why") or {}).items():
            why.setdefault(k, v)
    merged: dict[str, set] = {}
    for c in complete:  # the union over cells; a value that differs per cell (e.g. world size) lists each
        for k, v in c.get("simulated", {}).items():
            merged.setdefault(k, set()).add(str(v))
    simulated = {k: "; ".join(sorted(v)) for k, v in sorted(merged.items())}
    simulated.update(dispatch.stand_ins(cells, profile))
    return {"fingerprint": {"packages": {}, "modules": {}, "tools": {}, "env": {}, "python": "?", **(fingerprint or {})},
            "fingerprint_differs": bool(fp_diff), "availability": availability or {}, "availability_why": why,
            "availability_differs": bool(av_diff), "simulated": simulated,
            "standin_fit": dict(sorted((routing.get("standin_fit") or {}).items()))}


def _verdict_view(routing: dict) -> dict:
    counts = (routing.get("verdicts") or {}).get("summary", {})
    return {"verdicts": routing.get("verdicts"),
            "verdict_groups": grouped(routing["verdicts"]["rows"]) if routing.get("verdicts") else [],
            # in the verdicts' own order (routing.json stores the counts with sorted keys)
            "verdict_counts": [(k, counts[k]) for k in VERDICTS if counts.get(k)],
            "unjudged_claims": sum(1 for r in (routing.get("verdicts") or {}).get("rows", [])
                                   if r["claim"] and r["verdict"] == "UNVERIFIED")}


def _in_words(texts: dict, engine) -> dict:
    """Shared wording written with the first engine's name, in *engine*'s."""
    if engine.name == engines.DEFAULT:
        return texts
    first = engines.get(engines.DEFAULT).title
    return {k: v.replace(first, engine.title) for k, v in texts.items()}


def view_model(routing: dict, *, profile, reproduce: str) -> dict:
    """Everything the ledger's template shows, from the routing (and the model's profile for its words)."""
    check_model(routing, profile)
    cells = routing["cells"]
    systems = [s for s in SYSTEMS.values() if any(c["system"] == s.name for c in cells)]
    layouts = [l for l in profile.layouts.values() if any(c["layout"] == l.name for c in cells)]
    lane_titles = routing.get("lane_titles", {})
    # the profile's order (kept as a list: routing.json sorts object keys); an older routing without it
    # falls back to its titles' order
    lane_ids = routing.get("lane_order") or list(lane_titles) or sorted({k for c in cells for k in c["lanes"]})
    stopped = [c for c in cells if c["status"] == "PARTIAL"]
    engine = engines.get(profile.engine)
    return {
        "title": profile.title, "routing": routing,
        # the engine's words: its name, the pin's version and build under the engine's own keys, its serve command
        "E": engine.title, "pin_version": engine.version_of(routing["pin"]),
        "run_commit": (routing.get("run") or {}).get(engine.commit_key, ""),
        "serve": engine.serve, "serve_model": engine.serve_model, "host_reads": engine.host_reads,
        "engine_levels": engine.levels,
        "pin": {"image_config_digest": "", "image_tarball": "", **routing["pin"]},
        "run": {"vllm_commit": "", "runtime": "?", "python": "", "mode": "resolve", "date": "?",
                "cuda_toolkit": "not recorded", "aborted": None, "image": None, "architecture_note": "",
                "inventory": None, "slice": None, **routing.get("run", {})},
        "harness_version": __version__, "systems": systems, "sm_families": _sm_families(systems),
        "host_facts": [f for f in HOST_FACTS if f != "cuda"], "no_device_code": NO_DEVICE_CODE,
        "claim_words": _claim_words(routing, profile), "flags": _in_words(FLAGS, engine), "layouts": layouts,
        "matrices": _matrices(routing, cells, systems, layouts, lane_ids, profile),
        "audited_cells": [f"{c['system']}/{c['layout']}" for c in cells],
        "details": _details(routing, cells, systems, layouts, lane_ids, profile),
        **_problems(cells),
        "incomplete": [c for c in cells if c["status"] == "INCOMPLETE"],
        "not_applicable": sorted({t for c in cells for t in c.get("not_applicable", [])}),
        "partial": [c for c in stopped if (c.get("failure") or {}).get("outcome") != "limit"],
        "sim_stopped": [c for c in stopped if (c.get("failure") or {}).get("outcome") == "limit"],
        "load_refused": [c for c in cells if c.get("load_refused")],
        "postload_cells": [c for c in cells if c.get("postload")],
        "postload_limits": _postload_limits(cells), "resolve_levels": RESOLVE_LEVELS,
        "declared_limits": _declared_limits(routing),
        "profiler_disagree": [c for c in cells if ((c.get("observed") or {}).get("profiler") or {}).get("disagree")],
        **_environment(cells, routing, profile),
        "memo_rejected": int((routing.get("run") or {}).get("memo_rejected", 0)),
        "levels": sorted(set().union(*[_levels(c) for c in cells])), "level_text": EVIDENCE_LEVELS,
        "stage_order": STAGE_ORDER, "stage_meaning": {**STAGE_MEANING, **engine.stage_meaning}, "reproduce": reproduce,
        **_verdict_view(routing),
        "lane_titles": lane_titles, "kind_titles": profile.kind_titles,
        "model_notes": {"glossary": (), "layer_numbers": f"Layer numbers are {engine.title}'s 0-based module indices.",
                        "candidates_of": "attention layers", "state_example": "", **profile.ledger_notes},
        # --- dispatch tiers (audit/report/dispatch.py, templates/dispatch.md.j2) ---
        "dispatch_tables": dispatch.ledger_tables(cells, profile),
        # a model whose own path serves some steps: the stock lanes' tables are not about those steps
        "dispatch_step_path": (f"; the {profile.step_path.name}'s\nown modules are not built, see its table"
                               if profile.step_path is not None else ""),
        "dispatch_errors": dispatch.stage_errors(cells), "dispatch_level": dispatch.LEVEL_TEXT,
        "dispatch_unsimulated": dispatch.unsimulated(cells),
    }


def render_ledger(routing: dict, *, profile, reproduce: str, changes: dict | None = None) -> str:
    """The ledger of *routing*, in the words of *profile* (its model's, handed down by the caller)."""
    check_model(routing, profile)
    try:
        template = _env(list(profile.layouts)).get_template("ledger.md.j2")
        return fit(template.render(**view_model(routing, profile=profile, reproduce=reproduce),
                                   changes=changes, glance=glance(routing, changes, profile)))
    except (jinja2.TemplateError, KeyError, TypeError, AttributeError, ValueError) as exc:
        raise RenderError(f"the ledger could not be rendered from this routing ({type(exc).__name__}: {exc}); "
                          "no report file was changed") from exc


def routing_json(routing: dict) -> str:
    return json.dumps(routing, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def report_files(routing: dict, *, profile, reproduce: str, changes: dict | None = None,
                 label_map: dict[str, str] | None = None) -> dict[str, str]:
    """Everything a report directory holds, rendered (nothing is written): the ledger, routing.json and
    labels.json (the perf-database labels the evidence gives, see audit.report.perflabels)."""
    from audit.report.perflabels import labels_json
    from audit.report.values import finish

    finish(routing, profile, label_map)  # the records' family and cell flags, in the claims' words
    ledger = render_ledger(routing, profile=profile, reproduce=reproduce, changes=changes)
    return {"routing.json": routing_json(routing), "ledger.md": ledger,
            "labels.json": labels_json(routing, profile, label_map)}


def _sm_families(systems) -> list[dict]:
    """``SM 9.0`` -> the audited systems it stands for in collapsed system lists."""
    out: dict[tuple, list[str]] = {}
    for s in systems:
        out.setdefault(tuple(s.capability), []).append(s.name)
    return [{"family": "SM " + ".".join(str(x) for x in k), "systems": v} for k, v in sorted(out.items())]


def _claim_words(routing: dict, profile) -> str:
    """The perf database's words (the claims' backend families) mapped to the kernels this ledger names, in one
    line: family -> its kernel sources here (from labels.json's rows, per batch where a step path serves)."""
    from audit.report.perflabels import build_labels

    words: dict[str, set[str]] = {}
    for r in build_labels(routing, profile)["rows"]:
        for entry in [r, *(r.get("by_tokens") or [])]:
            family, source = entry.get("backend"), entry.get("kernel_source")
            if family and source and family != "unknown":
                words.setdefault(family, set()).add(source)
    return "; ".join(f"`{f}`: {', '.join(f'`{k}`' for k in sorted(ks))}" for f, ks in sorted(words.items()))
