"""The routing diff between two audits (usually two pins): what moved, grouped so one upstream change reads as one
row, and what stayed the same in one line.

Works on ``routing.json`` files only (pure data in, pure data out); the same two inputs always give the same diff,
and a routing compared with itself gives an empty one. This module only collects the differences, facet by facet
(see ``audit/report/changes.py``), and groups them into rows; what each row is (a kernel change, a refusal, a tier,
information) and whether the gate fails on it is decided by the classification table there, never here.
"""
from __future__ import annotations

from audit import engines

import json
from collections import defaultdict
from pathlib import Path

from audit import standinfit
from audit.errors import RenderError, UsageError
from audit.lanevalue import cut, identity, is_inactive, short, text
from audit.profiles import MOE_LANE
from audit.report import changes as classes
from audit.report import dispatch
from audit.report.refusals import refused_stage
from audit.report.verdicts import SEVERITY, whole_lane_row
from probes.core import tiers

DIFF_SCHEMA = 2
#: what a lane with no value in an audit whose construction stopped means
NOT_BUILT = "— (not built in this audit: construction stopped)"
#: the same for a lane read off the built modules after construction: its layers before the stop were built
NOT_READ = "— (not read in this audit: construction stopped before the built modules were inspected)"
POSTLOAD_RAN = "ran to the end"
POSTLOAD_REFUSED = "refused at"
#: the facets in the order the diff's tables list rows of one rank
FACET_ORDER = ("standin", "lane", "draft", "candidates", "attention", "construction", "post-load", "probe",
               "availability", "dispatch", "evidence", "package")


class Pair:
    """Two audits of one model side by side: their cells by (system, layout), the cells both audited, which of
    those vLLM refuses in both, and how a set of cells is named (by layout, never a product of systems and
    layouts)."""

    def __init__(self, old: dict, new: dict, profile):
        self.old, self.new, self.profile = old, new, profile
        self.a = {(c["system"], c["layout"]): c for c in old["cells"]}
        self.b = {(c["system"], c["layout"]): c for c in new["cells"]}
        self.common = sorted(set(self.a) & set(self.b))
        self.audited = [f"{s}/{l}" for s, l in sorted(set(self.a) | set(self.b))]
        self.refused_both = {c for c in self.common if refused_stage(self.a[c]) and refused_stage(self.b[c])}
        self.titles = {**old.get("lane_titles", {}), **new.get("lane_titles", {})}
        self.read_after = (set(old.get("lanes_read_after_construction", ())),
                           set(new.get("lanes_read_after_construction", ())))
        self.judged = {j.lane for j in profile.judged}

    def where(self, cells) -> str:
        from audit.report.render import collapse_cells

        return collapse_cells([f"{s}/{l}" for s, l in cells], self.audited, list(self.profile.layouts))


def _check_models(old: dict, new: dict, profile) -> None:
    """Routings of two different models are refused (their lanes and layers are not the same things), and so is a
    routing of another model than *profile*'s or of none."""
    a, b = old.get("model"), new.get("model")
    if a and b and a != b:
        raise UsageError(f"cannot diff routings of two models: the audit of {_build(old)['pin']!r} is of {a!r}, "
                         f"the audit of {_build(new)['pin']!r} is of {b!r}",
                         hint=f"diff two pins of one model: serving-truth diff FROM TO --model {b} (each model's "
                              "reports live in their own directory: reports/<pin>/ for the default model, "
                              "reports/<model>/<pin>/ for the others)")
    for side in (old, new):
        named = side.get("model")
        if not named:
            raise UsageError(f"the audit of {_build(side)['pin']!r} names no model, so it cannot be diffed as "
                             f"{profile.name}'s", hint="audit that pin again with this harness")
        if named != profile.name:
            raise UsageError(f"the audit of {_build(side)['pin']!r} is of {named!r}, not of {profile.name!r}",
                             hint=f"diff its model's reports: serving-truth diff FROM TO --model {named}")


# --- the facts each facet compares (one dict per difference in one cell) ----------------------------------------
def _fact(facet: str, name: str, title: str, before: str, after: str, a: dict, b: dict, cell, layers=(), **extra):
    return {"facet": facet, "name": name, "title": title, "before": before, "after": after, "a": a, "b": b,
            "cell": cell, "layers": set(layers), **extra}


def _stopped_by(cell: dict) -> str:
    """What stopped a cell's construction: vLLM's refusal, or the simulation (a limit, or no evidence)."""
    return "refusal" if (cell.get("failure") or {}).get("outcome") == "refused" else "stop"


