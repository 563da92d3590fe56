"""Labels a perf database can take: per (system, layout, phase, token-count tier), the kernel lane and
``kernel_source`` label the audit's evidence gives, in that database's own vocabulary.

Rows with dispatch tiers also say, per workload (``by_tokens``: decode batch, prefill chunk, verify
width), which lane path serves it, its label, and vLLM's per-call choices there.

Verdicts judge a perf database's hand-written labels; this file lets it take them from the audit
instead (``reports/<pin>/labels.json``). Every row carries the evidence level it rests on and the
layers it covers; what the harness cannot name stays ``unknown``, never guessed. A configuration vLLM
refuses (at construction or at load) gets no labels, only the refusal under ``not_labelled``. Pure data in, pure
data out: the same routing always gives the same file.
"""
from __future__ import annotations

from audit import engines

import json

from audit.errors import RenderError
from audit.report.dispatch import serving_group, serving_path, step_path_group, tier_choice
from audit.report.expectations import sm_family
from audit.report.labels import derive
from audit.lanevalue import is_inactive, text
from audit.report.refusals import cell_refused
from audit.systems import SYSTEMS
from probes.core import tiers

LABELS_SCHEMA = 1
_UNKNOWN_PRECISION = ("unknown: the harness has no table entry for this backend's activation precision")


def moe_perf_lane(profile, group: dict) -> str:
    """The perf database's lane of a routed experts lane group: its precision, by the rules of *profile*'s
    quantization schemes (``probes/schemes``) for the backend vLLM chose, else unknown."""
    raw = group.get("raw") or {}
    fields = raw.get("fields") or []
    backend = str(fields[0]).rsplit(".", 1)[-1] if fields else ""
    return profile.precision_lane(str(raw.get("source", "")), backend)


def _tiers(cell: dict, judged, layers: list[int]) -> dict:
    """Per dispatch lane, the choice at each workload of the group overlapping *layers*."""
    dispatch = (cell.get("dispatch") or {}).get("lanes") or {}
    out = {}
    for dlane, prefix in judged.dispatch:
        for g in dispatch.get(dlane, []):
            if g.get("role", "target") != "target" or (g.get("layers") and not set(g["layers"]) & set(layers)):
                continue
            tiers = {k: v for k, v in sorted(g.get("tiers", {}).items()) if not prefix or k.startswith(prefix)}
            if tiers:
                out[dlane] = {"level": g.get("level", "dispatch"), "tiers": tiers}
            break
    return out


def _by_tokens(profile, cell: dict, judged, group: dict, label_map: dict[str, str]) -> list[dict]:
    """Per workload of the lane's phases: the label of the lane path that serves it (a short prefill chunk
    can take MLA's decode path; a step *profile*'s own step path takes is served by its kernels) and vLLM's
    per-call choices there, or why it is unknown."""
    out, lane, own = [], judged.lane, profile.step_path
    for workload in (cell.get("dispatch") or {}).get("workloads", []):
        if workload.split(" ")[0] not in judged.workloads:
            continue
        entry: dict = {"tokens": workload}
        serving = serving_group(cell, lane, group, workload, profile)
        if isinstance(serving, str):
            entry.update(kernel_source="unknown", backend="unknown", why=serving)
        else:
            slane, sgroup, note = serving
            label, family, _ = derive(profile, slane, sgroup, label_map)
            entry.update(kernel_source=label, backend=family, harness_lane=slane, kernel=sgroup["value"].get("kernel", ""))
            if note:
                entry["why"] = note
        choices = {}
        path = serving_path(cell, workload)
        if path:
            choices["serving_path"] = path
        if step_path_group(cell, lane, group, workload, own) is not None:
            # the stock per-call choices do not serve a step the model's own step path takes
            found = tier_choice(cell, own.lane, [], workload)
            if found is not None:
                choices[own.lane] = found[0]
        else:
            for dlane, _prefix in judged.dispatch:
                found = tier_choice(cell, dlane, group["layers"], workload)
                if found is not None:
                    choices[dlane] = found[0]
        entry["choices"] = choices
        refused = next((c for c in choices.values() if tiers.refused(c)), None)
        if refused:  # vLLM raises on this batch: it is not served, so it has no label
            entry.update(kernel_source="refused", backend="refused", why=refused)
            entry.pop("harness_lane", None)
            entry.pop("kernel", None)
        out.append(entry)
    return out


