"""Dispatch tiers: what vLLM picks per call, by token count, read from a cell's ``dispatch`` records.

The probe side (``probes/resolve/dispatch.py``) calls the pinned vLLM's own per-call dispatch functions on the
built modules at representative token counts and records, per lane and module group, the choice at
each workload. Here those records become a compact table per cell and lane (``routing.json``'s
``dispatch``) and, across cells, one table per lane for the ledger. Never imports vLLM.
"""
from __future__ import annotations

from audit.evidence.files import EvidenceFile
from audit.lanevalue import is_inactive, make, text
from audit.profiles import StepPath
from audit.report.layers import format_ranges
from probes.core import tiers

#: the dispatch lanes the shared probes resolve for any model (probes/resolve/dispatch.py), lane id -> title, in the
#: order the ledger shows them; a model's own lanes, its titles for shared ones and its order are its profile's
#: (``Profile.dispatch``), read by :func:`lane_titles`
LANE_TITLES = {
    "serving_path": "Serving path (CUDA-graph mode)",
    "shared_overlap": "Shared experts stream overlap",
    "moe_experts": "Routed experts per-call variant",
    "router": "MoE router GEMM",
    "moe_routing": "MoE routing (router, routing method, where top-k runs)",
    "moe_parallel": "MoE parallelism (effective tp/ep/dp sizes, sequence-parallel MoE)",
    "mla": "MLA attention path",
}
#: what a reader must know to read a lane's table right (shown under its title; a profile's
#: ``dispatch.notes`` may say it for its model, read by :func:`lane_notes`)
LANE_NOTES = {
    "serving_path": "vLLM's CUDA-graph dispatch gives each batch its mode: a FULL graph, a piecewise graph or eager.",
    "moe_routing": ("Read from the runner's router (its class and the routing method it declares, which a monolithic "
                    "kernel is told to run) and the experts' quant method (`is_monolithic`: the kernel takes the "
                    "router logits and routes itself; otherwise the router's `select_experts` picks the experts "
                    "first). Fixed at construction and load, so the same at every batch."),
    "moe_parallel": ("The MoE's own split, from its runner's `moe_parallel_config`: under expert parallel its tp_size "
                     "is not the attention's; with DP > 1 and TP > 1 vLLM's `use_sequence_parallel_moe` has each TP "
                     "rank run the MoE on its slice of the tokens. Fixed at construction."),
}
#: the stand-ins a shared dispatch lane runs vLLM's function with (probes/resolve/dispatch.py), each shape-only: listed
#: under "What was simulated" wherever the lane has rows (a profile's ``dispatch.stand_ins`` add its own lanes' and
#: its step path's); a raise planted right after them surfaces as `not resolved` (tests/test_serving_path_vllm.py).
#: None today: the shared lanes call vLLM's functions on the objects construction built.
STAND_INS: dict[str, tuple[str, str]] = {}
#: the ``raw`` source of a group that a model's own step path serves (see :func:`step_path_group`)
STEP_PATH_SOURCE = "step_path"


def lane_titles(profile) -> dict[str, str]:
    """Every dispatch lane's title as *profile*'s model's ledger names it (its profile's own titles over the shared ones), in
    the order its ledger shows them (its profile's ``dispatch.order``; lanes it does not order follow, the shared
    ones first)."""
    own = profile.dispatch
    titles = {**LANE_TITLES, **own.titles}
    order = [*own.order, *(lane for lane in titles if lane not in own.order)]
    return {lane: titles.get(lane, lane) for lane in order}


def lane_notes(profile) -> dict[str, str]:
    return {**LANE_NOTES, **profile.dispatch.notes}


def stand_ins(cells: list[dict], profile) -> dict[str, str]:
    """The dispatch stand-ins of the lanes any cell resolved (the shared lanes' and *profile*'s own)."""
    known = {**STAND_INS, **profile.dispatch.stand_ins}
    lanes = {lane for c in cells for lane in ((c.get("dispatch") or {}).get("lanes") or {})}
    return dict(known[lane] for lane in sorted(lanes) if lane in known)


LEVEL_TEXT = ("dispatch: resolved; vLLM's own per-call dispatch function ran on the built modules for a batch "
              "of that many tokens (meta tensors, simulated platform); no kernel ran")
PHASE_ORDER = {"decode": 0, "prefill": 1, "verify": 2}


def workload_key(w: dict) -> str:
    """``decode 8`` (tokens in the batch); verify widths also say the requests (``verify 32 (8x4)``)."""
    if w["phase"] == "verify":
        return f"verify {w['tokens']} ({w['requests']}x{w['tokens'] // max(1, w['requests'])})"
    return f"{w['phase']} {w['tokens']}"


