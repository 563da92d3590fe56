"""Verdicts: every (claim x system x layout x layer group) judged against the routing evidence.

MATCH            the backend family (and label, where both are known) is what the claim says
MISMATCH         another family runs, or a forbidden one (expected vs actual)
SILENT_FALLBACK  the claimed backend was tried and rejected by vLLM's oracle, and something else runs;
                 vLLM logs oracle rejections at DEBUG only, so nothing says so at the default level
NOT_EXERCISED    the layer/phase does not occur in this cell (e.g. spec-verify without speculation)
UNVERIFIED       a lane group no claim covers, or a claim the audit could not judge (its cell did not finish,
                 or no evidence exists for its lane, e.g. a probe target drifted): it stays visible and
                 fails --strict
RANK_DISAGREE    ranks took different paths (observed mode only; resolve mode sees rank 0)
REFUSED          vLLM's own code refused the deployment with an explicit ``raise`` (not an assertion, not an
                 error chained from a call, not about the simulation): during construction, before the claimed
                 layers were built, or at load, while finalizing weights. A server started this way does not
                 serve, so nothing past the refusal is judged; the row says where (construction or load),
                 vLLM's function and message. A stop the simulation caused (an op with no meta
                 implementation, say) is UNVERIFIED, never a refusal.
Every verdict carries the evidence level it rests on.

A claim with ``at`` (a batch size: ``decode 1``, ``prefill 2048``, ``verify 32``) is judged once per
workload against the dispatch tiers resolved for it (audit/report/dispatch.py): the lane path that serves the
batch there (MLA's metadata builder sends short prefill chunks down the decode path) and, where the
claim names them, vLLM's per-call choices. Those rows carry the level ``... (dispatch)``; a choice only a
GPU makes leaves the claim UNVERIFIED, never guessed.
"""
from __future__ import annotations

from audit import engines

from dataclasses import dataclass, replace

from audit.profiles import MOE_LANE
from audit.report.dispatch import serving_group, tier_choice, workload_of, workload_order
from audit.report.expectations import Expectations, ExpectationsError
from audit.report.labels import derive
from audit.lanevalue import is_inactive, short, text
from audit.report.refusals import raise_at
from audit.report.routing import format_ranges
from probes.core import tiers


@dataclass(frozen=True)
class VerdictKind:
    """One kind of verdict: whether it fails the gate (exit 1), and how severe it is when a diff says which of a
    lane's verdicts is the worst (0: the most). What each says is in the ledger's key and README's verdicts section."""
    name: str
    fails_gate: bool
    severity: int


#: the verdict kinds, in the order the ledger counts them: the one list of them (a new kind is an entry here and its
#: meaning in the ledger's key and README)
VERDICT_KINDS: tuple[VerdictKind, ...] = (
    VerdictKind("MATCH", False, 4),
    VerdictKind("MISMATCH", True, 1),
    VerdictKind("SILENT_FALLBACK", True, 2),  # a false claim like MISMATCH, that vLLM logs only at DEBUG
    VerdictKind("REFUSED", True, 0),
    VerdictKind("RANK_DISAGREE", True, 3),
    VerdictKind("NOT_EXERCISED", False, 5),
    VerdictKind("UNVERIFIED", False, 6),  # fails only with --strict
)
VERDICTS = tuple(k.name for k in VERDICT_KINDS)
#: verdicts that fail the gate (exit 1)
FAILING = tuple(k.name for k in VERDICT_KINDS if k.fails_gate)
#: most severe first
SEVERITY = tuple(k.name for k in sorted(VERDICT_KINDS, key=lambda k: k.severity))
class Judged:
    """The harness lanes perf databases label for a model (its profile's ``judged``), in order, with the layer
    kind each is about and, per kind, the first lane (where a refusal no claim covers is written, once)."""

    def __init__(self, profile):
        from audit.report.dispatch import lane_titles

        self.profile = profile
        self.dispatch_titles = lane_titles(profile)
        self.lanes = tuple(j.lane for j in profile.judged)
        self.kind = {j.lane: j.kind for j in profile.judged}
        self.first_of_kind: dict[str, str] = {}
        for j in profile.judged:
            self.first_of_kind.setdefault(j.kind, j.lane)