def _lane_side(cell: dict, groups: list[dict], lane: str, read_after: set) -> tuple[dict, str, dict]:
    """(per layer group, what a missing layer reads, what a missing layer is) of one side of a lane."""
    per_layer = {layer: g for g in groups for layer in g["layers"]}
    drifted = sorted(d["target"] for d in cell.get("drift", []))
    if cell.get("status") != "COMPLETE":
        blank = NOT_READ if lane in read_after else NOT_BUILT
        return per_layer, blank, {"state": "hidden", "by": _stopped_by(cell)}
    if drifted and not groups:
        return per_layer, f"— (not seen: probe target drifted: {', '.join(drifted)})", {"state": "absent"}
    return per_layer, "—", {"state": "absent"}


def _describe(g: dict) -> tuple[str, dict]:
    value = g.get("value") if isinstance(g.get("value"), dict) else {}
    state = "inactive" if is_inactive(value) else "active"
    return text(g), {"state": state, "identity": list(identity(value)), "kernel": value.get("kernel", ""),
                     "family": value.get("family", "")}


def _same(ta: str, da: dict, tb: str, db: dict) -> bool:
    """Two sides of a lane at one layer read the same: the same words, state and identity (its family or the
    cell's flags alone are no difference of the lane)."""
    return ta == tb and da.get("state") == db.get("state") and da.get("identity") == db.get("identity")


def _draft_lanes(cell: dict) -> dict:
    return (cell.get("draft") or {}).get("lanes") or {}


def lane_facts(p: Pair):
    """A lane's value per layer, where it differs (the target's lanes, then a speculative draft's, its own rows);
    ``unchanged`` counts the (cell, lane) pairs that do not."""
    for cell in p.common:
        a, b = p.a[cell], p.b[cell]
        older = _predates_drafts(a, b)
        if older is not None:  # its target lanes hold the draft's layers: compared without them, the draft not at all
            drafted = set(older[1].get("layers") or [])
            la, lb = (_without_layers(c["lanes"], drafted) for c in (a, b))
            yield from _model_lane_facts(p, cell, "target", la, lb)
            yield _fact("draft", "draft not recorded apart", "speculative draft", *(
                ("filed under target layers", _draft_side(b)[0]) if older[0] is a else
                (_draft_side(a)[0], "filed under target layers")), {}, {}, cell)
            continue
        for model, la, lb in (("target", a["lanes"], b["lanes"]), ("draft", _draft_lanes(a), _draft_lanes(b))):
            yield from _model_lane_facts(p, cell, model, la, lb)


def _targets_only(d: dict | None) -> dict | None:
    """A cell's dispatch tiers without a speculative draft's rows."""
    if not d:
        return d
    return {**d, "lanes": {k: [g for g in v if g.get("role", "target") == "target"] for k, v in d["lanes"].items()}}


def _predates_drafts(a: dict, b: dict) -> tuple[dict, dict] | None:
    """(the side whose routing predates drafts named apart, the other side's draft) where one side of a cell records
    a draft and the other has no ``draft`` entry at all (a routing written before: its draft's rows sit in the
    target's lanes), else None."""
    for old, new in ((a, b), (b, a)):
        if "draft" not in old and new.get("draft") and old.get("status") != "INCOMPLETE":
            return old, new["draft"]
    return None


def _without_layers(lanes: dict, layers: set) -> dict:
    """*lanes* with the groups' *layers* left out (a group left with none goes)."""
    out = {}
    for lane, groups in lanes.items():
        kept = []
        for g in groups:
            rest = [n for n in g["layers"] if n not in layers]
            if rest:
                kept.append(g if len(rest) == len(g["layers"]) else {**g, "layers": rest})
        out[lane] = kept
    return out


def _model_lane_facts(p: Pair, cell, model: str, la: dict, lb: dict):
    a, b = p.a[cell], p.b[cell]
    for lane in sorted(set(la) | set(lb)):
        before, blank_a, miss_a = _lane_side(a, la.get(lane, []), lane, p.read_after[0])
        after, blank_b, miss_b = _lane_side(b, lb.get(lane, []), lane, p.read_after[1])
        moved: dict[tuple, set] = defaultdict(set)
        sides: dict[tuple, tuple] = {}
        for layer in sorted(set(before) | set(after)):
            ta, da = _describe(before[layer]) if layer in before else (blank_a, miss_a)
            tb, db = _describe(after[layer]) if layer in after else (blank_b, miss_b)
            if not _same(ta, da, tb, db):
                k = (ta, tb, json.dumps(da, sort_keys=True), json.dumps(db, sort_keys=True))
                moved[k].add(layer)
                sides[k] = (da, db)
        yield {"facet": "_compared", "changed": bool(moved)}
        for k, layers in moved.items():
            da, db = sides[k]
            draft = model != "target"
            extra = {"draft_class": _draft_class(a, b)} if draft else {}
            title = p.titles.get(lane, lane) + (f" (speculative draft {extra['draft_class']})" if draft else "")
            yield _fact("lane", lane, title, k[0], k[1], da, db, cell, layers, experts_lane=lane == MOE_LANE,
                        judged=lane in p.judged and not draft, role=model, **extra)


