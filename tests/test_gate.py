"""The pin-bump gate (audit/report/gate.py) on the routing of real audits (tests/data, copied from reports/):
serving changes fail it whatever the claims say, accepted findings are subtracted, and the diff shows what a
release owner needs (lanes a construction stop hid, a verdict that stays the same against another backend,
both builds' hashes). The gate on a real regressed build of the pinned wheel is in tests/test_gate_vllm.py."""
import copy
import json
from pathlib import Path
import subprocess
import sys
import time

import pytest

from audit.errors import ExitCode
from audit.lanevalue import make
from audit.models.kimi_k3 import KIMI_K3
from audit.report import gate
from audit.report.diff import NOT_BUILT, NOT_READ, _ranges, diff_routings, render_diff
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data"


@pytest.fixture(scope="module")
def v033():
    return json.loads((DATA / "routing-v0.33.0.json").read_text())


def _cell(routing, system, layout):
    return next(c for c in routing["cells"] if (c["system"], c["layout"]) == (system, layout))


def test_a_pin_against_itself_passes_once_its_findings_are_accepted(v033):
    found = gate.findings(v033)
    assert found, "the shipped claims fail on v0.33.0: the data must have findings"
    g = gate.judge_gate(v033, v033, None, KIMI_K3)
    assert not g["serving_changes"] and not g["passed"] and len(g["new_findings"]) == len(found)
    g = gate.judge_gate(v033, v033, {gate.finding_key(f) for f in found}, KIMI_K3)
    assert g["passed"] and g["accepted_findings"] == len(found) and not g["new_findings"]


def test_a_changed_path_fails_the_gate_with_no_claim_about_it(v033):
    old, new = copy.deepcopy(v033), copy.deepcopy(v033)
    for r in (old, new):
        r.pop("verdicts")  # no claim judged at all: the gate still sees the change
    cell = _cell(new, "b200_sxm", "tp8")
    cell["lanes"]["moe"][0]["value"] = make("MarlinExperts", backend="MARLIN")
    g = gate.judge_gate(old, new, None, KIMI_K3)
    assert not g["passed"] and not g["new_findings"]
    [row] = g["serving_changes"]
    assert row["lane"] == "moe" and row["after"] == "MarlinExperts" and row["cells"] == [["b200_sxm", "tp8"]]
    assert row["class"] == "experts" and row["reason"] == "the class of the routed experts changed"


def test_package_versions_are_information_not_a_serving_change(v033):
    new = copy.deepcopy(v033)
    cell = _cell(new, "b200_sxm", "tp8")
    packages = cell["fingerprint"]["packages"]
    name = sorted(packages)[0]
    packages[name] = "0.0.0-other"
    d = diff_routings(v033, new, KIMI_K3)
    [row] = [c for c in d["changes"] if c["facet"] == "package"]
    assert row["field"] == f"package: {name}" and row["serving"] is False and d["serving_changes"] == 0
    assert gate.judge_gate(v033, new, {gate.finding_key(f) for f in gate.findings(v033)}, KIMI_K3)["passed"]


def test_lanes_a_construction_stop_hid_appear_as_changes(v033):
    """A configuration vLLM refused before and builds now: every lane it now runs is a row, none is counted
    among the unchanged pairs."""
    old = copy.deepcopy(v033)
    cell = _cell(old, "b200_sxm", "tp8")
    built = sorted(lane for lane, groups in cell["lanes"].items() if groups)  # a lane of no layer here builds nothing
    cell.update(status="PARTIAL", lanes={}, candidates={},
                failure={"stage": "model", "type": "builtins:NotImplementedError", "message": "planted refusal",
                         "outcome": "refused", "rule": "an explicit raise in vLLM's own code"})
    d = diff_routings(old, v033, KIMI_K3)
    rows = [c for c in d["changes"] if c["facet"] == "lane" and ["b200_sxm", "tp8"] in c["cells"]]
    assert {r["lane"] for r in rows} == set(built)
    read_after = set(v033.get("lanes_read_after_construction", ()))
    assert all(r["before"] == (NOT_READ if r["lane"] in read_after else NOT_BUILT) and r["serving"] for r in rows)
    assert {r["class"] for r in rows} == {"refusal"}  # what the deployment runs now that vLLM builds it
    assert any(c["field"] == "construction" for c in d["changes"])
    assert d["unchanged_lanes"] == d["compared_lanes"] - len(built)