def _same_model(routing: dict, exp: Expectations, profile) -> None:
    """Claims, routing and profile must all be of one model: claims judged against another model's lanes would
    judge nothing real, and a routing that names no model is refused, never judged as some model's."""
    from audit.errors import RenderError

    if routing.get("model") != profile.name:
        raise RenderError(f"the routing is of the model {routing.get('model')!r}, judged as {profile.name!r}'s")
    if exp.model != profile.name:
        raise ExpectationsError(f"the claims are about the model {exp.model!r}, the audit is of {profile.name!r}",
                                path=str(exp.path), hint=f"pass {profile.name}'s claims (expectations/"
                                                          f"{profile.name}.toml) or --expectations none")


def _candidate_family(profile, t: dict) -> str:
    return profile.moe_family(str(t.get("backend", "")))


def judge(routing: dict, exp: Expectations, profile) -> list[dict]:
    """Every claim of *exp* judged in every cell of *routing*, in the words of *profile* (the routing's model's)."""
    _same_model(routing, exp, profile)
    v = Judged(profile)
    rows = []
    for cell in routing["cells"]:
        system, layout = cell["system"], cell["layout"]
        level = cell.get("evidence", "none")
        if cell.get("load_refused"):
            rows += _load_refusals(cell, exp, v)
            continue
        for lane in v.lanes:
            groups = cell["lanes"].get(lane, [])
            claims = [c for c in exp.claims if c.covers(system, layout, lane)]
            built = {l for g in groups for l in g["layers"]}
            expected_layers = cell.get("layer_kinds", {}).get(v.kind[lane], [])
            missing = sorted(set(expected_layers) - built)
            base = {"system": system, "layout": layout, "lane": lane, "evidence": level}
            if cell["status"] == "INCOMPLETE":
                for c in claims:
                    rows.append({**base, "claim": c.id, "layers": "", "verdict": "UNVERIFIED",
                                 "expected": c.backend or c.kernel_source, "actual": "", "label": "",
                                 "why": "not judged: the cell did not finish (INCOMPLETE)"})
                continue
            failure = cell.get("failure") or {}
            if cell["status"] == "PARTIAL":
                # construction stopped: the claimed layers past that point were never built. vLLM saying no
                # is REFUSED, on the lane whose layer it refused (the others were not built: not judged); the
                # simulation running out (no meta implementation of an op, ...) is a limit of resolve mode: the
                # claim is not judged there, and says why
                stop = next((r.get("layer") for r in cell.get("raises", []) if r.get("layer") is not None), None)
                raised = f"{failure.get('stage')} raised {short(failure.get('type', ''))}: {failure.get('message', '')}"
                limit = failure.get("outcome") == "limit"
                refusing = _refusing_kind(cell, v)
                layers = format_ranges(missing) if missing else (f"from {stop}" if stop is not None else "all")
                if not limit:  # a deployment vLLM refuses serves nothing: no layer of it is judged as serving
                    layers = format_ranges(expected_layers) or layers
                for c in claims:
                    if limit:
                        verdict, why = "UNVERIFIED", (f"not judged: the simulation could not finish construction, "
                                                      f"not a vLLM check ({failure.get('rule')}): {raised}")
                    elif refusing in (None, v.kind[lane]):
                        verdict, why = "REFUSED", f"vLLM refused at construction: {raised}"
                    else:
                        verdict = "UNVERIFIED"
                        why = (f"not judged: vLLM refused this deployment at construction in its "
                               f"{refusing.upper()} layer {stop} (the REFUSED row): it serves nothing")
                    rows.append({**base, "claim": c.id, "layers": layers, "verdict": verdict,
                                 "expected": c.backend or c.kernel_source, "actual": "", "label": "", "why": why})
                if not limit and refusing == v.kind[lane] and not claims and lane == v.first_of_kind[refusing]:
                    rows.append({**base, "claim": "", "layers": layers, "verdict": "REFUSED", "expected": "",
                                 "actual": "", "label": "", "why": f"vLLM refused at construction: {raised}"})
                if not limit:
                    continue
            if not groups and cell["status"] != "PARTIAL":
                for c in claims:
                    rows.append({**base, "claim": c.id, "layers": format_ranges(expected_layers) or "",
                                 "verdict": "UNVERIFIED", "expected": c.backend or c.kernel_source, "actual": "",
                                 "label": "", "why": _no_evidence_why(cell, lane, v)})
            for g in groups:
                label, family, how = derive(v.profile, lane, g, exp.label_map)
                row = {**base, "layers": g["ranges"], "label": label, "actual": family, "value": text(g),
                       "evidence": g.get("evidence", level)}
                split = _split_by_batch(cell, lane, g, v)
                if not claims:
                    exercised = not is_inactive(g.get("value"))
                    if exercised and split:  # one story per batch here too: what serves each, unjudged
                        rows += _unclaimed_by_batch(split, lane, g, row, cell, exp, v)
                        continue
                    rows.append({**row, "claim": "", "verdict": "UNVERIFIED" if exercised else "NOT_EXERCISED",
                                 "expected": "", "why": "no claim covers this lane here" if exercised else text(g)})
                    continue
                for c in claims:
                    if c.at or split:
                        # one story per batch: where another path serves some of the lane's batches (the model's
                        # own step path, or the lane a per-call choice routes them to), a claim about the lane is
                        # judged per batch against what serves each, never as a whole against the lane's kernel
                        rows += _tier_rows(c if c.at else replace(c, at=split), lane, g, row, cell, exp, v)
                        continue
                    rows.append({**row, "claim": c.id, "expected": c.backend or c.kernel_source,
                                 **_verdict(c, lane, g, label, family, how, cell, v.profile)})
        rows += _rank_disagreements(cell, exp)
    return sorted(rows, key=lambda r: (r["claim"], r["system"], r["layout"], r["lane"], r["layers"],
                                       _at_order(r.get("at", ""))))


