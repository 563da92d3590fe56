"""The routing diff between two audits (usually two pins): what moved, grouped so one upstream
change reads as one row, and what stayed the same in one line.

Works on ``routing.json`` files only (pure data in, pure data out); the same two inputs always give
the same diff, and a routing compared with itself gives an empty one.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from audit.report import dispatch
from audit.report.perflabels import refusal
from audit.report.verdicts import SEVERITY, whole_lane_row
from audit.errors import RenderError, UsageError

DIFF_SCHEMA = 1


def _per_layer(groups: list[dict]) -> dict[int, object]:
    return {layer: g["value"] for g in groups for layer in g["layers"]}


def _identities(groups: list[dict]) -> dict[str, str]:
    """value -> what of it decides serving (a group's ``identity``, written where a reading's value carries a note
    beside the serving fact; else the value itself)."""
    return {g["value"]: g.get("identity", g["value"]) for g in groups}


def _tried_text(tried: list[dict]) -> str:
    return " → ".join(f"{t['cls']}{'' if t['supported'] else ' ✗ ' + str(t.get('reason') or '')}" for t in tried)


def _ranges(layers) -> str:
    """Layer ranges; a model-level lane (layer -1: the specialized decode, the model's own hook) reads "model"."""
    from audit.report.routing import format_ranges

    layers = set(layers)
    model = -1 in layers
    text = format_ranges(sorted(layers - {-1}))
    return ", ".join(x for x in (("model" if model else ""), text) if x)


#: what a lane with no value in an audit whose construction stopped means
NOT_BUILT = "— (not built in this audit: construction stopped)"
#: the same for a lane read off the built modules after construction: its layers before the stop were built
NOT_READ = "— (not read in this audit: construction stopped before the built modules were inspected)"


def diff_routings(old: dict, new: dict, profile) -> dict:
    """Compare two routing models of one model, *profile*'s (handed down by the caller). Rows group identical
    (lane, before, after) changes; routings of two different models are refused (their lanes and layers are not the
    same things), and so is a routing of another model than *profile*'s or of none."""
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
    titles = {**old.get("lane_titles", {}), **new.get("lane_titles", {})}
    old_cells = {(c["system"], c["layout"]): c for c in old["cells"]}
    new_cells = {(c["system"], c["layout"]): c for c in new["cells"]}
    common = sorted(set(old_cells) & set(new_cells))
    read_after_a = set(old.get("lanes_read_after_construction", ()))
    read_after_b = set(new.get("lanes_read_after_construction", ()))
    path_changes: dict[tuple, dict] = {}
    note_only: set[tuple] = set()  # (lane, before, after) whose serving identity is the same on both sides
    cand_changes: dict[tuple, dict] = {}
    chosen: dict[str, str] = {}  # a candidates text -> the candidate vLLM chose in it
    cell_changes: dict[tuple, dict] = {}
    cell_reasons: dict[tuple, str] = {}  # a cell row -> why it is information ("" or absent: it decides serving)
    unchanged = 0
    compared = 0

    def add(bucket, key, cell, layers=()):
        row = bucket.setdefault(key, {"cells": set(), "layers": set()})
        row["cells"].add(cell)
        row["layers"].update(layers)

    def state(c: dict) -> str:
        f = c.get("failure") or {}
        if c.get("status") == "COMPLETE":
            return "COMPLETE"
        return f"{c.get('status')}: {f.get('stage', '?')} raised {str(f.get('type', '')).rsplit(':', 1)[-1]}: {f.get('message', '')}"

    for cell in common:
        a, b = old_cells[cell], new_cells[cell]
        if state(a) != state(b):
            add(cell_changes, ("construction", state(a), state(b)), cell)
        for field in ("evidence",):
            if a.get(field) != b.get(field):
                add(cell_changes, (field, str(a.get(field)), str(b.get(field))), cell)
                cell_reasons[(field, str(a.get(field)), str(b.get(field)))] = "the evidence level (the ledger says which)"
        for field, before, after, why in _cell_facts(a, b):
            add(cell_changes, (field, before, after), cell)
            if why:
                cell_reasons[(field, before, after)] = why
        # where construction stops in one audit and not the other, the lanes past the stop appear or disappear:
        # each is a change of what the cell runs, shown with what it runs now (never folded into "unchanged")
        gone_a, gone_b = _absent(a), _absent(b)
        blank_a = NOT_BUILT if a.get("status") != "COMPLETE" else "—"
        blank_b = NOT_BUILT if b.get("status") != "COMPLETE" else "—"
        for lane in sorted(set(a["lanes"]) | set(b["lanes"])):
            before, after = _per_layer(a["lanes"].get(lane, [])), _per_layer(b["lanes"].get(lane, []))
            ids = {**_identities(a["lanes"].get(lane, [])), **_identities(b["lanes"].get(lane, []))}
            if not before and gone_a:
                before = {layer: gone_a for layer in after}
            if not after and gone_b:
                after = {layer: gone_b for layer in before}
            compared += 1
            moved = defaultdict(set)
            la = NOT_READ if blank_a == NOT_BUILT and lane in read_after_a else blank_a
            lb = NOT_READ if blank_b == NOT_BUILT and lane in read_after_b else blank_b
            for layer in sorted(set(before) | set(after)):
                va, vb = before.get(layer, la), after.get(layer, lb)
                if va != vb:
                    moved[(va, vb)].add(layer)
            if not moved:
                unchanged += 1
            for (va, vb), layers in moved.items():
                add(path_changes, (lane, va, vb), cell, layers)
                if va in ids and vb in ids and ids[va] == ids[vb]:
                    note_only.add((lane, va, vb))
        for lane in sorted(set(a.get("candidates", {})) | set(b.get("candidates", {}))):
            before = {layer: _tried_text(g["value"]) for g in a.get("candidates", {}).get(lane, []) for layer in g["layers"]}
            after = {layer: _tried_text(g["value"]) for g in b.get("candidates", {}).get(lane, []) for layer in g["layers"]}
            for c in (a, b):
                for g in c.get("candidates", {}).get(lane, []):
                    chosen[_tried_text(g["value"])] = _chosen(g["value"])
            moved = defaultdict(set)
            for layer in sorted(set(before) | set(after)):
                va, vb = before.get(layer, blank_a), after.get(layer, blank_b)
                if va != vb:
                    moved[(va, vb)].add(layer)
            for (va, vb), layers in moved.items():
                add(cand_changes, (lane, va, vb), cell, layers)

    # a cell vLLM refuses in both audits serves nothing in either: what moved inside it (where the refusal
    # happens, lanes built before it) is shown, and is not a change of how the model is served
    refused_both = {cell for cell in common if refusal(old_cells[cell]) and refusal(new_cells[cell])}

    # --- dispatch tiers (audit/report/dispatch.py): a per-call choice that moved at some token counts ---
    dispatch_changes: dict[tuple, dict] = {}
    for cell in common:
        da, db = old_cells[cell].get("dispatch"), new_cells[cell].get("dispatch")
        # a cell one audit built and the other did not (construction stopped there): its tiers appear or go,
        # compared against "not built"; an audit that resolved no tiers anywhere (an older report) says nothing
        if da is None and db and old_cells[cell].get("status") != "COMPLETE" and _has_dispatch(old):
            da = {"workloads": db.get("workloads", []), "lanes": {}, "absent": NOT_BUILT}
        if db is None and da and new_cells[cell].get("status") != "COMPLETE" and _has_dispatch(new):
            db = {"workloads": da.get("workloads", []), "lanes": {}, "absent": NOT_BUILT}
        for what, before, after, layers in dispatch.diff_cells(da, db, profile):
            add(dispatch_changes, (what, before, after), cell, layers)

    def information(kind: str, key: tuple) -> str:
        """Why a change row is information (not a change of which kernel serves), or "" for a serving change."""
        field, before, after = key
        if kind == "verdict":
            return "verdict"
        if kind == "path":
            if (field, before, after) in note_only:
                return "the same serving value; only its note differs"
            if before == "—" and _inactive(after):
                return "a lane newly read that takes nothing"
            if after == "—" and _inactive(before):
                return "a lane no longer read that took nothing"
            return ""
        if kind == "candidates":
            if chosen.get(before) and chosen.get(before) == chosen.get(after):
                return f"the same candidate chosen ({chosen[before]}); only the others or their reasons differ"
            return ""
        if kind == "dispatch":
            if before == "—" and _inactive(after):
                return "a per-call lane newly read that takes nothing"
            if after.startswith(before + ": ") and _inactive(after[len(before) + 2:]):
                return "the same step; newly annotated with a path that does not take it"
            return ""
        return cell_reasons.get(key, "")

    def rows(bucket, kind):
        out = []
        for key, row in bucket.items():
            cells = sorted(row["cells"])
            lane_like = kind in ("path", "candidates")
            in_both = set(cells) <= refused_both
            why = "refused in both builds: serves nothing in either" if in_both else information(kind, key)
            out.append({"kind": kind, "lane": key[0] if lane_like else "", "field": "" if lane_like else key[0],
                        "title": titles.get(key[0], key[0]) if lane_like else key[0],
                        "before": key[1], "after": key[2],
                        "cells": [list(c) for c in cells],
                        "where": where(cells),
                        "systems": sorted({c[0] for c in cells}), "layouts": sorted({c[1] for c in cells}),
                        "layers": _ranges(row["layers"]) if row["layers"] else "",
                        "class": "information" if why else _klass(kind, key[0], key[1], key[2]),
                        "information": why,
                        "serving": not why,
                        "refused_in_both": in_both})
        return sorted(out, key=lambda r: (r["lane"] or r["field"], r["before"], r["after"]))

    audited = [f"{s}/{l}" for s, l in sorted(set(old_cells) | set(new_cells))]

    def where(cells) -> str:
        """The cells a row touched, by layout (never a systems x layouts product): a whole SM reads "SM 10.0"."""
        from audit.report.render import collapse_cells

        return collapse_cells([f"{s}/{l}" for s, l in cells], audited, list(profile.layouts))

    # the availability answers a cell changed count as serving where something in that cell changed serving
    # with them (the answer decided a selection); alone they are information
    availability_only = {key for key in cell_changes if key[0].startswith("vLLM availability: ")}
    changes = (rows(path_changes, "path") + rows(cand_changes, "candidates")
               + rows({k: v for k, v in cell_changes.items() if k not in availability_only}, "cell")
               + rows(dispatch_changes, "dispatch"))
    served_cells = {tuple(c) for r in changes if r["serving"] for c in r["cells"]}
    for r in rows({k: v for k, v in cell_changes.items() if k in availability_only}, "cell"):
        if r["serving"] and not {tuple(c) for c in r["cells"]} & served_cells:
            r.update({"serving": False, "class": "information",
                      "information": "an availability answer that changed no selection in its cells"})
        changes.append(r)
        if r["serving"]:
            served_cells.update(tuple(c) for c in r["cells"])

    # verdict changes (when both audits were judged), one row per (claim, lane, before, after)
    verdict_changes: dict[tuple, dict] = {}
    va, vb = _worst_verdicts(old), _worst_verdicts(new)
    if va and vb:
        in_both = set(common)
        for key in sorted(set(va) | set(vb)):
            cell = (key[1], key[2])
            if cell not in in_both:
                continue
            before, after = va.get(key, "—"), vb.get(key, "—")
            if not key[0] and not _failing(before) and not _failing(after):
                continue  # a lane no claim covers, unjudged on both sides: what serves it shows in the kernel rows
            if before != after:
                add(verdict_changes, (key[0] or "(no claim)", before, after), cell)
    verdict_rows = rows(verdict_changes, "verdict")

    # a claim judged per batch now and for the whole lane before (another path now serves some of its batches):
    # its per-batch rows turn against the whole lane's verdict before, and the whole-lane row itself turns nowhere
    replaced = set()
    for r in verdict_rows:
        whole = whole_lane_row(verdict_rows, r) if r["before"] == "—" and r["after"] != "—" else None
        was, now = _failing(whole["before"] if whole else r["before"]), _failing(r["after"])
        if whole is not None:
            replaced.add(id(whole))
        r["turn"] = "newly failing" if now and not was else "no longer failing" if was and not now else ""
    for r in verdict_rows:
        if id(r) in replaced:
            r["turn"] = ""  # its per-batch rows carry the story
        moved_here = {tuple(c) for c in r["cells"]} & served_cells
        if r["turn"] == "no longer failing":
            # a claim that passes now because serving changed under it is no fix of the claim: say so
            r["because"] = ("claim now true because serving changed" if moved_here else
                            "serving did not change in these cells: the claim or the harness changed")
        elif r["turn"] == "newly failing":
            r["because"] = ("serving changed" if moved_here else
                            "serving did not change in these cells: the claim or the harness changed")
    changes += verdict_rows
    changes.sort(key=lambda r: ({"path": 0, "candidates": 1, "cell": 2, "verdict": 3, "dispatch": 4}[r["kind"]],
                                r["lane"] or r["field"], r["before"], r["after"]))
    only_old = sorted(set(old_cells) - set(new_cells))
    only_new = sorted(set(new_cells) - set(old_cells))
    serving = [c for c in changes if c["serving"]]
    d = {
        "schema": DIFF_SCHEMA,
        # whose routings these are (the newer one's): the rendered diff names the model and orders its layouts
        "model": profile.name,
        "from": _build(old), "to": _build(new),
        "changes": changes,
        "serving_changes": len(serving),
        "serving_cells": len({tuple(c) for r in serving for c in r["cells"]}),
        "by_class": {k: sum(1 for c in serving if c["class"] == k) for k in SERVING_CLASSES},
        "information_changes": sum(1 for c in changes if not c["serving"] and c["kind"] != "verdict"),
        "newly_failing": sum(1 for c in verdict_rows if c["turn"] == "newly failing"),
        "no_longer_failing": sum(1 for c in verdict_rows if c["turn"] == "no longer failing"),
        "now_true_by_serving": sum(1 for c in verdict_rows if c.get("because") == "claim now true because serving changed"),
        "unchanged_lanes": unchanged,
        "compared_lanes": compared,
        "cells_compared": len(common),
        "only_in_from": [list(c) for c in only_old],
        "only_in_to": [list(c) for c in only_new],
        "empty": not changes and not only_old and not only_new,
    }
    from audit.report.summary import pr_summary

    d["summary"] = pr_summary(d, old, new, profile)
    return d


#: the kinds of serving change, in the order the gate and the diff list them
SERVING_CLASSES = ("kernel", "refusal", "stop", "tier", "availability", "probe")
#: lane values (our own vocabulary) that say the lane takes nothing: no kernel serves through it
INACTIVE = ("not requested", "not taken", "not exercised", "stock path (")


def _inactive(value: str) -> bool:
    return value.startswith(INACTIVE)


def _failing(verdict_text: str) -> bool:
    from audit.report.verdicts import FAILING

    return verdict_text.split(" ", 1)[0] in FAILING


def _has_dispatch(routing: dict) -> bool:
    return any(c.get("dispatch") for c in routing.get("cells", []))


def _chosen(tried: list[dict]) -> str:
    """The candidate vLLM chose: the first it tried that was supported."""
    return next((str(t["cls"]) for t in tried if t.get("supported")), "")


def _klass(kind: str, field: str, *sides: str) -> str:
    """Which kind of serving change a row is: a kernel (a lane's class or backend, a candidate), a refusal
    (construction or post-load refused on one side, or construction got another way), a stop (post-load reached
    a simulation limit on one side: what lies past it is not known, so it gates), a per-call tier, an
    availability answer, or the probes (drift, errors)."""
    if kind in ("path", "candidates"):
        return "kernel"
    if kind == "dispatch":
        return "tier"
    if field.startswith("vLLM availability"):
        return "availability"
    if field.startswith("probe"):
        return "probe"
    if field == "attention candidates":
        return "kernel"
    if field == "post-load" and not any(POSTLOAD_REFUSED in side for side in sides):
        return "stop"  # how far post-load got moved (a simulation limit), no refusal on either side
    return "refusal"


def _build(routing: dict) -> dict:
    """Which build an audit is of: the pin, its vLLM version and commit, and the wheel's (or image's) identity, so
    two builds with the same version and file name and different bytes are told apart."""
    pin = routing.get("pin") or {}
    return {"pin": pin.get("name"), "vllm_version": pin.get("vllm_version"), "vllm_commit": pin.get("vllm_commit", ""),
            "wheel": pin.get("wheel", ""), "wheel_sha256": pin.get("wheel_sha256", ""),
            "image_config_digest": pin.get("image_config_digest", "")}


def _postload_state(cell: dict) -> str:
    """How far vLLM's post-load path went in a cell, in one line (a refusal names vLLM's function and message)."""
    post = cell.get("postload")
    if not post:
        return "not run" + (" (construction did not finish)" if cell.get("status") != "COMPLETE" else "")
    refused = post.get("refused_at")
    if refused:
        return (f"{POSTLOAD_REFUSED} {refused.get('step')}: {refused.get('function')} raised "
                f"{str(refused.get('type', '')).rsplit(':', 1)[-1]}: {refused.get('message')}")
    limits = post.get("limits") or []
    if limits:
        first = limits[0]
        return (f"stopped in {sum(g.get('count', 0) for g in limits)} step(s) by a simulation limit: "
                f"{first.get('raised_in')}: {str(first.get('message', ''))[:160]}")
    if not post.get("ran"):
        err = post.get("error") or {}
        return f"did not run: {err.get('type', '')}: {err.get('message', '')}"
    return f"{POSTLOAD_RAN} ({post.get('steps', 0)} steps)"


POSTLOAD_RAN = "ran to the end"
POSTLOAD_REFUSED = "refused at"


def _absent(cell: dict) -> str:
    """What a lane with no value in this cell means, when the cell says why (a drifted probe target)."""
    drifted = sorted(d["target"] for d in cell.get("drift", []))
    return f"— (not seen: probe target drifted: {', '.join(drifted)})" if drifted else ""


def _text(value) -> str:
    if value is None or value == {} or value == []:
        return "—"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    return str(value)


def _cell_facts(a: dict, b: dict):
    """(field, before, after, why) for everything else a reviewer cares about in a cell: the attention backends
    vLLM considered and why it rejected them, how far post-load went, drifted probe targets, probe errors, vLLM's
    availability answers and the package versions of the environment. *why* says what makes a row information
    ("" where it decides serving)."""
    def attention(c):
        ac = c.get("attention_candidates") or {}
        valid = ", ".join(f"{v['backend']}" for v in ac.get("valid", []))
        rejected = "; ".join(f"{r['backend']} ✗ {' / '.join(map(str, r['reasons']))}" for r in ac.get("rejected", []))
        return " | ".join(x for x in (f"valid: {valid}" if valid else "", f"rejected: {rejected}" if rejected else "")
                          if x) or "—"

    def valid(c):
        return [v["backend"] for v in (c.get("attention_candidates") or {}).get("valid", [])]

    if attention(a) != attention(b):
        # vLLM takes the first valid backend in its priority order: the same valid list chooses the same one
        same = valid(a) and valid(a) == valid(b)
        yield ("attention candidates", attention(a), attention(b),
               "the same valid backends in the same order; only the rejected ones or their reasons differ" if same
               else "")
    pa, pb = _postload_state(a), _postload_state(b)
    if pa != pb:
        counts = pa.startswith(POSTLOAD_RAN) and pb.startswith(POSTLOAD_RAN)
        yield "post-load", pa, pb, "the count of post-load steps only" if counts else ""
    for field, get in (("probe drift", lambda c: sorted(d["target"] for d in c.get("drift", []))),
                       ("probe errors", lambda c: sorted(f"{e.get('where')}: {(e.get('error') or {}).get('type')}: "
                                                         f"{(e.get('error') or {}).get('message')}"
                                                         for e in c.get("probe_errors", [])))):
        if get(a) != get(b):
            yield field, _text(get(a)) if get(a) else "—", _text(get(b)) if get(b) else "—", ""
    for group, title in (("availability", "vLLM availability"), ("fingerprint", "package")):
        da, db = a.get(group) or {}, b.get(group) or {}
        if group == "fingerprint":
            da, db = da.get("packages") or {}, db.get("packages") or {}
        if not da or not db:  # a cell without the record (INCOMPLETE) is stated by the construction row
            continue
        # an availability answer one audit did not record (its harness did not ask yet) is no change; a package
        # one environment lacks is
        keys = set(da) & set(db) if group == "availability" else set(da) | set(db)
        for key in sorted(keys):
            if da.get(key) != db.get(key):
                yield (f"{title}: {key}", _text(da.get(key)), _text(db.get(key)),
                       "" if group == "availability" else "a package version (what it changes shows in the other rows)")


def _worst_verdicts(routing: dict) -> dict[tuple, str]:
    """(claim, system, layout, lane, workload) -> its most severe verdict over the lane's layer groups, with what
    runs there ("MISMATCH (humming)"), so a verdict that stays the same against another backend still shows
    (workload: a claim's ``at``, empty for a claim about every batch size)."""
    worst: dict[tuple, tuple[int, str, set]] = {}
    for r in (routing.get("verdicts") or {}).get("rows", []):
        key = (r["claim"], r["system"], r["layout"], r["lane"], r.get("at", ""))
        rank = SEVERITY.index(r["verdict"])
        if key not in worst or rank < worst[key][0]:
            worst[key] = (rank, r["verdict"], set())
        if rank == worst[key][0] and r.get("actual"):
            worst[key][2].add(r["actual"])
    return {key: verdict + (f" ({', '.join(sorted(actual))})" if actual else "")
            for key, (_, verdict, actual) in worst.items()}


def load_routing(reports_dir: Path, pin: str) -> dict:
    from audit.fsutil import report_dir_for

    path = report_dir_for(reports_dir, pin) / "routing.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"no audit of {pin!r}: {path} does not exist",
                         hint=f"audit it into that reports directory first: make audit PIN={pin}"
                              + ("" if str(reports_dir) == "reports" else f" REPORTS={reports_dir}")) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or not isinstance(data.get("pin"), dict):
        raise UsageError(f"{path} is not a routing.json written by this harness (expected an object with "
                         "'pin' and 'cells')", hint=f"audit it again: make audit PIN={pin}")
    from audit.report.routing import ROUTING_SCHEMA

    for i, cell in enumerate(data["cells"]):  # what the diff and the gate read of every cell
        missing = [k for k, t in (("system", str), ("layout", str), ("status", str), ("lanes", dict))
                   if not isinstance(cell, dict) or not isinstance(cell.get(k), t)]
        if missing:
            raise UsageError(f"{path}: cell {i + 1} has no valid {', '.join(repr(k) for k in missing)}: not a "
                             "routing.json this harness wrote, or one edited since",
                             hint=f"render it again from its run (serving-truth regenerate --pins {pin} --from-runs) "
                                  f"or audit it again: make audit PIN={pin}")
    if data.get("schema") != ROUTING_SCHEMA:
        raise UsageError(f"{path} has routing schema {data.get('schema')!r}; this harness reads {ROUTING_SCHEMA}",
                         hint=f"render it again from its newest run (no vLLM needed): serving-truth regenerate "
                              f"--pins {pin} --from-runs --reports {reports_dir}; or audit it again: "
                              f"make audit PIN={pin}")
    return data


