"""What a lane value record (``audit/lanevalue.py``) takes from its cell and its audit: the backend family in the perf
database's words, whether vLLM refuses the deployment, whether it raises on a batch the lane serves; and the
upgrade of a schema 2 routing (lane values as sentences) to records."""
from __future__ import annotations

from audit.lanevalue import ROUTING_SCHEMA, from_fields, from_modules, inactive, is_inactive, make

# --- cell-level parts of a record: families, refusals, raises ---------------------------------------------------
def finish(routing: dict, profile, label_map: dict[str, str] | None = None) -> dict:
    """Fill in what a value's record takes from outside its own reading, in place: its backend family (the
    profile's tables and the claims' label map, :func:`audit.report.labels.derive`), ``refused`` where vLLM refuses
    the cell's deployment, and ``raises-at-dispatch`` (with where and why) where vLLM raises on a batch the lane
    serves (its dispatch lanes, the profile's ``judged``). Idempotent: the same routing and map give the same
    records."""
    from audit.report.labels import derive
    from audit.report.refusals import cell_refused, dispatch_raise

    for cell in routing.get("cells", []):
        refused = bool(cell_refused(cell))
        models = [cell.get("lanes") or {}, ((cell.get("draft") or {}).get("lanes")) or {}]  # a draft's rows too
        for lane, groups in (x for lanes in models for x in lanes.items()):
            for g in groups:
                value = g.get("value")
                if not isinstance(value, dict):
                    continue
                family = derive(profile, lane, g, label_map or {})[1]
                value["family"] = "" if family == "unknown" else family
                flags = set(value.get("flags", ())) - {"refused", "raises-at-dispatch"}
                value.pop("raises", None)
                if refused:
                    flags.add("refused")
                raised = None if refused or is_inactive(value) else dispatch_raise(cell, lane, g, profile)
                if raised is not None:
                    flags.add("raises-at-dispatch")
                    value["raises"] = raised
                value["flags"] = sorted(flags)
    return routing


# --- schema 2 (lane values as sentences) -> schema 3 ------------------------------------------------------------
#: the words schema 2 wrote where a lane took nothing (read only to upgrade such reports)
_V2_INACTIVE = ("not requested", "not taken", "not exercised", "stock path (", "none: no MoE runner", "not built:")


def _legacy_postload(profile, source: str, said: str, ident: str) -> dict:
    """A post-load reading's schema 2 sentence as the record today's reading gives for the same facts (each reading's
    own words, ``POSTLOAD_LEGACY`` and the profile's ``postload_legacy``); a sentence none of them reads keeps what
    schema 2 said decides serving as its kernel, the rest as a note."""
    from audit.report.routing import POSTLOAD_LEGACY

    reading = source.split(".", 1)[1] if source.startswith("postload.") else ""
    if profile.model_state is not None and reading == profile.model_state.key:
        reading = "model-state"
    parse = {**POSTLOAD_LEGACY, **profile.postload_legacy}.get(reading)
    record = parse(said, ident) if parse is not None else None
    if record is not None:
        return record
    rest = said[len(ident):].strip() if said.startswith(ident) else ""
    return make(ident, note=rest.strip("() ;"))


def upgrade(routing: dict, profile) -> dict:
    """A schema 2 routing (lane values as sentences) as schema 3, in place: each value's record is read again from
    the evidence the group kept (``raw``) the way an audit reads it today; a post-load reading, whose evidence
    schema 2 did not keep, becomes a record of its sentence (the part schema 2 said decides serving is the kernel,
    the rest a note). The label map is the one the routing's verdicts recorded."""
    kernels_of = profile.backend_labels.kernels if profile.backend_labels is not None else {}
    sources = {src.target: src for lane in profile.lanes for src in lane.sources}
    for cell in routing.get("cells", []):
        for lane, groups in (cell.get("lanes") or {}).items():
            for g in groups:
                if isinstance(g.get("value"), dict):
                    continue
                said = str(g.get("value", ""))
                ident = str(g.pop("identity", "") or said)
                raw = g.get("raw") or {}
                fields = raw.get("fields") or []
                if said.startswith(_V2_INACTIVE):
                    record = inactive(said)
                elif fields and isinstance(fields[0], list):
                    record = from_modules(fields)
                elif fields and raw.get("source") in sources:
                    src = sources[raw["source"]]
                    record = from_fields(list(fields[:len(src.fields)]), label=src.label, kernels=kernels_of.get(lane))
                else:
                    record = _legacy_postload(profile, str(raw.get("source", "")), said, ident)
                g["value"] = record
    routing["schema"] = ROUTING_SCHEMA
    return finish(routing, profile, (routing.get("verdicts") or {}).get("label_map"))