def _tried_text(tried: list[dict]) -> str:
    return " → ".join(f"{t['cls']}{'' if t['supported'] else ' ✗ ' + str(t.get('reason') or '')}" for t in tried)


def _chosen(tried: list[dict]) -> str:
    """The candidate vLLM chose: the first it tried that was supported."""
    return next((str(t["cls"]) for t in tried if t.get("supported")), "")


def candidate_facts(p: Pair):
    """The candidates vLLM's oracle tried, per layer, where they differ: the target's, then a speculative draft's."""
    for cell in p.common:
        a, b = p.a[cell], p.b[cell]
        older = _predates_drafts(a, b)
        if older is not None:  # compared without the draft's layers (lane_facts says so)
            drafted = set(older[1].get("layers") or [])
            models = [("target", *(_without_layers(c.get("candidates", {}), drafted) for c in (a, b)))]
        else:
            models = [("target", a.get("candidates", {}), b.get("candidates", {})),
                      ("draft", *((c.get("draft") or {}).get("candidates") or {} for c in (a, b)))]
        for model, ca_, cb_ in models:
            yield from _candidate_facts(p, cell, model, ca_, cb_)


def _candidate_facts(p: Pair, cell, model: str, cands_a: dict, cands_b: dict):
    a, b = p.a[cell], p.b[cell]
    blank_a = NOT_BUILT if a.get("status") != "COMPLETE" else "—"
    blank_b = NOT_BUILT if b.get("status") != "COMPLETE" else "—"
    draft = model != "target"
    extra = {"role": model, "draft_class": _draft_class(a, b)} if draft else {}
    for lane in sorted(set(cands_a) | set(cands_b)):
        sides = [{layer: g["value"] for g in c.get(lane, []) for layer in g["layers"]} for c in (cands_a, cands_b)]
        moved: dict[tuple, set] = defaultdict(set)
        for layer in sorted(set(sides[0]) | set(sides[1])):
            ta = _tried_text(sides[0][layer]) if layer in sides[0] else blank_a
            tb = _tried_text(sides[1][layer]) if layer in sides[1] else blank_b
            if ta != tb:
                ca = _chosen(sides[0].get(layer, []))
                cb = _chosen(sides[1].get(layer, []))
                moved[(ta, tb, ca, cb)].add(layer)
        for (ta, tb, ca, cb), layers in moved.items():
            title = p.titles.get(lane, lane) + (f" (speculative draft {extra['draft_class']})" if draft else "")
            yield _fact("candidates", lane, title + " (candidates tried)", ta, tb, {"chosen": ca}, {"chosen": cb},
                        cell, layers, judged=lane in p.judged and not draft, **extra)


def _construction(c: dict) -> str:
    f = c.get("failure") or {}
    if c.get("status") == "COMPLETE":
        return "COMPLETE"
    return (f"{c.get('status')}: {f.get('stage', '?')} raised {str(f.get('type', '')).rsplit(':', 1)[-1]}: "
            f"{f.get('message', '')}")


def postload_state(cell: dict) -> tuple[str, str]:
    """How far vLLM's post-load path went in a cell: (state, in words). A refusal names vLLM's function and message;
    a stop at a simulation limit says how many of the steps stopped there."""
    post = cell.get("postload")
    if not post:
        return "not-run", "not run" + (" (construction did not finish)" if cell.get("status") != "COMPLETE" else "")
    refused = post.get("refused_at")
    if refused:
        return "refused", (f"{POSTLOAD_REFUSED} {refused.get('step')}: {refused.get('function')} raised "
                           f"{str(refused.get('type', '')).rsplit(':', 1)[-1]}: {refused.get('message')}")
    limits = post.get("limits") or []
    if limits:
        first = limits[0]
        stopped = sum(g.get("count", 0) for g in limits)
        return "limit", (f"{stopped} of {post.get('steps', 0)} steps stopped at a simulation limit "
                         f"({', '.join(first.get('steps') or []) or '?'}): {first.get('raised_in')}: "
                         f"{cut(first.get('message', ''), 160)}")
    if not post.get("ran"):
        err = post.get("error") or {}
        return "did-not-run", f"did not run: {err.get('type', '')}: {err.get('message', '')}"
    return "ran", f"{POSTLOAD_RAN} ({post.get('steps', 0)} steps)"


