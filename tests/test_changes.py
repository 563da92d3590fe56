"""The classification table (audit/report/changes.py): one case per rule, each the first rule that holds for its
row; every rule of the table is exercised; the table alone decides what a difference is and whether it gates."""
import ast
import re

import pytest

from audit.report import changes
from tests.conftest import ROOT


def row(facet, a=None, b=None, **context):
    return {"facet": facet, "a": a or {}, "b": b or {}, "cells": [["b200_sxm", "tp8"]], **context}


ACTIVE = {"state": "active", "identity": ["MarlinExperts", False], "kernel": "MarlinExperts"}
OTHER = {"state": "active", "identity": ["HummingIndexedExperts", False], "kernel": "HummingIndexedExperts"}
#: (row, kind it must get, a word of the reason): one per rule, in the table's order
CASES = [
    (row("standin", {"state": "fits"}, {"state": "misfit"}), "standin", "does not fit"),
    (row("standin", {"state": "not-needed"}, {"state": "fits"}), "information", "declared to change nothing"),
    (row("construction", {"refused_stage": "load"}, {"refused_stage": "construction"}, refused_both=True),
     "refusal-moved", "moved stage"),
    (row("lane", ACTIVE, {"state": "hidden", "by": "refusal"}, refused_both=True), "information",
     "refused in both builds"),
    (row("lane", ACTIVE, {**ACTIVE, "family": "marlin"}), "information", "only its note differs"),
    (row("lane", {"state": "inactive", "identity": ["not requested", True]},
         {"state": "inactive", "identity": ["not built", True]}), "information", "takes nothing on either side"),
    (row("lane", {"state": "absent"}, {"state": "inactive", "identity": ["not requested", True]}), "information",
     "newly read"),
    (row("lane", {"state": "inactive", "identity": ["not requested", True]}, {"state": "absent"}), "information",
     "no longer read"),
    (row("lane", {"state": "hidden", "by": "refusal"}, ACTIVE), "refusal", "vLLM refused to build"),
    (row("dispatch", {"state": "hidden", "by": "stop", "choice": "—"}, {"state": "active", "choice": "T1"}), "stop",
     "simulation could not build"),
    (row("lane", {"state": "absent"}, ACTIVE), "path", "appears or goes"),
    (row("lane", ACTIVE, OTHER, experts_lane=True), "experts", "class of the routed experts"),
    (row("lane", ACTIVE, OTHER), "kernel", "what runs in the lane"),
    (row("candidates", {"chosen": "MarlinExperts"}, {"chosen": "MarlinExperts"}), "information", "same candidate"),
    (row("candidates", {"chosen": "MarlinExperts"}, {"chosen": "HummingIndexedExperts"}), "kernel", "another candidate"),
    (row("attention", {"valid": ["TRITON_MLA"]}, {"valid": ["TRITON_MLA"]}), "information", "same valid backends"),
    (row("attention", {"valid": ["TRITON_MLA"]}, {"valid": ["FLASHMLA", "TRITON_MLA"]}), "kernel", "may choose from"),
    (row("construction", {"refused": False}, {"refused": True, "refused_stage": "construction"}), "refusal",
     "refuses to build"),
    (row("construction", {"refused": False}, {"refused": False}), "stop", "how far construction got"),
    (row("post-load", {"state": "ran"}, {"state": "ran"}), "information", "count of post-load steps"),
    (row("post-load", {"state": "ran", "refused": False}, {"state": "refused", "refused": True}), "refusal",
     "refuses to load"),
    (row("post-load", {"state": "ran"}, {"state": "limit"}), "stop", "simulation limit"),
    (row("evidence"), "information", "evidence level"),
    (row("probe"), "probe", "drift"),
    (row("availability", served=True), "availability", "selection moved"),
    (row("availability", served=False), "information", "changed no selection"),
    (row("package"), "information", "package version"),
    (row("dispatch", {"state": "absent", "choice": "—"}, {"state": "inactive", "choice": "not taken: x"}),
     "information", "newly read that takes nothing"),
    (row("dispatch", {"state": "active", "choice": "FULL graph, 1 tokens"},
         {"state": "active", "choice": "FULL graph, 1 tokens: stock path (x not taken)",
          "annotates": "FULL graph, 1 tokens"}), "information", "newly annotated"),
    (row("dispatch", {"state": "active", "choice": "FULL", "step_path": False},
         {"state": "active", "choice": "FULL: x", "step_path": True}), "path", "step path takes"),
    (row("dispatch", {"state": "active", "choice": "T", "refused": False},
         {"state": "active", "choice": "vLLM raises: E", "refused": True}), "refusal", "raises on these batches"),
    (row("dispatch", {"state": "active", "choice": "vLLM raises: E", "refused": True},
         {"state": "active", "choice": "vLLM raises: F", "refused": True}), "information", "in both builds"),
    (row("dispatch", {"state": "active", "choice": "T0"}, {"state": "active", "choice": "T1"}), "tier",
     "per-call choice moved"),
    (row("draft", name="draft not recorded apart"), "information", "predates drafts named apart"),
    (row("draft", name="draft class"), "path", "another class"),
    (row("draft", name="draft shares"), "information", "target modules the draft holds"),
    (row("verdict"), "verdict", "verdict moved"),
]