def render_diff(d: dict, profile) -> str:
    """The markdown diff, in the words of the diffed model's *profile* (the one ``d["model"]`` names)."""
    from audit.report.fit import fit
    from audit.report.render import _env

    if d.get("model") != profile.name:
        raise RenderError(f"this diff is of the model {d.get('model')!r}, not of {profile.name!r}; no report file "
                          "was changed")
    return fit(_env(list(profile.layouts)).get_template("diff.md.j2").render(d=d, model_title=profile.title))


def write_diff(reports_dir: Path, from_pin: str, to_pin: str, profile,
               d: dict | None = None) -> tuple[Path, Path, dict]:
    """Render reports/diffs/<from>..<to>.md and .json of *profile*'s model (both rendered before either is
    replaced); *d* is the diff when the caller computed it already."""
    from audit.fsutil import report_dir_for, write_all_atomic

    for pin in (from_pin, to_pin):
        report_dir_for(reports_dir, pin)  # names that are no plain directory name never reach a path
    if d is None:
        d = diff_routings(load_routing(reports_dir, from_pin), load_routing(reports_dir, to_pin), profile)
    out = Path(reports_dir) / "diffs"
    md, js = out / f"{from_pin}..{to_pin}.md", out / f"{from_pin}..{to_pin}.json"
    write_all_atomic({js: json.dumps(d, indent=1, sort_keys=True, ensure_ascii=False) + "\n", md: render_diff(d, profile)})
    return md, js, d