def _attention(c: dict) -> tuple[str, list]:
    ac = c.get("attention_candidates") or {}
    valid = [v["backend"] for v in ac.get("valid", [])]
    rejected = "; ".join(f"{r['backend']} ✗ {' / '.join(map(str, r['reasons']))}" for r in ac.get("rejected", []))
    words = " | ".join(x for x in (f"valid: {', '.join(valid)}" if valid else "",
                                   f"rejected: {rejected}" if rejected else "") if x) or "—"
    return words, valid


def _text(value) -> str:
    if value is None or value == {} or value == []:
        return "—"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    return str(value)


def _probe_lists(c: dict) -> dict[str, list]:
    return {"probe drift": sorted(d["target"] for d in c.get("drift", [])),
            "probe errors": sorted(f"{e.get('where')}: {(e.get('error') or {}).get('type')}: "
                                   f"{(e.get('error') or {}).get('message')}" for e in c.get("probe_errors", []))}


def cell_facts(p: Pair):
    """Everything else a reviewer cares about in a cell: how far construction and post-load went, its evidence
    level, the attention backends vLLM found valid, drifted probe targets and probe errors, vLLM's availability
    answers and the package versions of the environment."""
    for cell in p.common:
        a, b = p.a[cell], p.b[cell]
        stages = {"refused_stage": refused_stage(a)}, {"refused_stage": refused_stage(b)}
        if _construction(a) != _construction(b):
            yield _fact("construction", "construction", "construction", _construction(a), _construction(b),
                        {**stages[0], "refused": (a.get("failure") or {}).get("outcome") == "refused"},
                        {**stages[1], "refused": (b.get("failure") or {}).get("outcome") == "refused"}, cell)
        if a.get("evidence") != b.get("evidence"):
            yield _fact("evidence", "evidence", "evidence", str(a.get("evidence")), str(b.get("evidence")), {}, {},
                        cell)
        (wa, va), (wb, vb) = _attention(a), _attention(b)
        if wa != wb:
            yield _fact("attention", "attention candidates", "attention candidates", wa, wb, {"valid": va},
                        {"valid": vb}, cell)
        (sa, pa), (sb, pb) = postload_state(a), postload_state(b)
        if pa != pb:
            yield _fact("post-load", "post-load", "post-load", pa, pb,
                        {**stages[0], "state": sa, "refused": sa == "refused"},
                        {**stages[1], "state": sb, "refused": sb == "refused"}, cell)
        la, lb = _probe_lists(a), _probe_lists(b)
        for name in la:
            if la[name] != lb[name]:
                yield _fact("probe", name, name, _text(la[name]), _text(lb[name]), {}, {}, cell)
        if _predates_drafts(a, b) is None:  # else lane_facts says the draft is not compared
            yield from _draft_facts(a, b, cell)
        yield from _answers(a, b, cell)


def _draft_class(a: dict, b: dict) -> str:
    """The class of a cell's speculative draft, short (the newer side's where both built one)."""
    names = [short((c.get("draft") or {}).get("cls")) for c in (b, a)]
    return next((n for n in names if n), "")


def _draft_side(c: dict) -> tuple[str, str]:
    """(class and layers, shared modules) of a cell's speculative draft, in words; "—" where it built none."""
    d = c.get("draft")
    if not d:
        return "—", "—"
    layers = _ranges(d.get("layers") or []) or "none"
    return (f"{short(d.get('cls'))} (layers {layers})",
            ", ".join(f"{x} = target {y}" for x, y in d.get("shares") or []) or "none")


def _draft_facts(a: dict, b: dict, cell):
    """A speculative draft that is another class, numbers its layers otherwise, or holds other target modules."""
    if a.get("status") != "COMPLETE" or b.get("status") != "COMPLETE":
        return  # how far construction went is its own row
    (ca, sa), (cb, sb) = _draft_side(a), _draft_side(b)
    if ca != cb:
        yield _fact("draft", "draft class", "speculative draft", ca, cb, {}, {}, cell)
    if sa != sb:
        yield _fact("draft", "draft shares", "target modules the draft holds", sa, sb, {}, {}, cell)


def _answers(a: dict, b: dict, cell):
    """vLLM's availability answers (one audit not recording an answer its harness did not ask yet is no change)
    and package versions (a package one environment lacks is one)."""
    for facet, group, title in (("availability", "availability", "vLLM availability"), ("package", "fingerprint",
                                                                                          "package")):
        da, db = a.get(group) or {}, b.get(group) or {}
        if group == "fingerprint":
            da, db = da.get("packages") or {}, db.get("packages") or {}
        if not da or not db:  # a cell without the record (INCOMPLETE) is stated by the construction row
            continue
        for name in sorted(set(da) & set(db) if facet == "availability" else set(da) | set(db)):
            if da.get(name) != db.get(name):
                yield _fact(facet, f"{title}: {name}", f"{title}: {name}", _text(da.get(name)), _text(db.get(name)),
                            {}, {}, cell)


