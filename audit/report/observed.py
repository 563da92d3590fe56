"""Observed evidence: merge per-process (per-rank) kernel-entry counts into lane rows, flag disagreement.

Observe-mode processes write, per process, ``exec`` records (path, lane, layer, phase, calls: eager
executions) and ``graph`` records (a captured CUDA graph: its key, how often it was replayed, and
the (path, lane, layer, phase) calls captured into it) with the process's rank in the file header.

* a row per (lane, phase, path) with the layers it ran in, its calls, the ranks that ran it, and its
  evidence level: ``observed`` for eager executions, ``observed-in-graph`` for paths captured into
  a graph that was replayed (a capture alone is never an execution: a graph never replayed yields
  no observed-in-graph row, only a note);
* RANK_DISAGREE entries: a (lane, layer, phase) where ranks ran different paths.
"""
from __future__ import annotations

from collections import defaultdict

from audit.report.layers import format_ranges



def _rank(header: dict) -> str:
    for key in ("rank", "global_rank"):
        if header.get(key) is not None:
            return str(header[key])
    return f"pid {header.get('pid', '?')}"


def merge(files) -> dict:
    """``files``: evidence files (``audit.evidence.files`` objects with ``.header`` and ``.records``) of one cell."""

    # (lane, layer, phase) -> rank -> {path: calls}
    eager: dict[tuple, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(dict))
    graph_paths: dict[tuple, dict[str, dict]] = defaultdict(dict)  # (lane, layer, phase) -> path -> info
    graphs = []
    ranks = set()
    backend_of: dict[str, str] = {}
    for f in files:
        if f.header.get("mode") != "observe":
            continue
        rank = _rank(f.header)
        if any(r.get("kind") in ("exec", "graph") for r in f.records):
            ranks.add(rank)  # processes that ran no model (API server, engine core) are not ranks
        for r in f.records:
            if r.get("kind") == "exec":
                backend_of.setdefault(r["path"], r.get("backend", ""))
                key = (r["lane"], r.get("layer"), r["phase"])
                by = eager[key][rank]
                by[r["path"]] = by.get(r["path"], 0) + int(r["calls"])
            elif r.get("kind") == "graph":
                graphs.append({"rank": rank, "key": r["key"], "replays": int(r["replays"]),
                               "paths": sorted({f"{p['lane']}:{p['path']}" for p in r["paths"]})})
                if int(r["replays"]) <= 0:
                    continue
                for p in r["paths"]:
                    backend_of.setdefault(p["path"], p.get("backend", ""))
                    key = (p["lane"], p.get("layer"), p["phase"])
                    info = graph_paths[key].setdefault(p["path"], {"replays": 0, "graphs": set(), "ranks": set()})
                    info["replays"] += int(r["replays"])
                    info["graphs"].add(r["key"])
                    info["ranks"].add(rank)

    rows: dict[tuple, dict] = {}
    for (lane, layer, phase), by_rank in eager.items():
        for rank, paths in by_rank.items():
            for path, calls in paths.items():
                row = rows.setdefault((lane, phase, path, "observed"), {"layers": set(), "calls": 0, "ranks": set()})
                row["calls"] += calls
                row["ranks"].add(rank)
                if layer is not None:
                    row["layers"].add(layer)
    for (lane, layer, phase), paths in graph_paths.items():
        for path, info in paths.items():
            row = rows.setdefault((lane, phase, path, "observed-in-graph"),
                                  {"layers": set(), "calls": 0, "ranks": set(), "graphs": set()})
            row["calls"] += info["replays"]
            row["ranks"] |= info["ranks"]
            row["graphs"] |= info["graphs"]
            if layer is not None:
                row["layers"].add(layer)
    out_rows = []
    for (lane, phase, path, level), row in sorted(rows.items(), key=lambda kv: tuple(map(str, kv[0]))):
        out_rows.append({"lane": lane, "phase": phase, "path": path, "backend": backend_of.get(path, ""),
                         "evidence": level,
                         "layers": sorted(row["layers"]), "ranges": format_ranges(sorted(row["layers"])),
                         "calls": row["calls"], "ranks": sorted(row["ranks"]),
                         **({"graphs": sorted(row["graphs"])} if "graphs" in row else {})})

    # ranks disagree: at one (lane, layer, phase), the sets of eager paths differ between ranks
    disagree = []
    for (lane, layer, phase), by_rank in sorted(eager.items(), key=lambda kv: tuple(map(str, kv[0]))):
        sets = {rank: tuple(sorted(p)) for rank, p in by_rank.items()}
        if len(set(sets.values())) > 1:
            disagree.append({"lane": lane, "layer": layer, "phase": phase,
                             "by_rank": {rank: list(paths) for rank, paths in sorted(sets.items())}})
    return {"rows": out_rows, "rank_disagree": disagree, "ranks": sorted(ranks),
            "graphs": sorted(graphs, key=lambda g: (g["rank"], g["key"]))}


__all__ = ["merge"]