def _split_by_batch(cell: dict, lane: str, group: dict, v: Judged) -> tuple[str, ...]:
    """The workloads of *lane*'s phases this cell resolved, when another path serves at least one of them (the
    model's own step path, or a lane a per-call choice routes the batch to: the profile's batch routes) and the
    lane's group the others; () when the group serves them all (or where what serves a batch is unknown, which
    the whole-lane judgment already says)."""
    judged = next((j for j in v.profile.judged if j.lane == lane), None)
    if judged is None or (v.profile.step_path is None and not v.profile.batch_routes and not judged.dispatch):
        return ()
    works = [w for w in (cell.get("dispatch") or {}).get("workloads", []) if w.split(" ")[0] in judged.workloads]
    if any(_refusal_at(cell, lane, group, w, v) for w in works):
        return tuple(works)  # vLLM raises on some batches: each is judged on its own
    for w in works:
        served = serving_group(cell, lane, group, w, v.profile)
        if not isinstance(served, str) and (served[0] != lane or served[1] is not group):
            return tuple(works)
    return ()


def _refusal_at(cell: dict, lane: str, group: dict, workload: str, v: Judged) -> str | None:
    """vLLM's raise on the batch *workload* for the lane's group (audit/report/refusals.py), or None. A batch vLLM
    raises on is not served, whatever kernel the lane was built with."""
    return raise_at(cell, lane, group, workload, v.profile)


def _unclaimed_by_batch(works, lane: str, group: dict, row: dict, cell: dict, exp: Expectations,
                        v: Judged) -> list[dict]:
    """A lane no claim covers, in a cell where the model's step path takes some of its batches: one UNVERIFIED row
    per batch naming what serves it there (the step path's own kernel, or the stock one), never the stock kernel
    for every batch."""
    out = []
    for w in works:
        served = serving_group(cell, lane, group, w, v.profile)
        base = {**row, "claim": "", "expected": "", "at": w, "evidence": f"{row['evidence']} (dispatch)",
                "verdict": "UNVERIFIED"}
        refused = _refusal_at(cell, lane, group, w, v)
        if refused:
            out.append({**base, "verdict": "REFUSED", "actual": "", "label": "", "value": "",
                        "why": f"vLLM raises on this batch (a server given it fails): {refused}"})
            continue
        if isinstance(served, str):
            out.append({**base, "actual": "", "label": "", "why": f"no claim covers this lane here; {served}"})
            continue
        slane, sgroup, note = served
        label, family, _ = derive(v.profile, slane, sgroup, exp.label_map)
        out.append({**base, "actual": family, "label": label, "value": text(sgroup),
                    "why": "no claim covers this lane here" + (f"; {note}" if note else "")})
    return out