def _tier_side(choice: str, step_path, cell: dict) -> dict:
    if choice == NOT_BUILT:
        return {"state": "hidden", "by": _stopped_by(cell), "choice": choice}
    return {"state": "absent" if choice.startswith("—") else "inactive" if tiers.inactive(choice) else "active",
            "choice": choice, "refused": tiers.refused(choice), "annotates": tiers.annotated(choice),
            "step_path": bool(step_path is not None and tiers.takes_step_path(choice, step_path.name))}


def dispatch_facts(p: Pair):
    """Per-call choices that moved; a cell one audit built and the other did not (construction stopped there) has its
    tiers appear or go against "not built"; an audit that resolved no tiers anywhere (an older report) says
    nothing."""
    titles = dispatch.lane_titles(p.profile)
    has = [any(c.get("dispatch") for c in r.get("cells", [])) for r in (p.old, p.new)]
    for cell in p.common:
        da, db = p.a[cell].get("dispatch"), p.b[cell].get("dispatch")
        if _predates_drafts(p.a[cell], p.b[cell]) is not None:  # the older side numbers its draft rows otherwise
            da, db = (_targets_only(x) for x in (da, db))
        if da is None and db and p.a[cell].get("status") != "COMPLETE" and has[0]:
            da = {"workloads": db.get("workloads", []), "lanes": {}, "absent": NOT_BUILT}
        if db is None and da and p.b[cell].get("status") != "COMPLETE" and has[1]:
            db = {"workloads": da.get("workloads", []), "lanes": {}, "absent": NOT_BUILT}
        for m in dispatch.diff_cells(da, db, p.profile):
            group = f" · `{m['group']}`" if m["group"] else ""
            cls = _draft_class(p.a[cell], p.b[cell]) if m["role"] != "target" else ""
            draft = f" (speculative draft {cls})" if m["role"] != "target" else ""
            yield _fact("dispatch", m["lane"], f"{titles.get(m['lane'], m['lane'])}{group}{draft} at {m['span']}",
                        m["before"], m["after"], _tier_side(m["before"], p.profile.step_path, p.a[cell]),
                        _tier_side(m["after"], p.profile.step_path, p.b[cell]), cell, m["layers"], role=m["role"],
                        workloads=m["workloads"], **({"draft_class": cls} if cls else {}))


def standin_facts(p: Pair):
    """How each stand-in fitted each release (a fact of the run, not of a cell): a row where its status differs
    (fits, a misfit the harness declares changes nothing, a misfit, absent), or where it misfits both (the table
    decides); a stand-in that fits both releases is no difference, whatever versions its words name."""
    fa, fb = p.old.get("standin_fit") or {}, p.new.get("standin_fit") or {}
    for piece in sorted(set(fa) | set(fb)):
        sa, sb = standinfit.status(piece, fa.get(piece)), standinfit.status(piece, fb.get(piece))
        if sa != sb or (sa == "misfit" and fa.get(piece) != fb.get(piece)):
            yield {"facet": "standin", "name": piece, "title": f"stand-in: {piece}", "before": fa.get(piece, "—"),
                   "after": fb.get(piece, "—"), "a": {"state": sa}, "b": {"state": sb}, "cell": None, "layers": set()}


# --- rows: facts grouped, classed, ordered ----------------------------------------------------------------------
def _ranges(layers) -> str:
    """Layer ranges; a model-level lane (layer -1: the model's own step or hook) reads "model"."""
    from audit.report.layers import format_ranges

    layers = set(layers)
    text_ = format_ranges(sorted(layers - {-1}))
    return ", ".join(x for x in (("model" if -1 in layers else ""), text_) if x)


