"""torch.profiler corroboration of observed evidence: do the GPU kernels the traces name agree with
the kernel paths the probes counted?

Inputs, all from one cell's observe-mode evidence: the ``kernel-map`` record (the map the probes
shipped with: per kernel path, a kernel-name pattern, and whether this build contains such a kernel),
the ``profiler-traces`` record (per trace file: session prefix = workload phase, rank, kernel launch
counts split into direct launches and launches from CUDA-graph replays), and the merged observed
rows (:func:`audit.report.observed.merge`).

Per lane, a trace kernel that matches the pattern of a path the probes saw *corroborates* that path;
a kernel matching only paths the probes did not see is *profiler-only* (the probes may have missed
an entry); a path the probes saw with no matching kernel in any trace is *not seen by the profiler*.
The probes stay the primary evidence: this adds agreement notes, never verdicts or exit codes.
"""
from __future__ import annotations

import re
from collections import defaultdict

#: how many kernels that match no entry the ledger lists (by launches), per cell
UNMAPPED_SHOWN = 12


def _one(files, kind: str) -> dict | None:
    for f in files:
        for r in f.records:
            if r.get("kind") == kind:
                return r
    return None


def corroborate(files, observed: dict) -> dict | None:
    """The ``profiler`` block of a cell's observed evidence, or None when the run did not profile."""
    traces_rec = _one(files, "profiler-traces")
    map_rec = _one(files, "kernel-map")
    if traces_rec is None and map_rec is None:
        return None
    entries, compiled = [], []
    for e in (map_rec or {}).get("entries", []):
        try:
            compiled.append((e, re.compile(e["pattern"])))
        except (re.error, KeyError, TypeError):  # a broken entry reads no trace (the build check says why)
            continue
        entries.append(e)
    lane_of_path = {e["path"]: e.get("lane", "?") for e in entries}
    traces = (traces_rec or {}).get("traces", [])
    readable = [t for t in traces if "error" not in t]

    probes: dict[str, set[str]] = defaultdict(set)
    for row in observed.get("rows", []):
        if row.get("calls"):
            probes[row["lane"]].add(row["path"])

    # kernel name -> launches (direct, in graph), sessions, ranks
    kernels: dict[str, dict] = {}
    for t in readable:
        for name, n in (t.get("kernels") or {}).items():
            k = kernels.setdefault(name, {"direct": 0, "in_graph": 0, "sessions": set(), "ranks": set()})
            k["direct"] += int(n.get("direct", 0))
            k["in_graph"] += int(n.get("in_graph", 0))
            k["sessions"].add(t.get("prefix") or "")
            if t.get("rank") is not None:
                k["ranks"].add(str(t["rank"]))

    seen_paths: dict[str, dict] = {}     # path -> launches the traces attribute to it
    profiler_only: dict[str, set[str]] = defaultdict(set)  # lane -> paths only the traces show
    unmapped = []
    for name, k in sorted(kernels.items()):
        hit = sorted({e["path"] for e, rx in compiled if rx.search(name)})
        if not hit:
            unmapped.append({"name": name, "launches": k["direct"] + k["in_graph"]})
            continue
        for lane in sorted({lane_of_path[p] for p in hit}):
            candidates = [p for p in hit if lane_of_path[p] == lane]
            explained = [p for p in candidates if p in probes.get(lane, ())]
            for p in explained or candidates:
                s = seen_paths.setdefault(p, {"kernels": 0, "direct": 0, "in_graph": 0, "sessions": set(),
                                              "ranks": set(), "examples": []})
                s["kernels"] += 1
                s["direct"] += k["direct"]
                s["in_graph"] += k["in_graph"]
                s["sessions"] |= k["sessions"]
                s["ranks"] |= k["ranks"]
                if len(s["examples"]) < 2:
                    s["examples"].append(_short(name))
            if not explained:
                profiler_only[lane].update(candidates)

    mapped = set(lane_of_path)
    lanes = []
    for lane in sorted(set(probes) | set(profiler_only)):
        ran = sorted(probes.get(lane, ()))
        only_probes = [p for p in ran if p in mapped and p not in seen_paths]
        no_map = [p for p in ran if p not in mapped]
        only_profiler = sorted(profiler_only.get(lane, ()))
        if not readable:
            status = "no traces"
        elif only_profiler or only_probes:
            status = "disagrees"
        elif no_map:
            status = "no kernel map"
        else:
            status = "agrees"
        paths = sorted({*ran, *only_profiler})
        lanes.append({
            "lane": lane, "status": status, "probes": ran, "only_probes": only_probes,
            "only_profiler": only_profiler, "no_map": no_map,
            "profiler": [{"path": p, **_jsonable(seen_paths[p])} for p in paths if p in seen_paths],
        })
    unmapped.sort(key=lambda u: (-u["launches"], u["name"]))
    return {
        "traces": len(traces),
        "unreadable": [{"file": t["file"], "error": t["error"]} for t in traces if "error" in t],
        "sessions": sorted({t.get("prefix") or "" for t in readable}),
        "ranks": sorted({str(t["rank"]) for t in readable if t.get("rank") is not None}, key=_num),
        "kernel_launches": sum(k["direct"] + k["in_graph"] for k in kernels.values()),
        "in_graph_launches": sum(k["in_graph"] for k in kernels.values()),
        "lanes": lanes,
        "disagree": [l["lane"] for l in lanes if l["status"] == "disagrees"],
        "unmapped": [{**u, "name": _short(u["name"])} for u in unmapped[:UNMAPPED_SHOWN]],
        "unmapped_total": len(unmapped),
        "map_not_in_build": [{"path": e["path"], "lane": e.get("lane", "?"), "origin": e["origin"]}
                             for e in entries if e.get("status") == "not in build"],
        "map_error": (map_rec or {}).get("error", ""),
        "traces_error": (traces_rec or {}).get("error", ""),
    }


def _num(s: str):
    return (0, int(s)) if s.isdigit() else (1, s)


def _short(name: str, limit: int = 120) -> str:
    return name if len(name) <= limit else name[:limit - 1] + "…"


def _jsonable(s: dict) -> dict:
    return {"kernels": s["kernels"], "direct": s["direct"], "in_graph": s["in_graph"],
            "sessions": sorted(s["sessions"]), "ranks": sorted(s["ranks"], key=_num), "examples": s["examples"]}


__all__ = ["corroborate"]