def _at_order(at: str) -> tuple:
    """Rows without a batch size first, then in workload order."""
    return (0, *workload_order(at)) if at else (-1,)


def _tier_rows(c, lane: str, group: dict, row: dict, cell: dict, exp: Expectations, v: Judged) -> list[dict]:
    """A claim about a batch size, judged at each of its workloads against the dispatch tiers."""
    out = []
    for at in c.at:
        base = {**row, "claim": c.id, "expected": c.backend or c.kernel_source, "at": at,
                "evidence": f"{row['evidence']} (dispatch)"}
        if not cell.get("dispatch"):
            out.append({**base, "verdict": "UNVERIFIED",
                        "why": "not judged at a batch size: this cell resolved no dispatch tiers"})
            continue
        workload = workload_of(cell, at)
        if workload is None:
            phase = at.split(" ")[0]
            resolved = [w for w in cell["dispatch"].get("workloads", []) if w.startswith(phase + " ")]
            if phase == "verify" and not resolved:
                out.append({**base, "verdict": "NOT_EXERCISED",
                            "why": "not exercised: no speculative decoding in this layout, so no verify step"})
            else:
                out.append({**base, "verdict": "UNVERIFIED",
                            "why": f"not judged: the audit resolves no {at} workload (it resolves "
                                   f"{', '.join(resolved) or 'none of that phase'})"})
            continue
        refused = _refusal_at(cell, lane, group, workload, v)
        if refused:
            out.append({**base, "verdict": "REFUSED", "actual": "", "label": "", "value": "",
                        "why": f"vLLM raises on this batch (a server given it fails): {refused}"})
            continue
        serving = serving_group(cell, lane, group, workload, v.profile)
        if isinstance(serving, str):
            out.append({**base, "verdict": "UNVERIFIED", "why": f"not judged: {serving}"})
            continue
        slane, sgroup, note = serving
        label, family, how = derive(v.profile, slane, sgroup, exp.label_map)
        judged = {**base, "label": label, "actual": family, "value": text(sgroup),
                  **_verdict(c, slane, sgroup, label, family, how, cell, v.profile)}
        if note:
            judged["why"] = f"{note}; {judged['why']}"
        if judged["verdict"] == "MATCH":
            judged.update(_dispatch_expectations(c, group, cell, workload, v) or {})
        out.append(judged)
    return out


def _dispatch_expectations(c, group: dict, cell: dict, workload: str, v: Judged) -> dict | None:
    """The claim's ``dispatch`` expectations at one workload: None when all hold."""
    for dlane, expected in c.dispatch:
        found = tier_choice(cell, dlane, group["layers"], workload)
        title = v.dispatch_titles.get(dlane, dlane)
        if found is None:
            return {"verdict": "UNVERIFIED", "why": f"not judged: no {title} tier was resolved for these layers"}
        choice = found[0]
        if tiers.refused(choice):
            return {"verdict": "REFUSED", "why": f"vLLM raises on this batch (a server given it fails): {title} at "
                                                 f"{workload}: {choice}"}
        unknown = tiers.unknown(choice)
        if unknown:
            judged_where = "not judged here" if unknown == tiers.NEEDS_GPU else "not judged"
            return {"verdict": "UNVERIFIED", "why": f"{judged_where}: {title} at {workload}: {choice}"}
        if not choice.startswith(expected):
            return {"verdict": "MISMATCH", "why": f"{title} at {workload} is {choice}; the claim says {expected}"}
    if c.dispatch:
        return {"why": "; ".join(f"{v.dispatch_titles.get(d, d)}: {e}" for d, e in c.dispatch) + f" at {workload}"}
    return None