def group_rows(facts: list[dict], p: Pair) -> list[dict]:
    """One row per (facet, lane or field, title, before, after, sides): the cells it touched and the layers."""
    rows: dict[tuple, dict] = {}
    for f in facts:
        k = (f["facet"], f["name"], f["title"], f["before"], f["after"], json.dumps([f["a"], f["b"]], sort_keys=True),
             f.get("role", "target"), f["facet"] in classes.REFUSAL_FACETS and f["cell"] in p.refused_both)
        row = rows.setdefault(k, {key_: v for key_, v in f.items() if key_ not in ("cell", "layers", "workloads")}
                              | {"cells": set(), "layers": set(), "workloads": {}})
        if f["cell"] is not None:  # a fact of the whole run (a stand-in's fit) names no cell
            row["cells"].add(f["cell"])
        row["layers"].update(f["layers"])
        if f.get("workloads"):
            row["workloads"].setdefault(f["cell"][1], set()).update(f["workloads"])
    out = []
    for row in rows.values():
        cells = sorted(row["cells"])
        lane_like = row["facet"] in ("lane", "candidates", "dispatch")
        draft = row.get("role", "target") != "target"
        out.append({**row, "lane": row["name"] if lane_like else "", "field": "" if lane_like else row["name"],
                    "cells": [list(c) for c in cells], "where": p.where(cells) if cells else "the whole audit",
                    "systems": sorted({c[0] for c in cells}), "layouts": sorted({c[1] for c in cells}),
                    "layers": (("draft layers " if draft else "") + _ranges(row["layers"])) if row["layers"] else "",
                    "workloads": {k: sorted(v, key=dispatch.workload_order) for k, v in sorted(row["workloads"].items())},
                    "refused_both": row["facet"] in classes.REFUSAL_FACETS and set(cells) <= p.refused_both})
    return out


def _worst_verdicts(routing: dict) -> dict[tuple, str]:
    """(claim, system, layout, lane, workload) -> its most severe verdict over the lane's layer groups, with what
    runs there ("MISMATCH (humming)"), so a verdict that stays the same against another backend still shows
    (workload: a claim's ``at``, empty for a claim about every batch size)."""
    worst: dict[tuple, tuple[int, str, set]] = {}
    for r in (routing.get("verdicts") or {}).get("rows", []):
        k = (r["claim"], r["system"], r["layout"], r["lane"], r.get("at", ""))
        rank = SEVERITY.index(r["verdict"])
        if k not in worst or rank < worst[k][0]:
            worst[k] = (rank, r["verdict"], set())
        if rank == worst[k][0] and r.get("actual"):
            worst[k][2].add(r["actual"])
    return {k: verdict + (f" ({', '.join(sorted(actual))})" if actual else "")
            for k, (_, verdict, actual) in worst.items()}


def _failing(verdict_text: str) -> bool:
    from audit.report.verdicts import FAILING

    return verdict_text.split(" ", 1)[0] in FAILING


def verdict_rows(p: Pair, served_cells: set) -> list[dict]:
    """One row per (claim, before, after) verdict change in the cells both audited (when both were judged), with the
    batch sizes per layout; its turn (newly failing, no longer failing) and why."""
    va, vb = _worst_verdicts(p.old), _worst_verdicts(p.new)
    if not (va and vb):
        return []
    grouped: dict[tuple, dict] = {}
    for k in sorted(set(va) | set(vb)):
        cell = (k[1], k[2])
        if cell not in p.a or cell not in p.b:
            continue
        before, after = va.get(k, "—"), vb.get(k, "—")
        if not k[0] and not _failing(before) and not _failing(after):
            continue  # a lane no claim covers, unjudged on both sides: what serves it shows in the kernel rows
        if before != after:
            row = grouped.setdefault((k[0] or "(no claim)", before, after), {"cells": set(), "at": {}})
            row["cells"].add(cell)
            if k[4]:
                row["at"].setdefault(cell[1], set()).add(k[4])
    rows = []
    for (claim, before, after), g in sorted(grouped.items()):
        cells = sorted(g["cells"])
        rows.append({"facet": "verdict", "lane": "", "field": claim, "title": claim, "before": before, "after": after,
                     "cells": [list(c) for c in cells], "where": p.where(cells), "layers": "",
                     "systems": sorted({c[0] for c in cells}), "layouts": sorted({c[1] for c in cells}),
                     "at": {lay: sorted(ws, key=dispatch.workload_order) for lay, ws in sorted(g["at"].items())}})
    _turns(rows, served_cells)
    return classes.classify_all(rows, engines.get(p.profile.engine).title)


def _turns(rows: list[dict], served_cells: set) -> None:
    """A verdict row's turn: newly failing or no longer failing, and whether serving changed under it. A claim judged
    per batch now and for the whole lane before turns against the whole lane's verdict before (that row then turns
    nowhere: its per-batch rows carry the story)."""
    replaced = set()
    for r in rows:
        whole = whole_lane_row(rows, r) if r["before"] == "—" and r["after"] != "—" else None
        was, now = _failing(whole["before"] if whole else r["before"]), _failing(r["after"])
        if whole is not None:
            replaced.add(id(whole))
        r["turn"] = "newly failing" if now and not was else "no longer failing" if was and not now else ""
    for r in rows:
        if id(r) in replaced:
            r["turn"] = ""
        moved_here = {tuple(c) for c in r["cells"]} & served_cells
        if r["turn"] == "no longer failing":
            # a claim that passes now because serving changed under it is no fix of the claim: say so
            r["because"] = ("claim now true because serving changed" if moved_here else
                            "serving did not change in these cells: the claim or the harness changed")
        elif r["turn"] == "newly failing":
            r["because"] = ("serving changed" if moved_here else
                            "serving did not change in these cells: the claim or the harness changed")