def test_a_verdict_that_stays_mismatch_against_another_backend_is_a_change(v033):
    new = copy.deepcopy(v033)
    row = next(r for r in new["verdicts"]["rows"] if r["verdict"] == "MISMATCH")
    row["actual"] = "some_other_backend"
    d = diff_routings(v033, new, KIMI_K3)
    [change] = [c for c in d["changes"] if c["facet"] == "verdict"]
    assert change["before"].startswith("MISMATCH (") and change["after"].startswith("MISMATCH (")
    assert "some_other_backend" in change["after"] and change["before"] != change["after"]
    # and the gate reads it as a new finding: the accepted one was against the other backend
    g = gate.judge_gate(v033, new, {gate.finding_key(f) for f in gate.findings(v033)}, KIMI_K3)
    assert [f["actual"] for f in g["new_findings"]] == ["some_other_backend"]


def test_model_level_lanes_read_model_not_minus_one():
    assert _ranges({-1}) == "model" and _ranges({-1, 3, 4}) == "model, 3-4" and _ranges({1, 2, 3}) == "1-3"


def test_the_diff_names_both_builds_and_flags_same_name_different_bytes(v033):
    new = copy.deepcopy(v033)
    new["pin"] = {**new["pin"], "name": "v0.33.0-rebuilt", "wheel_sha256": "f" * 64}
    text = render_diff(diff_routings(v033, new, KIMI_K3), KIMI_K3)
    assert v033["pin"]["wheel_sha256"] in text and "f" * 64 in text
    assert "Same vLLM version and wheel file name, different bytes" in text
    assert "Same vLLM version" not in render_diff(diff_routings(v033, v033, KIMI_K3), KIMI_K3)


def test_accepted_findings_round_trip_and_bad_files_name_file_and_line(v033, tmp_path):
    path = tmp_path / "accepted.toml"
    path.write_text(gate.accepted_text(v033, source="test"))
    assert gate.load_accepted(path) == {gate.finding_key(f) for f in gate.findings(v033)}
    cases = [
        ("schema = 2\n", "schema is 2", 1),
        ('schema = 1\n[[finding]]\nsystem = "b200_sxm"\nlayout = "tp8"\nlane = "moe"\n', "needs a non-empty 'verdict'", 2),
        ('schema = 1\n\n[[finding]]\nsystem = "b200_sxm"\nlayout = "tp8"\nlane = "moe"\nverdict = "MISMATCH"\n'
         'colour = "red"\n', "unknown key 'colour'", 8),
        ('schema = 1\n[[finding]]\nsystem = "b200_sxm"\nlayout = "tp8"\nlane = "moe"\nverdict = "MISMATCH"\n'
         'at = 8\n', "'at' must be a string", 7),
    ]
    for text, fragment, line in cases:
        path.write_text(text)
        with pytest.raises(gate.AcceptedFindingsError) as e:
            gate.load_accepted(path)
        assert fragment in str(e.value) and f"{path}:{line}:" in str(e.value), str(e.value)


def test_gate_exit_codes():
    from pathlib import Path

    from audit.cli import _findings_exit
    from audit.core import AuditOutcome

    class Quiet:
        def print(self, *a, **k):
            pass

    def outcome(changes=(), new=(), verdicts=None):
        g = {"baseline": {"pin": "v0.33.0"}, "serving_changes": list(changes), "new_findings": list(new),
             "accepted_findings": 0, "accepted_file": "", "cells_compared": 2, "only_in_baseline": [],
             "only_in_candidate": [], "passed": not changes and not new, "headline": "h"}
        return AuditOutcome(pin="p", report_dir=Path("."), ledger=None, routing_path=None, run_dir=Path("."), cells=2,
                            incomplete=0, partial=0, drift=0, verdicts=verdicts or {"MISMATCH": 4}, gate=g)

    change = {"title": "Routed experts", "before": "a", "after": "b", "cells": [["b200_sxm", "tp8"]], "class": "kernel",
              "where": "tp8: b200_sxm"}
    finding = {"verdict": "MISMATCH", "claim": "c", "system": "b200_sxm", "layout": "tp8", "lane": "moe", "at": "",
               "why": "w"}
    assert _findings_exit(outcome([change]), False, Quiet()) == ExitCode.SERVING_CHANGED == 6
    assert _findings_exit(outcome([change], [finding]), False, Quiet()) == ExitCode.SERVING_CHANGED
    assert _findings_exit(outcome((), [finding]), False, Quiet()) == ExitCode.FINDINGS
    # accepted findings do not fail it, though the absolute verdicts still count MISMATCHes
    assert _findings_exit(outcome(), False, Quiet()) == ExitCode.OK
    assert _findings_exit(outcome(verdicts={"UNVERIFIED": 1}), True, Quiet()) == ExitCode.FINDINGS