def _refusing_kind(cell: dict, v: Judged) -> str | None:
    """The kind of layer (moe, kda, mla) whose construction vLLM refused, from the probe target that saw the
    raise (``moe.mega_moe_experts`` -> moe); None when no probe saw where."""
    for r in cell.get("raises", []):
        kind = str(r.get("target", "")).split(".", 1)[0]
        if kind in v.first_of_kind:
            return kind
    return None


def _no_evidence_why(cell: dict, lane: str, v: Judged) -> str:
    """Why a claimed lane has no evidence in a cell that finished."""
    drifted = [d["target"] for d in cell.get("drift", [])]
    if drifted:
        return f"not judged: no evidence for this lane; probe target(s) drifted: {', '.join(sorted(drifted))}"
    if not cell.get("layer_kinds", {}).get(v.kind[lane]) and cell.get("layer_kinds"):
        return f"not judged: this cell built no {v.kind[lane].upper()} layer"
    return "not judged: no evidence was recorded for this lane"


def _load_refusals(cell: dict, exp: Expectations, v: Judged) -> list[dict]:
    """A cell vLLM refuses at load serves nothing. As at construction, the refusal is one event on the kind of
    layer vLLM refused (a claim on that kind is REFUSED; with no claim there, one REFUSED row without a claim),
    and the claims on other layers are not judged (UNVERIFIED), since nothing of the deployment serves. When the
    refused module's layer kind is unknown, every claim covering the cell carries the refusal."""
    r = cell["load_refused"]
    where = r.get("module") or "the model"
    raised = f"{r.get('function')} raised {short(r.get('type', ''))}: {r.get('message', '')}"
    why = f"vLLM refused at load: {raised} (in {where}, during {r.get('step', '')})"
    refusing = r.get("kind") if r.get("kind") in v.first_of_kind else None
    kinds = cell.get("layer_kinds", {})
    base = {"system": cell["system"], "layout": cell["layout"], "evidence": f"{cell.get('evidence', 'none')} (post-load)",
            "actual": "", "label": ""}
    rows = []
    for lane in v.lanes:
        layers = format_ranges(kinds.get(v.kind[lane], [])) or ("" if r.get("layer") is None else str(r["layer"]))
        claims = [c for c in exp.claims if c.covers(cell["system"], cell["layout"], lane)]
        for c in claims:
            if refusing in (None, v.kind[lane]):
                verdict, reason = "REFUSED", why
            else:
                verdict = "UNVERIFIED"
                reason = (f"not judged: vLLM refused this deployment at load in its {refusing.upper()} layer "
                          f"{r.get('layer')} (the REFUSED row): it serves nothing")
            rows.append({**base, "lane": lane, "layers": layers, "claim": c.id, "verdict": verdict,
                         "expected": c.backend or c.kernel_source, "why": reason})
        if refusing == v.kind[lane] and not claims and lane == v.first_of_kind[refusing]:
            rows.append({**base, "lane": lane, "layers": layers, "claim": "", "verdict": "REFUSED", "expected": "",
                         "why": why})
    if not any(row["verdict"] == "REFUSED" for row in rows):
        rows.append({**base, "lane": "load", "claim": "", "expected": "", "verdict": "REFUSED", "why": why,
                     "layers": "" if r.get("layer") is None else str(r["layer"])})
    return rows


def _rank_disagreements(cell: dict, exp: Expectations) -> list[dict]:
    """Observed mode: a (lane, layer, phase) where ranks ran different kernel paths."""
    rows = []
    for d in (cell.get("observed") or {}).get("rank_disagree", []):
        system, layout, lane = cell["system"], cell["layout"], d["lane"]
        why = f"{d['phase']}: " + "; ".join(f"rank {r} ran {', '.join(paths) or 'nothing'}"
                                            for r, paths in d["by_rank"].items())
        claims = [c for c in exp.claims if c.covers(system, layout, lane)] or [None]
        for c in claims:
            rows.append({"system": system, "layout": layout, "lane": lane, "evidence": "observed",
                         "claim": c.id if c else "", "layers": "" if d["layer"] is None else str(d["layer"]),
                         "verdict": "RANK_DISAGREE", "expected": (c.backend or c.kernel_source) if c else "",
                         "actual": "", "label": "", "why": why})
    return rows