def cell_tiers(f: EvidenceFile, profile) -> dict | None:
    """The cell's ``dispatch`` entry for routing.json (lanes in *profile*'s ledger order), or None when the stage did
    not run."""
    stage = f.of_kind("dispatch-stage")
    if not stage:
        return None
    st = stage[-1]
    lanes: dict[str, list[dict]] = {}
    for r in f.of_kind("dispatch"):
        tiers = {workload_key(t): t["choice"] for t in r.get("tiers", [])}
        lanes.setdefault(r["lane"], []).append({
            "role": r.get("role", "target"), "group": r.get("group", ""), "layers": r.get("layers", []),
            "ranges": format_ranges(r.get("layers", [])) or "model", "level": r.get("level", "dispatch"),
            "source": r.get("source", ""), "tiers": tiers})
    for rows in lanes.values():
        rows.sort(key=lambda g: (g["role"] != "target", g["layers"][:1], g["group"]))
    order = list(lane_titles(profile))
    return {"workloads": [workload_key(w) for w in st.get("workloads", [])],
            "lanes": dict(sorted(lanes.items(), key=lambda kv: _lane_order(kv[0], order))),
            "errors": st.get("errors", {})}


def _lane_order(lane: str, order: list[str]) -> tuple:
    """Where *lane* goes in a ledger whose lanes are shown in *order* (:func:`lane_titles`' keys); others last."""
    return (order.index(lane) if lane in order else len(order), lane)


def workload_order(key: str) -> tuple:
    phase, _, rest = key.partition(" ")
    return (PHASE_ORDER.get(phase, 9), int(rest.split(" ")[0]) if rest.split(" ")[0].isdigit() else 0)


def ledger_tables(cells: list[dict], profile) -> list[dict]:
    """One table per lane across cells: rows with the same group, layers and tiers are merged and
    list their cells; columns are every workload any cell resolved (``—`` where a cell has none)."""
    by_lane: dict[str, dict] = {}
    for c in cells:
        d = c.get("dispatch")
        if not d:
            continue
        name = f"{c['system']}/{c['layout']}"
        for lane, rows in d.get("lanes", {}).items():
            t = by_lane.setdefault(lane, {"rows": {}, "columns": set(), "levels": set(), "sources": set()})
            for g in rows:
                t["columns"].update(g["tiers"])
                t["levels"].add(g["level"])
                t["sources"].add(g["source"])
                key = (g["role"], g.get("draft", ""), g["group"], g["ranges"], tuple(sorted(g["tiers"].items())))
                row = t["rows"].setdefault(key, {"role": g["role"], "draft": g.get("draft", ""), "group": g["group"],
                                                 "ranges": g["ranges"], "tiers": g["tiers"], "level": g["level"],
                                                 "cells": []})
                if name not in row["cells"]:
                    row["cells"].append(name)
    out, titles, notes = [], lane_titles(profile), lane_notes(profile)
    order = list(titles)
    for lane in sorted(by_lane, key=lambda lane: _lane_order(lane, order)):
        t = by_lane[lane]
        columns = sorted(t["columns"], key=workload_order)
        rows = sorted(t["rows"].values(), key=lambda r: (r["role"] != "target", r["group"], r["ranges"], r["cells"]))
        out.append({"lane": lane, "title": titles.get(lane, lane), "note": notes.get(lane, ""),
                    "columns": columns,
                    "levels": sorted(t["levels"]), "sources": sorted(t["sources"]),
                    "rows": [{**r, "spans": spans(r["tiers"])} for r in rows]})
    return out


def spans(tiers: dict[str, str]) -> list[dict]:
    """Consecutive token counts of one phase with the same choice, as one span:
    ``{"span": "decode 1-64", "choice": ...}``, in phase and token order."""
    out: list[dict] = []
    for key in sorted(tiers, key=workload_order):
        phase, _, rest = key.partition(" ")
        last = out[-1] if out else None
        if last is not None and last["phase"] == phase and last["choice"] == tiers[key]:
            last["last"] = rest
        else:
            out.append({"phase": phase, "first": rest, "last": rest, "choice": tiers[key]})
    return [{"span": f"{s['phase']} {s['first']}" + (f"–{s['last']}" if s["last"] != s["first"] else ""),
             "choice": s["choice"]} for s in out]


def unsimulated(cells: list[dict]) -> str:
    """What the ledger's limits sentence says about per-call dispatch (the wording before dispatch
    tiers existed when no cell resolved them)."""
    if any(c.get("dispatch") for c in cells):
        return ("per-call choices only a GPU makes (autotuned tactics, measured timings, device-side "
                "schedulers; the\n[Dispatch tiers](#dispatch-tiers) name them)")
    return "per-batch dispatch (token-count tiers, per-call sub-kernels such as FlashInfer\nMLA's decode kernel choice)"