@pytest.mark.parametrize("case,kind,word", CASES, ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_each_rule(case, kind, word):
    got, reason = changes.classify(case, "vLLM")
    assert got == kind and word in reason, (got, reason)
    assert changes.KINDS[got].gates == (kind in changes.GATING)


def test_every_rule_of_the_table_is_exercised_and_each_case_stops_at_its_own_rule():
    hit = []
    for case, _, _ in CASES:
        hit.append(next(i for i, rule in enumerate(changes.RULES) if case["facet"] in rule.facets and rule.holds(case)))
    assert sorted(set(hit)) == list(range(len(changes.RULES))), \
        f"rules no case reaches: {sorted(set(range(len(changes.RULES))) - set(hit))}"


def test_every_facet_ends_in_a_catch_all_and_an_unknown_facet_is_an_error():
    facets = {f for rule in changes.RULES for f in rule.facets}
    for facet in facets:
        assert changes.classify(row(facet), "vLLM")[0] in changes.KINDS
    with pytest.raises(ValueError, match="no classification rule"):
        changes.classify(row("nonsense"), "vLLM")


def test_the_ranks_put_experts_and_paths_before_refusals_before_kernels_before_tiers_before_information():
    k = changes.KINDS
    assert k["standin"].rank < k["experts"].rank == k["path"].rank < k["refusal"].rank < k["kernel"].rank \
        < k["tier"].rank < k["refusal-moved"].rank < k["information"].rank
    assert changes.GATING == ("standin", "experts", "path", "refusal", "kernel", "stop", "probe", "availability", "tier")


def test_counts_come_from_the_classed_rows_in_one_unit():
    rows = changes.classify_all([row("lane", ACTIVE, OTHER, experts_lane=True), row("package"),
                                 {**row("availability"), "cells": [["b200_sxm", "tp8"]]},
                                 {**row("dispatch", {"state": "active", "choice": "a"},
                                        {"state": "active", "choice": "b"}), "cells": [["l40s", "tp8"]]}], "vLLM")
    t = changes.tally(rows)
    assert t["serving_changes"] == 3 and t["serving_cells"] == 2  # the availability answer sits beside the experts
    assert t["by_class"]["experts"] == 1 and t["by_class"]["availability"] == 1 and t["by_class"]["tier"] == 1
    assert t["information_changes"] == 1
    assert changes.headline(t).startswith("3 serving change row(s) in 2 cell(s) (1 experts class, 1 availability answer")


#: the words a module would use to decide what a difference is or whether it gates
_DECIDING = re.compile(r"""["'](serving|class|information)["']\s*:|\[["'](serving|class)["']\]\s*=[^=]""")


def test_no_module_but_the_table_decides_what_a_difference_is():
    """grep for a row's kind or gate being set: only audit/report/changes.py does it."""
    found = []
    for path in sorted((ROOT / "audit").rglob("*.py")):
        if path.name == "changes.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _DECIDING.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_no_function_in_the_report_package_is_longer_than_100_lines():
    long = []
    for path in sorted((ROOT / "audit" / "report").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