def _verb(group: dict, cell: dict) -> str:
    """What the evidence shows: a kernel observed running "runs"; a choice resolved from vLLM's code "selects"."""
    return "runs" if str(group.get("evidence", cell.get("evidence", ""))).startswith("observed") else "selects"


def _moe_precision(c, lane: str, group: dict, profile) -> str:
    """Why a MoE claim's perf-db lane names another activation precision than the backend vLLM chose (the lane is
    the precision: the profile's quantization schemes' precision lanes); '' when they agree or when the harness
    cannot tell the chosen backend's precision."""
    from audit.report.perflabels import moe_perf_lane

    lanes = profile.precision_lanes()
    if lane != MOE_LANE or c.lane not in lanes:
        return ""
    actual = moe_perf_lane(profile, group)
    if actual in lanes and actual != c.lane:
        return (f"the claim's lane is {c.lane}, but vLLM {_verb(group, {})} {text(group)}: "
                f"{lanes[actual]}, lane {actual}")
    return ""


def _verdict(c, lane, group, label, family, how, cell, profile) -> dict:
    if is_inactive(group.get("value")):
        return {"verdict": "NOT_EXERCISED", "why": text(group)}
    if family == "unknown":
        return {"verdict": "UNVERIFIED", "why": f"the harness cannot name the backend family of {group['value']}"}
    if family in c.forbidden:
        return {"verdict": "MISMATCH", "why": f"{family} is forbidden by the claim ({label})"}
    if c.backend and family == c.backend or not c.backend and c.kernel_source == label:
        precision = _moe_precision(c, lane, group, profile)  # the right kernel family at another activation precision
        if precision:
            return {"verdict": "MISMATCH", "why": precision}
    if c.backend and family == c.backend:
        note = "" if not c.kernel_source or c.kernel_source == label else \
            f"same family; the perf-db label {c.kernel_source} differs from the derived {label}"
        return {"verdict": "MATCH", "why": note or f"{label} ({how})"}
    if not c.backend and c.kernel_source == label:
        return {"verdict": "MATCH", "why": label}
    # did vLLM try the claimed backend and reject it?
    if lane == MOE_LANE:
        tried = next((t["value"] for t in cell.get("candidates", {}).get("moe", [])
                      if set(t["layers"]) & set(group["layers"])), [])
        rejected = [t for t in tried if not t["supported"] and _candidate_family(profile, t) == c.backend]
        if rejected:
            # the deciding rejection is the claimed family's last one in vLLM's order: the candidate that was
            # next in line to serve (earlier ones, e.g. a batched variant refusing the standard activation
            # format, are refused on every build and decide nothing)
            r = rejected[-1]
            others = "" if len(rejected) == 1 else \
                f" (and {len(rejected) - 1} earlier {c.backend} candidate(s): " + \
                ", ".join(t["cls"] for t in rejected[:-1]) + ")"
            return {"verdict": "SILENT_FALLBACK",
                    "why": f"vLLM rejected {r['cls']} ({r['backend']}): {r.get('reason')}{others}; vLLM {_verb(group, cell)} {label}"}
    return {"verdict": "MISMATCH",
            "why": f"expected {c.backend or c.kernel_source}, vLLM {_verb(group, cell)} {family} ({label})"}


def summary(rows: list[dict]) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for r in rows:
        counts[r["verdict"]] += 1
    return counts