def stage_errors(cells: list[dict]) -> list[dict]:
    """Lanes whose resolution raised, per cell (stated in the ledger, never a verdict)."""
    out = []
    for c in cells:
        for lane, err in ((c.get("dispatch") or {}).get("errors") or {}).items():
            out.append({"cell": f"{c['system']}/{c['layout']}", "lane": lane, "error": err})
    return out


def diff_cells(a: dict | None, b: dict | None, profile):
    """Every per-call choice that moved between two audits of one cell, as dicts: ``lane``, ``role``, ``group``,
    ``span`` (workloads next to each other in the cell's order with the same move fold into one span), ``before``,
    ``after`` and ``layers`` (the group's own layer numbers: a draft's are its own). Nothing when either audit did
    not resolve dispatch tiers (an older report says nothing, not "—")."""
    if not a or not b:
        return
    order = list(dict.fromkeys([*a.get("workloads", []), *b.get("workloads", [])]))

    def per_layer(d: dict) -> dict[tuple, str]:
        out = {}
        for lane, rows in d.get("lanes", {}).items():
            for r in rows:
                for layer in r["layers"] or [-1]:
                    for workload, choice in r["tiers"].items():
                        out[(lane, r["role"], r["group"], layer, workload)] = choice
        return out

    pa, pb = per_layer(a), per_layer(b)
    moved: dict[tuple, set] = {}
    for key in sorted(set(pa) | set(pb), key=str):
        before, after = pa.get(key, a.get("absent", "—")), pb.get(key, b.get("absent", "—"))
        if before != after:
            lane, role, group, layer, workload = key
            moved.setdefault((lane, role, group, workload, before, after), set()).add(layer)
    folded: dict[tuple, list[str]] = {}
    for (lane, role, group, workload, before, after), layers in moved.items():
        folded.setdefault((lane, role, group, before, after, tuple(sorted(layers))), []).append(workload)
    for (lane, role, group, before, after, layers), workloads in sorted(folded.items(), key=str):
        works = sorted(workloads, key=lambda w: order.index(w) if w in order else len(order))
        yield {"lane": lane, "role": role, "group": group, "span": fold(works, order), "workloads": works,
               "before": before, "after": after, "layers": [layer for layer in layers if layer >= 0]}


def fold(workloads: list[str], order: list[str]) -> str:
    """``decode 1``, ``decode 8``, ``decode 256`` (with 64 between them unchanged) -> ``decode 1–8, decode 256``."""
    runs: list[list[str]] = []
    for w in workloads:
        prev = runs[-1][-1] if runs else None
        adjacent = (prev is not None and prev in order and w in order and order.index(w) == order.index(prev) + 1
                    and prev.split(" ")[0] == w.split(" ")[0])
        if adjacent:
            runs[-1].append(w)
        else:
            runs.append([w])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}–{r[-1].split(' ', 1)[1]}" for r in runs)


# --- which lane serves a workload (verdicts of claims about a batch size; labels.json per token count) ---
def workload_of(cell: dict, at: str) -> str | None:
    """The cell's dispatch workload key for a claim's ``at`` (``verify 32`` -> ``verify 32 (8x4)``)."""
    for key in (cell.get("dispatch") or {}).get("workloads", []):
        if key == at or key.startswith(at + " "):
            return key
    return None


def tier_choice(cell: dict, dlane: str, layers: list[int], workload: str) -> tuple[str, dict] | None:
    """(choice, dispatch row) of the target model's *dlane* group overlapping *layers* at *workload*."""
    for g in ((cell.get("dispatch") or {}).get("lanes") or {}).get(dlane, []):
        if g.get("role", "target") != "target":
            continue
        if g.get("layers") and layers and not set(g["layers"]) & set(layers):
            continue
        if workload in g.get("tiers", {}):
            return g["tiers"][workload], g
    return None


def serving_path(cell: dict, workload: str) -> str | None:
    """The cell's serving-path choice at *workload* (its CUDA-graph mode, and whether the model's own step path
    takes the step), or None when not resolved."""
    found = tier_choice(cell, "serving_path", [], workload)
    return found[0] if found else None


def step_path_group(cell: dict, lane: str, group: dict, workload: str, path: StepPath | None) -> dict | None:
    """The group that serves *workload* when the model's own step path (its profile's ``step_path``) takes the
    step: its own component for the lane (from its dispatch tier), with the dispatch level; None when the stock
    path serves it (or the model has no such path)."""
    if path is None:
        return None
    choice = serving_path(cell, workload)
    if not choice or not tiers.takes_step_path(choice, path.name):
        return None
    part = path.parts.get(lane, f"stock lane outside the {path.name}")
    found = tier_choice(cell, path.lane, [], workload)
    detail = found[0] if found else path.name
    return {"layers": group["layers"], "ranges": group.get("ranges", ""), "level": "resolved (dispatch)",
            "value": make(f"{path.name} {part}", detail=detail), "raw": {"source": STEP_PATH_SOURCE, "fields": [part]}}