def _cli(*args, cwd=ROOT, timeout=120):
    return subprocess.run([sys.executable, "-m", "audit.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


def test_an_explicit_baseline_without_a_report_is_refused_before_any_work(tmp_path):
    reports = tmp_path / "my-reports"
    t0 = time.monotonic()
    r = _cli("audit", "v0.33.0", "--systems", "b200_sxm", "--layouts", "tp8", "--reports", str(reports),
             "--baseline", "v0.32.0")
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert "no audit of 'v0.32.0'" in r.stderr and str(reports) in r.stderr and f"REPORTS={reports}" in r.stderr
    assert time.monotonic() - t0 < 60 and not reports.exists()  # nothing ran, nothing was written


def test_an_unknown_pin_says_how_to_pin_it():
    r = _cli("audit", "nightly-0731")
    assert r.returncode == ExitCode.USAGE
    assert "make lock-add PIN=nightly-0731 DATE=" in r.stderr and "make lock-add PIN=nightly-0731 COMMIT=" in r.stderr


def test_accept_writes_the_findings_of_an_audited_pin(tmp_path, v033):
    reports = tmp_path / "reports"
    (reports / "v0.33.0").mkdir(parents=True)
    (reports / "v0.33.0" / "routing.json").write_text(json.dumps(v033))
    out = tmp_path / "accepted.toml"
    r = _cli("accept", "v0.33.0", "--reports", str(reports), "--accepted", str(out))
    assert r.returncode == ExitCode.OK, r.stderr
    assert gate.load_accepted(out) == {gate.finding_key(f) for f in gate.findings(v033)}
    # a note written by hand survives accepting again
    text = out.read_text().replace('verdict = "', 'note = "known since 0.32"\nverdict = "', 1)
    out.write_text(text)
    assert _cli("accept", "v0.33.0", "--reports", str(reports), "--accepted", str(out)).returncode == ExitCode.OK
    assert 'note = "known since 0.32"' in out.read_text()


def test_what_moves_inside_a_deployment_refused_in_both_builds_is_not_a_serving_change(v033):
    """dep8 on SM 8.9, 9.0 and 12.0: v0.30.0 refuses MegaMoE at load, v0.33.0 at construction. The lanes built
    before the refusal in one and not in the other are shown, marked, and do not fail the gate."""
    v030 = json.loads((DATA / "routing-v0.30.0.json").read_text())
    d = diff_routings(v030, v033, KIMI_K3)
    refused = {("l40s", "dep8"), ("h100_sxm", "dep8"), ("h200_sxm", "dep8"), ("rtx_pro_6000_server", "dep8")}
    inside = [c for c in d["changes"] if c["facet"] != "verdict" and c["cells"] and {tuple(x) for x in c["cells"]} <= refused]
    assert inside and any(c["facet"] == "lane" and c["after"] == NOT_BUILT for c in inside)
    assert all(c["refused_both"] and not c["serving"] for c in inside)
    moved = [c for c in inside if c["class"] == "refusal-moved"]
    assert {c["facet"] for c in moved} == {"construction", "post-load"}  # named as the refusal moving stage
    assert "refused in both builds: serves nothing in either" in render_diff(d, KIMI_K3)
    assert "Refusals that moved stage (refused in both builds) (2, not gated)" in render_diff(d, KIMI_K3)


def test_a_gate_that_shares_no_cell_with_its_baseline_never_passes(v033):
    """A subset audit of a layout the baseline did not audit, with every finding accepted: nothing is compared,
    and a pass would say nothing; the gate fails with its own exit code and says why."""
    from pathlib import Path

    from audit.cli import _findings_exit
    from audit.core import AuditOutcome

    base = copy.deepcopy(v033)
    base["cells"] = [c for c in base["cells"] if c["layout"] == "tp8"]
    cand = copy.deepcopy(v033)
    cand["cells"] = [c for c in cand["cells"] if c["layout"] == "tp16"]
    g = gate.judge_gate(base, cand, {gate.finding_key(f) for f in gate.findings(cand)}, KIMI_K3)
    assert g["cells_compared"] == 0 and not g["serving_changes"] and not g["new_findings"] and not g["passed"]
    lines = []

    class Err:
        def print(self, text, **k):
            lines.append(text)

    out = AuditOutcome(pin="p", report_dir=Path("."), ledger=None, routing_path=None, run_dir=Path("."), cells=1,
                       incomplete=0, partial=0, drift=0, verdicts={"MATCH": 1}, gate=g)
    assert _findings_exit(out, False, Err()) == ExitCode.NOTHING_JUDGED == 7
    assert any("nothing was judged" in l and "share no (system, layout) cell" in l for l in lines)


def test_an_accepted_findings_file_of_another_model_is_refused(tmp_path, v033):
    from audit.core import load_accepted_findings
    from audit.errors import InputFileError
    from audit.models import PROFILES

    k3, gpt = PROFILES["kimi-k3"], PROFILES["gpt-oss-120b"]
    text = gate.accepted_text(v033, source="test")
    assert 'model = "kimi-k3"' in text
    path = tmp_path / "accepted.toml"
    path.write_text(text)
    assert load_accepted_findings(str(path), lock_path=ROOT / "images.lock", profile=k3)[0]
    with pytest.raises(InputFileError) as e:
        load_accepted_findings(str(path), lock_path=ROOT / "images.lock", profile=gpt)
    assert "the accepted findings of the model 'kimi-k3', not of gpt-oss-120b" in str(e.value)
    assert e.value.exit_code == ExitCode.USAGE and e.value.line == 5  # the model line (after three comments, schema)
    # an older file without the model key: its findings' layouts give it away
    path.write_text(text.replace('model = "kimi-k3"\n', ""))
    with pytest.raises(InputFileError) as e:
        load_accepted_findings(str(path), lock_path=ROOT / "images.lock", profile=gpt)
    assert "which gpt-oss-120b does not have" in str(e.value) and e.value.line


def test_a_baseline_whose_cells_lack_fields_is_bad_input_before_any_work(tmp_path, v033):
    base = copy.deepcopy(v033)
    del base["cells"][2]["lanes"]
    (tmp_path / "v0.32.0").mkdir()
    (tmp_path / "v0.32.0" / "routing.json").write_text(json.dumps(base))
    r = _cli("audit", "v0.33.0", "--baseline", "v0.32.0", "--reports", str(tmp_path), "--expectations", "none")
    assert r.returncode == ExitCode.USAGE, r.stderr[-2000:]
    assert "cell 3 has no valid 'lanes'" in r.stderr and "Traceback" not in r.stderr


def head_line(text: str) -> str:
    return text.replace("\\[", "[")


def test_the_terminal_lists_every_serving_change_grouped_by_kind_with_consistent_counts():
    """v0.30.0 -> v0.33.0 has dozens of serving changes: the closing lines group all of them by kind with a count
    per kind (never the first N), and the headline's finding counts add up (failing only now + failing before)."""
    from audit.cli import _gate_exit
    from audit.core import AuditOutcome
    from audit.report.gate import judge_gate

    class Lines:
        def __init__(self):
            self.out = []

        def print(self, text="", *a, **k):
            self.out.append(str(text))

    old, new = json.loads((DATA / "routing-v0.30.0.json").read_text()), json.loads((DATA / "routing-v0.33.0.json").read_text())
    gate = judge_gate(old, new, set(), KIMI_K3)
    out = AuditOutcome(pin="v0.33.0", report_dir=Path("."), ledger=None, routing_path=None, run_dir=Path("."),
                       cells=44, incomplete=0, partial=0, drift=0, verdicts={}, gate=gate)
    lines = Lines()
    assert _gate_exit(gate, False, out, lines) == ExitCode.SERVING_CHANGED
    text = "\n".join(lines.out)
    changes = gate["serving_changes"]
    assert len(changes) > 20 and "more in the diff" not in text
    from audit.report.changes import KINDS

    for klass, n in gate["by_class"].items():
        if n:
            assert f"  {KINDS[klass].word} ({n}):" in text
    assert gate["headline"] in head_line(lines.out[0])
    assert sum(1 for line in lines.out if line.startswith("    ")) == len(changes)
    head = lines.out[0]
    fresh = gate["newly_failing"]
    assert (f"{len(gate['new_findings'])} new finding(s) ({fresh} failing only now, "
            f"{len(gate['new_findings']) - fresh} failing in v0.30.0 too but not accepted)") in head
    assert fresh == sum(1 for f in gate["new_findings"] if not f["in_baseline"])
