"""What a difference between two audits is, decided in one place: the classification table.

The diff (``audit/report/diff.py``) turns two ``routing.json`` into rows, one per distinct (facet, lane or field,
before, after) with the cells and layers it touched; every row is classed here, by the first rule of :data:`RULES`
that holds for it. The pin-bump gate (``audit/report/gate.py``), the diff's tables, the PR summary
(``audit/report/summary.py``), the ledger's "Changes since" and the terminal's closing lines all read the class a
row was given here and count with :func:`tally`; none of them decides anything about a difference itself.

A row's **kind** says what changed and, through :data:`KINDS`, its rank (the order a reader meets it: the most
consequential first) and whether the gate fails on it. A kind that does not gate says why in the row's reason.

Facets (what a row compares):

=============  ===========================================================================================
lane           a lane's value for some layers (a record, ``audit/lanevalue.py``)
candidates     the candidates vLLM's oracle tried for a lane, in order, with why it rejected each
attention      the attention backends vLLM found valid, and why it rejected the others
construction   how far construction went (finished, refused by vLLM, stopped at a simulation limit)
post-load      how far vLLM's post-load path went
evidence       the evidence level of a cell (resolved, observed)
probe          probe targets that drifted, probes that raised
availability   an answer of vLLM's optional-package checks
package        an installed package's version
dispatch       a per-call choice at some batch sizes
standin        how a stand-in fitted the release
draft          a speculative draft's class and layer numbers, and the target modules it holds
verdict        a claim's most severe verdict in a cell (the gate asks about these through its findings)
=============  ===========================================================================================

Each row carries the sides' facts the rules read (``a`` and ``b``: see :func:`side_of_lane` and the diff's
collectors) and the row's context (``refused_both``: every cell of the row is refused by vLLM in both audits;
``served``: a cell of the row has a serving change of another facet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Kind:
    """One kind of difference: its rank (0 first), whether the pin-bump gate fails on it (exit 6), the diff's heading
    for its rows and the word the summary counts it with."""
    name: str
    rank: int
    gates: bool
    title: str
    word: str


#: every kind of difference, most important first (the summary's order; README's table is this one)
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("standin", 0, True, "Stand-ins whose fit to the release changed", "stand-in fit"),
    Kind("experts", 1, True, "Experts class", "experts class"),
    Kind("path", 1, True, "New or removed paths", "new or removed path"),
    Kind("refusal", 2, True, "Refusals (construction, load, dispatch)", "refusal"),
    Kind("kernel", 3, True, "Kernels and backends", "kernel"),
    Kind("stop", 4, True, "Simulation stops (what lies past them is not known)", "simulation stop"),
    Kind("probe", 4, True, "Probe drift and errors", "probe drift or error"),
    Kind("availability", 5, True, "Availability answers that changed a selection", "availability answer"),
    Kind("tier", 6, True, "Per-call tiers (dispatch)", "per-call choice"),
    Kind("refusal-moved", 7, False, "Refusals that moved stage (refused in both builds)", "refusal that moved stage"),
    Kind("information", 8, False, "Information", "information"),
    # a claim's verdict moving is a finding of the gate's second question (new findings), never a serving change
    Kind("verdict", 9, False, "Verdicts", "verdict"),
)}
#: the kinds the gate fails on, in rank order
GATING = tuple(k.name for k in sorted(KINDS.values(), key=lambda k: k.rank) if k.gates)


@dataclass(frozen=True)
class Rule:
    """A row of the classification table: for rows of these facets where ``holds(row)``, the kind and the reason."""
    facets: tuple[str, ...]
    kind: str
    reason: str
    holds: Callable[[dict], bool]


def _a(row: dict) -> dict:
    return row.get("a") or {}


def _b(row: dict) -> dict:
    return row.get("b") or {}


def _lane_state(side: dict) -> str:
    """absent (no value), hidden (a construction stop left it unbuilt or unread), inactive, or active."""
    return side.get("state", "absent")


def _hidden_by(row: dict, what: str) -> bool:
    """One side's value is missing because that side's construction stopped (by vLLM's refusal or the simulation)."""
    return any(side.get("state") == "hidden" and side.get("by") == what for side in (_a(row), _b(row)))


def _appears_or_goes(row: dict) -> bool:
    states = {_lane_state(_a(row)), _lane_state(_b(row))}
    return "active" in states and bool(states & {"absent", "inactive"})


def _refusal_stage_moved(row: dict) -> bool:
    return _a(row).get("refused_stage") != _b(row).get("refused_stage")


def _refused_on_one_side(row: dict) -> bool:
    return bool(_a(row).get("refused")) != bool(_b(row).get("refused"))


LANE_FACETS = ("lane", "candidates", "attention", "dispatch")
#: facets whose rows say "refused in both builds" where vLLM refuses every cell of the row in both audits (the diff
#: keeps such cells in rows of their own)
REFUSAL_FACETS = ("construction", "post-load") + LANE_FACETS

#: the classification table: the first rule that holds for a row decides its kind and reason
RULES: tuple[Rule, ...] = (
    Rule(("standin",), "standin", "a stand-in does not fit its release on one side (and nothing declares the misfit "
                                  "harmless there): what the simulation ran past it may not be {E}'s code as released",
         lambda r: "misfit" in (_a(r).get("state"), _b(r).get("state"))),
    Rule(("standin",), "information", "the stand-in's fit is stated for another release; it fits both, or its misfit "
                                      "is declared to change nothing there (audit/standinfit.py), or one audit did not "
                                      "reach its target", lambda r: True),
    # a deployment vLLM refuses in both audits serves nothing in either
    Rule(("construction", "post-load"), "refusal-moved", "refused in both builds; the refusal moved stage",
         lambda r: r.get("refused_both", False) and _refusal_stage_moved(r)),
    Rule(REFUSAL_FACETS, "information",
         "refused in both builds: serves nothing in either", lambda r: r.get("refused_both", False)),
    # a lane's value
    Rule(("lane",), "information", "the same serving value; only its note differs",
         lambda r: _a(r).get("identity") is not None and _a(r).get("identity") == _b(r).get("identity")),
    Rule(("lane",), "information", "the lane takes nothing on either side; only the words for it differ",
         lambda r: _lane_state(_a(r)) == _lane_state(_b(r)) == "inactive"),
    Rule(("lane",), "information", "a lane newly read that takes nothing",
         lambda r: _lane_state(_a(r)) == "absent" and _lane_state(_b(r)) == "inactive"),
    Rule(("lane",), "information", "a lane no longer read that took nothing",
         lambda r: _lane_state(_a(r)) == "inactive" and _lane_state(_b(r)) == "absent"),
    Rule(("lane", "dispatch"), "refusal", "{E} refused to build the deployment on one side: what it runs where it "
                                          "is built", lambda r: _hidden_by(r, "refusal")),
    Rule(("lane", "dispatch"), "stop", "the simulation could not build the deployment on one side: what it runs "
                                       "where it is built", lambda r: _hidden_by(r, "stop")),
    Rule(("lane",), "path", "a path that takes work appears or goes", _appears_or_goes),
    Rule(("lane",), "experts", "the class of the routed experts changed", lambda r: r.get("experts_lane", False)),
    Rule(("lane",), "kernel", "what runs in the lane changed", lambda r: True),
    # what vLLM chose among
    Rule(("candidates",), "information", "the same candidate chosen; only the others or their reasons differ",
         lambda r: bool(_a(r).get("chosen")) and _a(r).get("chosen") == _b(r).get("chosen")),
    Rule(("candidates",), "kernel", "{E} chose another candidate", lambda r: True),
    Rule(("attention",), "information", "the same valid backends in the same order; only the rejected ones or their "
                                        "reasons differ",
         lambda r: bool(_a(r).get("valid")) and _a(r).get("valid") == _b(r).get("valid")),
    Rule(("attention",), "kernel", "the attention backends {E} may choose from changed", lambda r: True),
    # how far a cell went
    Rule(("construction",), "refusal", "{E} refuses to build the deployment on one side only", _refused_on_one_side),
    Rule(("construction",), "stop", "how far construction got changed (not a refusal by {E})", lambda r: True),
    Rule(("post-load",), "information", "the count of post-load steps only",
         lambda r: _a(r).get("state") == _b(r).get("state") == "ran"),
    Rule(("post-load",), "refusal", "{E} refuses to load the deployment on one side only", _refused_on_one_side),
    Rule(("post-load",), "stop", "post-load reaches a simulation limit on one side: what lies past it is not known",
         lambda r: True),
    Rule(("evidence",), "information", "the evidence level (the ledger says which)", lambda r: True),
    Rule(("probe",), "probe", "the probes could not look where they did before (drift) or raised", lambda r: True),
    Rule(("availability",), "availability", "an availability answer in cells where a selection moved with it",
         lambda r: r.get("served", False)),
    Rule(("availability",), "information", "an availability answer that changed no selection in its cells",
         lambda r: True),
    Rule(("package",), "information", "a package version (what it changes shows in the other rows)", lambda r: True),
    # per-call choices
    Rule(("dispatch",), "information", "a per-call lane newly read that takes nothing",
         lambda r: _a(r).get("state") == "absent" and _b(r).get("state") == "inactive"),
    Rule(("dispatch",), "information", "the same step; newly annotated with a path that does not take it",
         lambda r: _b(r).get("annotates") is not None and _b(r).get("annotates") == _a(r).get("choice")),
    Rule(("dispatch",), "path", "the model's own step path takes these steps on one side only",
         lambda r: bool(_a(r).get("step_path")) != bool(_b(r).get("step_path"))),
    Rule(("dispatch",), "refusal", "{E} raises on these batches on one side only", _refused_on_one_side),
    Rule(("dispatch",), "information", "{E} raises on these batches in both builds; only its message differs",
         lambda r: bool(_a(r).get("refused")) and bool(_b(r).get("refused"))),
    Rule(("dispatch",), "tier", "a per-call choice moved", lambda r: True),
    # a speculative draft beside the target
    Rule(("draft",), "information", "one routing predates drafts named apart (its draft's rows sit under target "
                                    "layers): the target is compared without the draft's layers, the draft not at all",
         lambda r: r.get("name") == "draft not recorded apart"),
    Rule(("draft",), "path", "the speculative draft {E} builds is another class or numbers its layers otherwise",
         lambda r: r.get("name") == "draft class"),
    Rule(("draft",), "information", "the target modules the draft holds as its own (what it serves shows in its "
                                    "lane rows)", lambda r: True),
    Rule(("verdict",), "verdict", "a claim's verdict moved: a finding if it fails now (the gate's second question)",
         lambda r: True),
)


def classify(row: dict, engine: str) -> tuple[str, str]:
    """(kind, reason) of a diff row: the first rule of the table that holds for it (its reason in *engine*'s name)."""
    for rule in RULES:
        if row["facet"] in rule.facets and rule.holds(row):
            return rule.kind, rule.reason.replace("{E}", engine)
    raise ValueError(f"no classification rule covers a {row['facet']!r} row")  # every facet ends in a catch-all


def classify_all(rows: list[dict], engine: str) -> list[dict]:
    """Class every row, in place: availability answers last (they gate only beside a serving change of another
    facet in one of their cells). Each row gets ``class``, ``reason``, ``rank`` and ``serving``."""
    def put(row: dict) -> None:
        kind, reason = classify(row, engine)
        row.update({"class": kind, "reason": reason, "rank": KINDS[kind].rank, "serving": KINDS[kind].gates,
                    "information": "" if KINDS[kind].gates else reason})

    for row in rows:
        if row["facet"] != "availability":
            put(row)
    served = {tuple(c) for r in rows if r["facet"] != "availability" and r["serving"] for c in r["cells"]}
    for row in rows:
        if row["facet"] == "availability":
            row["served"] = bool({tuple(c) for c in row["cells"]} & served)
            put(row)
    return rows


def tally(rows: list[dict]) -> dict:
    """The counts every view gives (one unit: rows of the diff), from its classed rows: serving rows and the cells
    they touch, rows per gating kind, information rows, refusals that moved stage."""
    serving = [r for r in rows if r.get("serving")]
    return {"serving_changes": len(serving),
            "serving_cells": len({tuple(c) for r in serving for c in r["cells"]}),
            "by_class": {k: sum(1 for r in serving if r["class"] == k) for k in GATING},
            "moved_refusals": sum(1 for r in rows if r.get("class") == "refusal-moved"),
            "information_changes": sum(1 for r in rows if r.get("class") == "information")}


def headline(t: dict) -> str:
    """The counts of :func:`tally` in the one sentence the summary, the diff, the ledger and the terminal all print."""
    kinds = ", ".join(f"{n} {KINDS[k].word}" for k, n in t["by_class"].items() if n)
    text = f"{t['serving_changes']} serving change row(s) in {t['serving_cells']} cell(s)" + (f" ({kinds})" if kinds else "")
    if t.get("moved_refusals"):
        text += f"; {t['moved_refusals']} refusal row(s) moved stage (refused in both builds, not gated)"
    return text + f"; {t['information_changes']} information row(s)"


def order_key(row: dict) -> tuple:
    """Rows most important first: by rank, a perf-db lane before others, the most cells first; rows of one lane at
    other batch sizes in batch order."""
    from audit.report.dispatch import workload_order

    first = min((workload_order(w) for ws in (row.get("workloads") or {}).values() for w in ws), default=())
    return (row.get("rank", 9), not row.get("judged", False), -len(row.get("cells", ())),
            row.get("lane") or row.get("field") or "", first, str(row.get("before")), str(row.get("after")))