def build_labels(routing: dict, profile, label_map: dict[str, str] | None = None) -> dict:
    """The labels file for one audit (see module doc), in its model's vocabulary (*profile*'s judged lanes)."""
    if routing.get("model") != profile.name:
        raise RenderError(f"the routing is of the model {routing.get('model')!r}, labelled as {profile.name!r}'s")
    rows, skipped = [], []
    for cell in routing["cells"]:
        system, layout = cell["system"], cell["layout"]
        if cell.get("status") == "INCOMPLETE":
            skipped.append({"system": system, "layout": layout, "why": "the cell did not finish"})
            continue
        refused = cell_refused(cell, engines.get(profile.engine).title)
        if refused:  # nothing serves there: a label would describe a server that never starts
            skipped.append({"system": system, "layout": layout, "why": refused})
            continue
        sysobj = SYSTEMS.get(system)
        draft = cell.get("draft") or {}
        for judged in profile.judged:
            lane, perf_lane, phase = judged.lane, judged.perf_lane, judged.phase
            # the target's rows, then a speculative draft's (its own rows: its class, its layers as vLLM numbers
            # them; its per-call choices are the dispatch section's, so it carries none here)
            for model, g in [*(("target", g) for g in cell.get("lanes", {}).get(lane, [])),
                             *(("draft", g) for g in (draft.get("lanes") or {}).get(lane, []))]:
                if is_inactive(g.get("value")):
                    skipped.append({"system": system, "layout": layout, "lane": lane, "model": model, "why": text(g)})
                    continue
                label, family, how = derive(profile, lane, g, label_map or {})
                plane = perf_lane or moe_perf_lane(profile, g)
                row = {"system": system, "sm": sm_family(sysobj) if sysobj else "", "layout": layout,
                       "model": model, "lane": plane, "harness_lane": lane, "phase": g.get("phase", phase),
                       "tokens": "all", "layers": g["ranges"], "kernel_source": label, "backend": family,
                       "kernel": g["value"].get("kernel", ""),
                       "how": how if plane != "unknown" else _UNKNOWN_PRECISION,
                       "value": text(g), "evidence": g.get("evidence", cell.get("evidence", "none"))}
                if model == "draft":
                    row["draft_class"] = draft.get("cls", "")
                tiers = _tiers(cell, judged, g["layers"]) if model == "target" else {}
                if tiers:
                    row["dispatch"] = tiers
                    row["by_tokens"] = _by_tokens(profile, cell, judged, g, label_map or {})
                rows.append(row)
    rows.sort(key=lambda r: (r["lane"], r["system"], r["layout"], r["phase"], r["model"] != "target", r["layers"]))
    return {"schema": LABELS_SCHEMA, "model": profile.name, "architecture": routing.get("architecture"),
            "pin": {k: routing.get("pin", {}).get(k) for k in ("name", "vllm_version", "wheel_sha256")},
            "vocabulary": {"lanes": sorted(set(profile.perf_lanes)),
                           "note": "lane and kernel_source as the perf database's expectations write them; "
                                   "'unknown' where the harness cannot name one"},
            "rows": rows, "not_labelled": skipped}


def labels_json(routing: dict, profile, label_map: dict[str, str] | None = None) -> str:
    return json.dumps(build_labels(routing, profile, label_map), indent=1, sort_keys=True, ensure_ascii=False) + "\n"


__all__ = ["build_labels", "labels_json", "moe_perf_lane", "cell_refused"]
