"""Turn combined evidence into the routing model: per cell (system x layout), per lane, per layer.

Pure functions on plain data: no I/O, no vLLM. The result is what ``routing.json`` holds and what
the ledger renders; the same evidence always gives the same routing (stable order, no timings).
"""
from __future__ import annotations

import re
from collections import defaultdict

from .corroborate import corroborate
from .evidence import EvidenceFile
from .layers import format_ranges
from .observed import merge as merge_observed
from .profiles import Lane, Profile

ROUTING_SCHEMA = 1
EVIDENCE_LEVELS = {
    "resolved": "resolved: vLLM's own selection code ran under a simulated NVIDIA platform; no kernel executed",
    "observed": "observed: the kernel entry was hit in the serving process on a real GPU (eager)",
    "observed-in-graph": "observed inside a CUDA graph capture on a real GPU (replays counted separately)",
}
STAGE_ORDER = ("platform", "imports", "config", "distributed", "construct", "construct-draft", "inspect")
STAGE_MEANING = {
    "platform": "simulated platform installed",
    "imports": "vLLM imported under the simulated platform",
    "config": "VllmConfig built from the `vllm serve` arguments",
    "distributed": "parallel groups initialised (fake process group, rank 0)",
    "construct": "model constructed on the meta device (every layer's __init__ ran)",
    "construct-draft": "speculative draft model (MTP) constructed the same way (layouts with speculation only)",
    "inspect": "constructed modules inspected",
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(name: str | None) -> int | None:
    if not name:
        return None
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def short(value) -> str:
    """Display form: enum member name, class name; lists joined with ' / '."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " / ".join(short(v) for v in value)
    text = str(value)
    if ":" in text and not text.startswith("<"):
        return text.rsplit(":", 1)[1].rsplit(".", 1)[-1]
    if re.fullmatch(r"[A-Za-z_][\w]*\.[A-Z][A-Z0-9_]+", text):  # Enum.MEMBER
        return text.split(".", 1)[1]
    if re.fullmatch(r"[a-z_][\w]*(\.[\w]+)+\.[A-Z]\w*", text):  # dotted class path
        return text.rsplit(".", 1)[1]
    return text


def collapse(per_layer: dict[int, object], raw: dict[int, dict] | None = None) -> list[dict]:
    """Group layers with the same value; groups ordered by their first layer. With ``raw``, each
    group also keeps the undisplayed evidence of its first layer (what labels are derived from)."""
    groups: dict[str, list[int]] = defaultdict(list)
    values: dict[str, object] = {}
    for layer in sorted(per_layer):
        key = repr(per_layer[layer])
        groups[key].append(layer)
        values[key] = per_layer[layer]
    ordered = sorted(groups.items(), key=lambda kv: kv[1][0])
    out = []
    for key, layers in ordered:
        group = {"layers": layers, "ranges": format_ranges(layers), "value": values[key]}
        if raw is not None:
            group["raw"] = raw[layers[0]]
        out.append(group)
    return out


def _field(record: dict, path: str):
    if path in ("result", "cls"):
        return record.get(path)
    head, _, name = path.partition(".")
    value = (record.get(head) or {}).get(name)
    return value


def _layer_kinds(f: EvidenceFile, profile: Profile) -> dict[str, list[int]]:
    kinds: dict[str, set[int]] = defaultdict(set)
    for r in f.of_kind("scope"):
        layer = layer_of(r.get("prefix"))
        cls = str(r.get("cls", "")).rsplit(":", 1)[-1]
        if layer is None:
            continue
        for key, kind in profile.layer_classes.items():
            name, _, leaf = key.partition("@")
            if cls == name and (not leaf or str(r.get("prefix", "")).endswith("." + leaf)):
                kinds[kind].add(layer)
    return {k: sorted(v) for k, v in sorted(kinds.items())}


def _lane_values(f: EvidenceFile, lane: Lane) -> dict[int, dict]:
    per_layer: dict[int, dict] = {}
    for source in lane.sources:
        if source.kind == "module":
            pattern = re.compile(source.target)
            found: dict[int, list] = defaultdict(list)
            for r in f.of_kind("module"):
                if pattern.search(r.get("name", "")):
                    leaf = r["name"].rsplit(".", 1)[-1]
                    found[r["layer"]].append((leaf, [_field(r, p) for p in source.fields]))
            for layer, items in found.items():
                if layer not in per_layer:
                    raw = [[leaf, *vals] for leaf, vals in sorted(items)]
                    per_layer[layer] = {"raw": raw,
                                        "value": ", ".join(f"{leaf}: {short(v)}" for leaf, *v in raw)}
            continue
        for r in f.records:
            if r.get("kind") != source.kind or r.get("target") != source.target:
                continue
            layer = layer_of(r.get("scope"))
            if layer is None or layer in per_layer:
                continue
            raw = [_field(r, p) for p in source.fields]
            if all(v is None for v in raw):
                continue  # this record does not carry the lane's answer (e.g. an attribute of other releases)
            text = " / ".join(short(v) for v in raw)
            raw = raw + [_field(r, p) for p in source.extra]
            if lane.exercised_if and not _field(r, lane.exercised_if[0]):
                text = f"not exercised: {lane.exercised_if[1]}"
            per_layer[layer] = {"raw": raw, "source": source.target,
                                "value": f"{source.label} {text}".strip() if source.label else text}
    return per_layer


def _candidates(f: EvidenceFile, target: str) -> list[dict]:
    per_layer: dict[int, list] = defaultdict(list)
    for r in f.of_kind("candidate"):
        if r.get("target") != target:
            continue
        layer = layer_of(r.get("scope"))
        if layer is None:
            continue
        per_layer[layer].append({"backend": short(r.get("backend")), "cls": short(r.get("cls")),
                                 "supported": bool(r.get("supported")), "reason": r.get("reason")})
    return collapse({layer: tried for layer, tried in per_layer.items()})


def _attention_candidates(f: EvidenceFile) -> dict | None:
    for r in f.of_kind("select"):
        if r.get("target") != "mla.attn_candidates":
            continue
        res = r.get("result")
        if not (isinstance(res, list) and len(res) == 2):
            continue
        valid, invalid = res
        return {
            "valid": [{"backend": short(v[1]), "priority": v[2]} for v in valid if isinstance(v, list) and len(v) == 3],
            "rejected": sorted(
                ({"backend": short(k), "priority": v[0], "reasons": list(v[1]) if isinstance(v[1], list) else [str(v[1])]}
                 for k, v in (invalid or {}).items() if isinstance(v, list) and len(v) == 2),
                key=lambda d: d["priority"]),
        }
    return None


def _stages(f: EvidenceFile) -> tuple[list[dict], str, dict | None]:
    stages, failure, deepest = [], None, ""
    for r in f.of_kind("stage"):
        stages.append({"stage": r["stage"], "ok": bool(r["ok"])})
        if r["ok"]:
            deepest = r["stage"]
        elif failure is None:
            err = r.get("error") or {}
            failure = {"stage": r["stage"], "type": err.get("type", ""), "message": err.get("message", ""),
                       "where": _scrub_path(err.get("where", ""))}
    return stages, deepest, failure


_SITE = re.compile(r"(?:/[^\s'\"():,]+)*?/(?:lib/python\d\.\d+/)?site-packages/")


def scrub_paths(value, prefixes: dict[str, str]):
    """The same value with machine-specific paths replaced (an environment's site-packages by
    ``<env>/site-packages/``, each prefix by its placeholder), so two machines' evidence compares equal."""
    if isinstance(value, str):
        value = _SITE.sub("<env>/site-packages/", value)
        for prefix, placeholder in prefixes.items():
            if prefix and prefix != "/":
                value = value.replace(prefix, placeholder)
        return value
    if isinstance(value, list):
        return [scrub_paths(v, prefixes) for v in value]
    if isinstance(value, dict):
        return {k: scrub_paths(v, prefixes) for k, v in value.items()}
    return value


def _scrub_path(text: str) -> str:
    """Drop the environment's location from a source path (keeps ledgers host-independent)."""
    return re.sub(r"^.*?/site-packages/", "", text)


def _one(f: EvidenceFile, kind: str) -> dict:
    recs = f.of_kind(kind)
    if not recs:
        return {}
    return {k: v for k, v in recs[-1].items() if k not in ("kind", "seq")}


def build_cell(f: EvidenceFile, profile: Profile) -> dict:
    system, layout = f.cell or ("?", "?")
    stages, deepest, failure = _stages(f)
    lanes, candidates = {}, {}
    kinds = _layer_kinds(f, profile)
    for lane in profile.lanes:
        per_layer = _lane_values(f, lane)
        lanes[lane.id] = collapse({k: v["value"] for k, v in per_layer.items()},
                                  raw={k: {"source": v.get("source", ""), "fields": v["raw"]}
                                       for k, v in per_layer.items()})
        if lane.candidates_target:
            candidates[lane.id] = _candidates(f, lane.candidates_target)
    targets = f.of_kind("target")
    drift = [{"target": t["target"], "title": t.get("title", ""), "required": t.get("required", True),
              "attempts": t.get("attempts", [])} for t in targets if t.get("status") == "drift"]
    not_reached = [t["target"] for t in targets if t.get("status") == "not-reached"]
    not_applicable = [t["target"] for t in targets if t.get("status") == "not-applicable"]
    raises: list[dict] = []
    for r in f.of_kind("raise"):  # one exception propagates through nested probes: keep the innermost
        err = r.get("error") or {}
        key = (err.get("type"), err.get("message"))
        same = next((x for x in raises if (x["type"], x["message"]) == key), None)
        if same is not None:
            same["through"].append(r.get("target"))
            continue
        raises.append({"target": r.get("target"), "scope": r.get("scope"), "layer": layer_of(r.get("scope")),
                       "type": err.get("type"), "message": err.get("message"), "through": []})
    complete = bool(stages) and all(s["ok"] for s in stages) and deepest == STAGE_ORDER[-1]
    sim = _one(f, "simulated")
    return {
        "system": system,
        "layout": layout,
        "evidence": f.header.get("mode") == "resolve" and "resolved" or "observed",
        "status": "COMPLETE" if complete else "PARTIAL",
        "stages": stages,
        "depth": deepest,
        "failure": failure,
        "layer_kinds": kinds,
        "lanes": lanes,
        "candidates": candidates,
        "attention_candidates": _attention_candidates(f),
        "raises": raises,
        "probe_errors": [{"where": r.get("where"), "error": r.get("error")} for r in f.of_kind("probe_error")],
        "drift": drift,
        "not_reached": not_reached,
        "not_applicable": not_applicable,
        "config": _one(f, "config"),
        "argv": (_one(f, "job").get("argv") or [])[:1] + ["serve", "<model-dir>"] + (_one(f, "job").get("argv") or [])[3:],
        "simulated": sim.get("items", {}),
        "stand_in_calls": sim.get("stand_in_calls", []),
        "device": sim.get("device", {}),
        "availability": _one(f, "availability"),
        "fingerprint": _one(f, "fingerprint"),
    }


def _observed_raw(row: dict) -> dict:
    """What labels are derived from, in the shape resolve mode's lanes have (see audit.labels)."""
    if row["lane"] == "moe" and row.get("backend") == "DeepGemmMegaMoEExperts":
        return {"source": "moe.mega_moe_experts", "fields": [row["backend"]]}
    return {"source": "observed", "fields": [row["backend"]] if row.get("backend") and row["lane"] != "moe" else []}


def observed_cell(system: str, layout: str, observed: dict) -> dict:
    """A cell known only from observe-mode processes: its lanes are the kernel paths that ran."""
    cell = incomplete_cell(system, layout, reason="", log_tail="")
    lanes: dict[str, list] = {}
    for row in observed["rows"]:
        lanes.setdefault(row["lane"], []).append({
            "layers": row["layers"], "ranges": row["ranges"], "value": row["path"], "phase": row["phase"],
            "evidence": row["evidence"], "raw": _observed_raw(row)})
    cell.update(status="COMPLETE", evidence="observed", failure=None, lanes=lanes, observed=observed,
                layer_kinds={})
    return cell


def incomplete_cell(system: str, layout: str, *, reason: str, log_tail: str) -> dict:
    """A cell for which no evidence exists (its process died or never ran)."""
    return {"system": system, "layout": layout, "evidence": "none", "status": "INCOMPLETE", "stages": [],
            "depth": "", "failure": {"stage": "process", "type": "", "message": reason, "where": ""},
            "log_tail": log_tail, "layer_kinds": {}, "lanes": {}, "candidates": {}, "attention_candidates": None,
            "raises": [], "probe_errors": [], "drift": [], "not_reached": [], "not_applicable": [], "config": {},
            "argv": [],
            "simulated": {}, "stand_in_calls": [], "device": {}, "availability": {}, "fingerprint": {}}


def _observed(files: list[EvidenceFile]) -> dict:
    """A cell's observe-mode files: the merged per-rank counts, with the profiler's corroboration if it ran."""
    observed = merge_observed(files)
    profiled = corroborate(files, observed)
    if profiled is not None:
        observed["profiler"] = profiled
    return observed


def build_routing(files: list[EvidenceFile], profile: Profile, *, pin: dict, expected: list[tuple[str, str]],
                  missing: dict[tuple[str, str], dict] | None = None, run: dict | None = None,
                  scrub: dict[str, str] | None = None) -> dict:
    """The whole routing model of one audit: provenance plus one entry per expected cell."""
    observe_files: dict[tuple, list[EvidenceFile]] = defaultdict(list)
    for f in files:
        if f.cell and f.header.get("mode") == "observe":
            observe_files[f.cell].append(f)
    by_cell = {f.cell: f for f in files if f.cell and f.header.get("mode") != "observe"}
    cells = []
    for system, layout in expected:
        f = by_cell.get((system, layout))
        seen = observe_files.get((system, layout))
        if f is not None:
            cell = build_cell(f, profile)
            if seen:
                cell["observed"] = _observed(seen)
            cells.append(cell)
        elif seen:
            cells.append(observed_cell(system, layout, _observed(seen)))
        else:
            info = (missing or {}).get((system, layout), {})
            cells.append(incomplete_cell(system, layout, reason=info.get("reason", "no evidence was written"),
                                         log_tail=info.get("log_tail", "")))
    cells = scrub_paths(cells, dict(sorted((scrub or {}).items(), key=lambda kv: -len(kv[0]))))
    return {"schema": ROUTING_SCHEMA, "model": profile.name, "architecture": profile.architecture,
            "lane_titles": {lane.id: lane.title for lane in profile.lanes},
            "pin": pin, "run": run or {}, "cells": cells}