def diff_routings(old: dict, new: dict, profile) -> dict:
    """Compare two routing models of one model, *profile*'s (handed down by the caller): every difference, facet by
    facet, grouped into rows and classed by the table (audit/report/changes.py); then the verdicts that moved."""
    _check_models(old, new, profile)
    from audit.report.values import finish

    # what a lane value takes from its audit (its family, refused, raises-at-dispatch) is read on both sides as the
    # written report has it: an audit diffs its routing before writing it, a re-render after reading it back
    for side in (old, new):
        finish(side, profile, (side.get("verdicts") or {}).get("label_map"))
    p = Pair(old, new, profile)
    facts = [*standin_facts(p), *lane_facts(p), *candidate_facts(p), *cell_facts(p), *dispatch_facts(p)]
    compared = [f for f in facts if f["facet"] == "_compared"]
    rows = classes.classify_all(group_rows([f for f in facts if f["facet"] != "_compared"], p),
                                engines.get(profile.engine).title)
    rows.sort(key=lambda r: (classes.order_key(r), FACET_ORDER.index(r["facet"])))
    served = {tuple(c) for r in rows if r["serving"] for c in r["cells"]}
    verdicts = verdict_rows(p, served)
    only_old = sorted(set(p.a) - set(p.b))
    only_new = sorted(set(p.b) - set(p.a))
    d = {"schema": DIFF_SCHEMA, "model": profile.name, "from": _build(old), "to": _build(new),
         # the engine, for every engine but the first (whose diffs name none)
         **({"engine": profile.engine} if profile.engine != engines.DEFAULT else {}),
         "changes": rows + verdicts, **classes.tally(rows),
         "newly_failing": sum(1 for c in verdicts if c["turn"] == "newly failing"),
         "no_longer_failing": sum(1 for c in verdicts if c["turn"] == "no longer failing"),
         "now_true_by_serving": sum(1 for c in verdicts if c.get("because") == "claim now true because serving changed"),
         "unchanged_lanes": sum(1 for f in compared if not f["changed"]), "compared_lanes": len(compared),
         "cells_compared": len(p.common), "only_in_from": [list(c) for c in only_old],
         "only_in_to": [list(c) for c in only_new],
         "empty": not rows and not verdicts and not only_old and not only_new}
    d["headline"] = classes.headline(d)
    # the environments compared differ in these packages (every audited cell's fingerprint; information rows)
    d["packages"] = sorted({(r["field"].split(": ", 1)[1], r["before"], r["after"])
                            for r in rows if r["facet"] == "package"})
    # the host facts vLLM read that differ between the sides (a host diff: every serving row depends on them)
    from audit.pins.hosts import differences

    d["hosts"] = [list(x) for x in differences((old.get("run") or {}).get("host"), (new.get("run") or {}).get("host"))]
    d["labels"] = [side_label(d["from"], d["to"]), side_label(d["to"], d["from"])]
    from audit.report.summary import pr_summary

    d["summary"] = pr_summary(d, old, new, profile)
    return d


def _build(routing: dict) -> dict:
    """Which build an audit is of: the pin, its engine's version and commit (under the engine's own keys), and the
    wheel's (or image's) identity, so two builds with the same version and file name and different bytes are told
    apart."""
    pin = routing.get("pin") or {}
    host = (routing.get("run") or {}).get("host") or {}
    e = engines.of_doc(pin)
    return {"pin": pin.get("name"), e.version_key: pin.get(e.version_key), e.commit_key: pin.get(e.commit_key, ""),
            "wheel": pin.get("wheel", ""), "wheel_sha256": pin.get("wheel_sha256", ""),
            "image_config_digest": pin.get("image_config_digest", ""),
            # the host vLLM was audited as running on (audit/pins/hosts.py); "" for an audit that recorded none
            "host": host.get("name", ""), "host_title": host.get("title", "")}


def side_label(build: dict, other: dict | None = None) -> str:
    """How a diff names one side (:func:`audit.pins.hosts.label`), naming the host whenever *other* has another."""
    from audit.pins.hosts import label

    host = build.get("host") or ""
    return label(build["pin"], host, always=other is not None and host != (other.get("host") or ""))


