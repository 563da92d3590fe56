"""Comparing routing cells produced by different runtimes: the evidence, not the prose, and not what
legitimately differs between places (paths, timings, the tools on PATH, variables the runtime set)."""
from __future__ import annotations

COMPARED = ("lanes", "attention_candidates", "candidates", "config", "depth", "device", "layer_kinds",
            "not_applicable", "not_reached", "raises", "simulated", "stand_in_calls", "status", "availability",
            "failure", "evidence")


#: what a lane value record takes from its audit rather than its evidence (audit/report/values.py: the family in the
#: claims' words, the cell's refusal and raise flags): left out, as every derived word is
DERIVED = ("family", "flags", "raises")


def _evidence_lanes(lanes: dict | None) -> dict | None:
    if lanes is None:
        return None
    return {lane: [{**g, "value": {k: v for k, v in g["value"].items() if k not in DERIVED}}
                   if isinstance(g.get("value"), dict) else g for g in groups] for lane, groups in lanes.items()}


def comparable(cell: dict) -> dict:
    out = {k: cell.get(k) for k in COMPARED}
    out["lanes"] = _evidence_lanes(cell.get("lanes"))
    out["stages"] = [(s.get("stage"), s.get("ok")) for s in cell.get("stages", [])]
    out["packages"] = cell.get("fingerprint", {}).get("packages")
    out["modules"] = cell.get("fingerprint", {}).get("modules")
    return out


def local_cells(probed_run) -> dict:
    """Routing cells of the session's local run (tests.conftest.probed_run), by (system, layout)."""
    from audit.evidence import files as evidence
    from audit.report import routing
    from audit.models.kimi_k3 import KIMI_K3

    req, _ = probed_run
    built = routing.build_routing(evidence.read_dir(req.evidence_dir), KIMI_K3, pin={},
                                  expected=[(s.name, l.name) for s, l in req.cells])
    return {(c["system"], c["layout"]): c for c in built["cells"]}