def grouped(rows: list[dict]) -> list[dict]:
    """Rows that differ only by cell, merged: one line per (claim, verdict, lane, expected, actual, why)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["claim"], r["verdict"], r["lane"], r.get("at", ""), r["expected"], r["actual"], r.get("label", ""),
               r["why"], r["evidence"])
        g = out.setdefault(key, {**{k: r[k] for k in ("claim", "verdict", "lane", "expected", "actual", "why",
                                                      "evidence")},
                                 "at": r.get("at", ""), "label": r.get("label", ""), "cells": []})
        g["cells"].append(f"{r['system']}/{r['layout']}")
    order = {v: i for i, v in enumerate(VERDICTS)}
    return sorted(out.values(), key=lambda g: (order[g["verdict"]], g["claim"], g["lane"], _at_order(g["at"]),
                                               g["actual"], g["why"]))


def unjudgeable(routing: dict, exp: Expectations, rows: list[dict], profile) -> list[dict]:
    """Rows for the (system, layout) pairs a claim covers that this run cannot judge: a layout that does not
    exist on the system's SM, a system or layout this run did not audit. A claim is never dropped: each such
    pair is UNVERIFIED with the reason, one row per claim and reason."""
    from audit.systems import SYSTEMS

    layouts = profile.layouts
    cells = {(c["system"], c["layout"]) for c in routing["cells"]}
    judged = {(r["claim"], r["system"], r["layout"]) for r in rows}
    out = []
    for c in exp.claims:
        reasons: dict[str, list[str]] = {}
        for system in c.systems:
            for layout in c.layouts:
                if (system, layout) in cells or (c.id, system, layout) in judged:
                    continue
                s, l = SYSTEMS.get(system), layouts.get(layout)
                if s is not None and l is not None and not l.applies_to(s):
                    why = f"the {layout} layout does not exist on SM {s.sm} ({l.scope})"
                else:
                    why = "not audited in this run"
                reasons.setdefault(why, []).append(f"{system}/{layout}")
        for why, pairs in sorted(reasons.items()):
            out.append({"system": "—", "layout": "—", "lane": c.harness_lane, "evidence": "none", "claim": c.id,
                        "layers": "", "verdict": "UNVERIFIED", "expected": c.backend or c.kernel_source, "actual": "",
                        "label": "", "why": f"not judged: {why}: " + ", ".join(pairs)})
    return out


def attach(routing: dict, exp: Expectations, profile, *, display_path: str) -> dict:
    """Judge and store the verdicts in the routing model (so ledger and diff see them)."""
    rows = judge(routing, exp, profile)
    rows += unjudgeable(routing, exp, rows, profile)
    rows = _in_engine_words(rows, profile)
    routing["verdicts"] = {"expectations": display_path, "summary": summary(rows), "rows": rows,
                           # the claims' label map (kernel source -> backend family): labels.json and the PR
                           # summary read a kernel in the claims' words from routing.json alone
                           "label_map": dict(sorted(exp.label_map.items())),
                           "claims": [{"id": c.id, "lane": c.lane, "layouts": list(c.layouts),
                                       "systems": list(c.systems), "kernel_source": c.kernel_source,
                                       "backend": c.backend, "forbidden": list(c.forbidden), "source": c.source,
                                       **({"at": list(c.at)} if c.at else {}),
                                       **({"dispatch": dict(c.dispatch)} if c.dispatch else {})}
                                      for c in exp.claims]}
    return routing


def _in_engine_words(rows: list[dict], profile) -> list[dict]:
    """The verdicts' reasons name the engine that decided: they are written with the first engine's name, which the
    profile's engine's replaces for every other engine (its contract, ``audit/engines``)."""
    engine = engines.get(profile.engine)
    if engine.name == engines.DEFAULT:
        return rows
    first = engines.get(engines.DEFAULT).title
    return [{**r, "why": str(r.get("why") or "").replace(first, engine.title)} if first in str(r.get("why") or "")
            else r for r in rows]


def whole_lane_row(rows: list[dict], c: dict) -> dict | None:
    """For a verdict change row judged per batch now and not at all before (``before`` is "—"): the row of the same
    claim judged for the whole lane before and not now, covering its cells; None where there is none."""
    cells = {tuple(x) for x in c["cells"]}
    return next((r for r in rows if r["facet"] == "verdict" and r["field"] == c["field"] and r["after"] == "—"
                 and r["before"] != "—" and cells <= {tuple(x) for x in r["cells"]}), None)


def verdict_before(d: dict, c: dict) -> str:
    """A verdict row's before-value in words: a claim judged per batch now and for the whole lane before reads
    "<verdict> for the whole lane in <version>"; one not judged there says so."""
    if c["before"] != "—":
        return c["before"]
    whole = whole_lane_row(d["changes"], c)
    version = d["from"]["vllm_version"]
    return f"{whole['before']} for the whole lane in {version}" if whole else f"not judged there in {version}"