def load_routing(reports_dir: Path, pin: str, profile=None) -> dict:
    """A committed audit's routing.json, checked for what the diff and the gate read; a schema 2 routing (lane values
    as sentences) is upgraded to records when *profile* is given (its model's words are needed to read them)."""
    from audit.fsutil import report_dir_for

    path = report_dir_for(reports_dir, pin) / "routing.json"
    return read_routing(path, pin=pin, reports_dir=reports_dir, profile=profile)


def read_routing(path: Path, *, pin: str = "", reports_dir=None, profile=None) -> dict:
    """routing.json at *path*, checked (see :func:`load_routing`)."""
    from audit.lanevalue import ROUTING_SCHEMA

    hint_audit = f"make audit PIN={pin}" + ("" if str(reports_dir or "reports") == "reports" else f" REPORTS={reports_dir}")
    from audit.fsutil import read_regular

    try:
        data = json.loads(read_regular(path))
    except FileNotFoundError:
        raise UsageError(f"no audit of {pin!r}: {path} does not exist",
                         hint=f"audit it into that reports directory first: {hint_audit}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}",
                         hint=f"a routing.json is a file an audit wrote: audit it again: {hint_audit}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or not isinstance(data.get("pin"), dict):
        raise UsageError(f"{path} is not a routing.json written by this harness (expected an object with "
                         "'pin' and 'cells')", hint=f"audit it again: {hint_audit}")
    for i, cell in enumerate(data["cells"]):  # what the diff and the gate read of every cell
        missing = [k for k, t in (("system", str), ("layout", str), ("status", str), ("lanes", dict))
                   if not isinstance(cell, dict) or not isinstance(cell.get(k), t)]
        if missing:
            raise UsageError(f"{path}: cell {i + 1} has no valid {', '.join(repr(k) for k in missing)}: not a "
                             "routing.json this harness wrote, or one edited since",
                             hint=f"render it again from its run (serving-truth regenerate --pins {pin} --from-runs) "
                                  f"or audit it again: {hint_audit}")
    if data.get("schema") == 2 and profile is not None and data.get("model") in (None, profile.name):
        from audit.report.values import upgrade

        return upgrade(data, profile)
    if data.get("schema") != ROUTING_SCHEMA:
        raise UsageError(f"{path} has routing schema {data.get('schema')!r}; this harness reads {ROUTING_SCHEMA}"
                         " (and upgrades 2)",
                         hint=f"render it again from its newest run (no vLLM needed): serving-truth regenerate "
                              f"--pins {pin} --from-runs --reports {reports_dir or 'reports'}; or audit it again: "
                              f"{hint_audit}")
    return data


def render_diff(d: dict, profile) -> str:
    """The markdown diff, in the words of the diffed model's *profile* (the one ``d["model"]`` names)."""
    from audit.report.fit import fit
    from audit.report.render import _env

    if d.get("model") != profile.name:
        raise RenderError(f"this diff is of the model {d.get('model')!r}, not of {profile.name!r}; no report file "
                          "was changed")
    d = {"hosts": [], "labels": [side_label(d["from"], d["to"]), side_label(d["to"], d["from"])], **d}
    e = engines.get(profile.engine)
    return fit(_env(list(profile.layouts)).get_template("diff.md.j2").render(
        d=d, model_title=profile.title, kinds=classes.KINDS, E=e.title, vkey=e.version_key, ckey=e.commit_key))


def write_diff(reports_dir: Path, from_pin: str, to_pin: str, profile,
               d: dict | None = None, *, name: str | None = None) -> tuple[Path, Path, dict]:
    """Render reports/diffs/<from>..<to>.md and .json of *profile*'s model (both rendered before either is
    replaced); *d* is the diff when the caller computed it already; *name* the files' name when it is not
    ``<from>..<to>`` (a host diff: ``<pin>@image..<pin>@<host>``)."""
    from audit.fsutil import report_dir_for, write_all_atomic

    for pin in (from_pin, to_pin):
        report_dir_for(reports_dir, pin)  # names that are no plain directory name never reach a path
    if d is None:
        d = diff_routings(load_routing(reports_dir, from_pin, profile), load_routing(reports_dir, to_pin, profile),
                          profile)
    out = Path(reports_dir) / "diffs"
    stem = name or f"{from_pin}..{to_pin}"
    md, js = out / f"{stem}.md", out / f"{stem}.json"
    write_all_atomic({js: json.dumps(d, indent=1, sort_keys=True, ensure_ascii=False) + "\n", md: render_diff(d, profile)})
    return md, js, d
