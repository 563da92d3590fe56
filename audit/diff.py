"""The routing diff between two audits (usually two pins): what moved, grouped so one upstream
change reads as one row, and what stayed the same in one line.

Works on ``routing.json`` files only (pure data in, pure data out); the same two inputs always give
the same diff, and a routing compared with itself gives an empty one.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .errors import UsageError

DIFF_SCHEMA = 1


def _per_layer(groups: list[dict]) -> dict[int, object]:
    return {layer: g["value"] for g in groups for layer in g["layers"]}


def _tried_text(tried: list[dict]) -> str:
    return " → ".join(f"{t['cls']}{'' if t['supported'] else ' ✗ ' + str(t.get('reason') or '')}" for t in tried)


def _ranges(layers) -> str:
    from .routing import format_ranges

    return format_ranges(layers)


def diff_routings(old: dict, new: dict) -> dict:
    """Compare two routing models. Rows group identical (lane, before, after) changes."""
    titles = {**old.get("lane_titles", {}), **new.get("lane_titles", {})}
    old_cells = {(c["system"], c["layout"]): c for c in old["cells"]}
    new_cells = {(c["system"], c["layout"]): c for c in new["cells"]}
    common = sorted(set(old_cells) & set(new_cells))
    path_changes: dict[tuple, dict] = {}
    cand_changes: dict[tuple, dict] = {}
    cell_changes: dict[tuple, dict] = {}
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
        # where construction now stops earlier (or later), lanes appearing/disappearing past that
        # point are consequences of the stop, already stated by the construction row
        stop_changed = a.get("status") != b.get("status")
        for lane in sorted(set(a["lanes"]) | set(b["lanes"])):
            before, after = _per_layer(a["lanes"].get(lane, [])), _per_layer(b["lanes"].get(lane, []))
            compared += 1
            moved = defaultdict(set)
            for layer in sorted(set(before) | set(after)):
                va, vb = before.get(layer, "—"), after.get(layer, "—")
                if va != vb and not (stop_changed and "—" in (va, vb)):
                    moved[(va, vb)].add(layer)
            if not moved:
                unchanged += 1
            for (va, vb), layers in moved.items():
                add(path_changes, (lane, va, vb), cell, layers)
        for lane in sorted(set(a.get("candidates", {})) | set(b.get("candidates", {}))):
            before = {layer: _tried_text(g["value"]) for g in a.get("candidates", {}).get(lane, []) for layer in g["layers"]}
            after = {layer: _tried_text(g["value"]) for g in b.get("candidates", {}).get(lane, []) for layer in g["layers"]}
            moved = defaultdict(set)
            for layer in sorted(set(before) | set(after)):
                va, vb = before.get(layer, "—"), after.get(layer, "—")
                if va != vb and not (stop_changed and "—" in (va, vb)):
                    moved[(va, vb)].add(layer)
            for (va, vb), layers in moved.items():
                add(cand_changes, (lane, va, vb), cell, layers)

    def rows(bucket, kind):
        out = []
        for key, row in bucket.items():
            cells = sorted(row["cells"])
            lane_like = kind in ("path", "candidates")
            out.append({"kind": kind, "lane": key[0] if lane_like else "", "field": "" if lane_like else key[0],
                        "title": titles.get(key[0], key[0]) if lane_like else key[0],
                        "before": key[1], "after": key[2],
                        "cells": [list(c) for c in cells],
                        "systems": sorted({c[0] for c in cells}), "layouts": sorted({c[1] for c in cells}),
                        "layers": _ranges(row["layers"]) if row["layers"] else ""})
        return sorted(out, key=lambda r: (r["lane"] or r["field"], r["before"], r["after"]))

    # verdict changes (when both audits were judged), one row per (claim, lane, before, after)
    verdict_changes: dict[tuple, dict] = {}
    va, vb = _worst_verdicts(old), _worst_verdicts(new)
    stopped = {cell for cell in common if old_cells[cell].get("status") != new_cells[cell].get("status")}
    if va and vb:
        for key in sorted(set(va) | set(vb)):
            cell = (key[1], key[2])
            if cell not in set(common):
                continue
            before, after = va.get(key, "—"), vb.get(key, "—")
            if before != after and not (cell in stopped and "—" in (before, after)):
                add(verdict_changes, (key[0] or "(no claim)", before, after), cell)
    only_old = sorted(set(old_cells) - set(new_cells))
    only_new = sorted(set(new_cells) - set(old_cells))
    changes = (rows(path_changes, "path") + rows(cand_changes, "candidates") + rows(cell_changes, "cell")
               + rows(verdict_changes, "verdict"))
    return {
        "schema": DIFF_SCHEMA,
        "from": {"pin": old["pin"].get("name"), "vllm_version": old["pin"].get("vllm_version")},
        "to": {"pin": new["pin"].get("name"), "vllm_version": new["pin"].get("vllm_version")},
        "changes": changes,
        "unchanged_lanes": unchanged,
        "compared_lanes": compared,
        "cells_compared": len(common),
        "only_in_from": [list(c) for c in only_old],
        "only_in_to": [list(c) for c in only_new],
        "empty": not changes and not only_old and not only_new,
    }


_SEVERITY = ("CRASH", "MISMATCH", "SILENT_FALLBACK", "RANK_DISAGREE", "MATCH", "NOT_EXERCISED", "UNVERIFIED")


def _worst_verdicts(routing: dict) -> dict[tuple, str]:
    """(claim, system, layout, lane) -> its most severe verdict over the lane's layer groups."""
    out: dict[tuple, str] = {}
    for r in (routing.get("verdicts") or {}).get("rows", []):
        key = (r["claim"], r["system"], r["layout"], r["lane"])
        if key not in out or _SEVERITY.index(r["verdict"]) < _SEVERITY.index(out[key]):
            out[key] = r["verdict"]
    return out


def load_routing(reports_dir: Path, pin: str) -> dict:
    path = Path(reports_dir) / pin / "routing.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"no audit of {pin!r}: {path} does not exist",
                         hint=f"run `make audit PIN={pin}` first") from None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    if data.get("schema") != 1:
        raise UsageError(f"{path} has routing schema {data.get('schema')!r}; this harness reads 1",
                         hint=f"re-render it: make audit PIN={pin}")
    return data


def render_diff(d: dict) -> str:
    from .render import _env

    return _env().get_template("diff.md.j2").render(d=d)


def write_diff(reports_dir: Path, from_pin: str, to_pin: str) -> tuple[Path, Path, dict]:
    """Render reports/diffs/<from>..<to>.md and .json (both rendered before either is replaced)."""
    from .fsutil import write_all_atomic

    d = diff_routings(load_routing(reports_dir, from_pin), load_routing(reports_dir, to_pin))
    out = Path(reports_dir) / "diffs"
    md, js = out / f"{from_pin}..{to_pin}.md", out / f"{from_pin}..{to_pin}.json"
    write_all_atomic({js: json.dumps(d, indent=1, sort_keys=True, ensure_ascii=False) + "\n", md: render_diff(d)})
    return md, js, d