def taken_by_step_path(cell: dict, lane: str, path: StepPath | None) -> list[str]:
    """The workloads of *cell* at which the model's own step path serves *lane*'s work instead of the lane's
    kernels (vLLM's graph dispatch and the path's prepared batch sizes decide; read off the serving-path tiers)."""
    if path is None or lane not in path.parts:
        return []
    if all(is_inactive(g.get("value")) for g in cell.get("lanes", {}).get(lane, [])):
        return []  # the lane serves no batch in this cell (no speculative decoding): nothing is taken from it
    return [w for w in (cell.get("dispatch") or {}).get("workloads", [])
            if tiers.takes_step_path(serving_path(cell, w) or "", path.name)]


def step_path_mark(cell: dict, lane: str, path: StepPath | None) -> str:
    """What a lane's row adds where the model's step path takes some of its batches: which batches, and what serves
    them ("" where it takes none)."""
    taken = taken_by_step_path(cell, lane, path)
    if not taken:
        return ""
    return f" · at {fold(taken, list((cell.get('dispatch') or {}).get('workloads', [])))}: {path.owner} serves instead"


def serving_mark(cell: dict, lane: str, profile) -> str:
    """What a lane's row adds where another path serves some of its batches: the model's step path
    (:func:`step_path_mark`), or a path a per-call choice routes them to (the profile's batch routes): which batches,
    and what serves them ("" where the lane serves them all)."""
    mark = step_path_mark(cell, lane, profile.step_path)
    route = next((r for r in profile.batch_routes if lane in r.lanes), None)
    judged = next((j for j in profile.judged if j.lane == lane), None)
    if route is None or judged is None:
        return mark
    every = list((cell.get("dispatch") or {}).get("workloads", []))
    skip = set(taken_by_step_path(cell, lane, profile.step_path))
    routed: dict[str, list[str]] = {}
    for g in cell.get("lanes", {}).get(lane, []):
        for w in every:
            if w.split(" ")[0] not in judged.workloads or w in skip:
                continue
            found = tier_choice(cell, route.dispatch, g["layers"], w)
            taken = found[0].split(":", 1)[0] if found and ":" in found[0] else ""
            served = route.paths.get(taken)
            if served is not None and served != lane and w not in routed.setdefault(taken, []):
                routed[taken].append(w)
    for taken, works in sorted(routed.items()):
        works.sort(key=every.index)
        mark += f" · at {fold(works, every)}: the batch takes {route.title}'s {taken}"
    return mark


def serving_group(cell: dict, lane: str, group: dict, workload: str, profile) -> tuple[str, dict, str] | str:
    """Which construction lane group serves *workload* for the layers of *group*. A step the model's own step
    path takes (its *profile*'s; vLLM's graph dispatch and the path's prepared batch sizes decide) is served by that
    path's own kernels, not the lane's; where a per-call choice names the path a batch takes (the profile's
    ``batch_routes``: a short prefill chunk can take MLA's decode path; a draft method's decode rows can be
    speculative rows), that path's lane serves it; other lanes serve every workload with the group built.
    Returns (lane, group, note) or a reason it is unknown."""
    path = profile.step_path
    special = step_path_group(cell, lane, group, workload, path)
    if special is not None:
        return lane, special, (f"a {workload} step replays a FULL CUDA graph that {path.owner} takes "
                               f"({serving_path(cell, workload)}), so its own kernels serve it")
    route = next((r for r in profile.batch_routes if lane in r.lanes), None)
    if route is None:
        return lane, group, ""
    found = tier_choice(cell, route.dispatch, group["layers"], workload)
    if found is None:
        return (f"no {route.title} dispatch tier was resolved for these layers" if route.named else
                (lane, group, ""))
    choice, drow = found
    taken = choice.split(":", 1)[0] if ":" in choice else ""
    served = route.paths.get(taken)
    if served is None:
        return f"{route.title}'s path for this batch is not one lane: {choice}" if route.named else (lane, group, "")
    if served == lane:
        return lane, group, ""
    other = next((g for g in cell["lanes"].get(served, []) if set(g["layers"]) & set(group["layers"])), None)
    if other is None:
        return f"the batch takes the {taken} ({choice}), and this cell has no {served} evidence for these layers"
    return (served, other, f"a {workload} batch takes {route.title}'s {taken} ({drow.get('source', '')}), so "
                           f"{text(other)} serves it")