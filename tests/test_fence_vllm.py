"""The fence on the real vLLM wheel pinned in images.lock (v0.33.0): a mutation test of the harness itself.

A clean run of cells that together reach every stand-in family (SM 8.9 Marlin, SM 9.0 DP+EP Humming, SM 10.0
TP8 + MTP and DP+EP, SM 12.0 DeepGEMM) gives the fence's registry (every fenced piece the harness installed: post-
import hooks, stand-ins, probe bookkeeping; read from the evidence, not listed here) and which pieces ran. Then a
raise is planted in every piece that ran, and the cells run again: every piece must end as a harness fault that
names it, in a cell that shows no routing. Raises that propagate into vLLM (into a call path, and into an import
vLLM's ``_has_module`` swallows) end the same way, and the audit through the core exits 4 and leaves the reports
directory as it was.
"""
import json
import shutil

import pytest

from audit.core import AuditOptions, machine_paths, run_audit
from audit.errors import ExitCode, HarnessFaultError
from audit.evidence import files as evidence
from audit.models.kimi_k3 import KIMI_K3, LAYOUTS
from audit.report import routing
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm

#: cells that together reach every piece a full v0.33.0 audit runs (MegaMoE's probes under dep8, the specialized
#: decode's plan stand-ins under tp8-specdec, Humming under SM 9.0 DP+EP, DeepGEMM on SM 12.0, Marlin on SM 8.9);
#: the pieces registered that no cell of a full audit reaches (platform queries vLLM never asks, hooks of modules it
#: never imports) cannot go off anywhere
CELLS = [("l40s", "tp8"), ("h200_sxm", "dp8-ep"), ("b200_sxm", "tp8-mtp"), ("b200_sxm", "dp8-ep"),
         ("b200_sxm", "dep8"), ("b200_sxm", "tp8-specdec"), ("rtx_pro_6000_server", "tp8")]


def _run(vllm_env, tmp_path_factory, name, cells, plant=(), survey=False):
    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name)
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in cells], run_dir=run_dir,
                     parallel=2, plant_fault="\n".join(sorted(plant)), plant_survey=survey)
    result = rt.run(req, lambda *a, **k: None)
    files = evidence.read_dir(result.evidence_dir)
    r = routing.build_routing(files, KIMI_K3, pin=pin.as_provenance(), expected=list(cells), missing=result.missing,
                              scrub=machine_paths(run_dir))
    return {"files": {f.cell: f for f in files if f.cell}, "cells": {(c["system"], c["layout"]): c for c in r["cells"]},
            "missing": result.missing, "routing": r}


def _fence(f) -> dict:
    return next(r for r in f.records if r.get("kind") == "fence")


def _ran(f) -> set[str]:
    """The pieces that ran in a cell: counted by the fence, or (the probes' bookkeeping, which is not counted on
    the hot path) a probe whose target left records."""
    rec = _fence(f)
    ran = {p for p, n in rec["calls"].items() if n}
    targets = {r.get("target") for r in f.records if r.get("kind") in ("select", "construct", "scope", "candidates",
                                                                     "candidate", "activation_check", "raise")}
    ran |= {p for p in rec["pieces"] if p.startswith("probe ") and p[len("probe "):] in targets}
    return ran


@pytest.fixture(scope="module")
def clean(vllm_env, tmp_path_factory):
    run = _run(vllm_env, tmp_path_factory, "fence-clean", CELLS)
    assert run["missing"] == {}
    return run


def test_a_clean_run_has_the_fences_on_and_no_fault(clean):
    for key, cell in clean["cells"].items():
        assert cell["status"] == "COMPLETE" and cell["harness_faults"] == [], key
        assert cell["fence"]["on"] and cell["fence"]["pieces"] > 40, key
    # every stand-in that checked its target says how it fitted: the meta-device translations (with the
    # alternative that fitted) and the hook-installed ones alike
    # (one account for the run: a target is checked where its module is imported, which warm imports may do ahead
    # of the cell that needs it)
    assert all("standin_fit" not in cell for cell in clean["cells"].values())
    fit = clean["routing"]["standin_fit"]
    assert fit["humming.device:DeviceInfo.__new__|DeviceInfo.__init__(index=...)"].startswith(
        "fits humming-kernels") and "as DeviceInfo.__new__" in fit[
        "humming.device:DeviceInfo.__new__|DeviceInfo.__init__(index=...)"]
    assert fit["humming device info (csrc/device_info.cpp extension)"].startswith("fits humming-kernels")
    assert all(v.startswith("fits ") for v in fit.values()), fit


def test_every_stand_in_the_ledger_lists_is_fenced_or_says_why_not(clean, vllm_env):
    rt, pin, env = vllm_env
    import subprocess

    out = subprocess.run([str(env / "bin" / "python"), "-c",
                          "import json, sys; sys.path.insert(0, sys.argv[1]); from probes.resolve.simulate import "
                          "UNFENCED; print(json.dumps(UNFENCED))", str(ROOT)], capture_output=True, text=True,
                         check=True)
    unfenced = json.loads(out.stdout)
    for key, f in clean["files"].items():
        listed = set(next(r for r in f.records if r.get("kind") == "simulated")["items"])
        pieces = set(_fence(f)["pieces"])
        assert listed - pieces - set(unfenced) == set(), key
        assert set(unfenced) - listed <= {"post-load: checkpoint weight names"}, key  # only MTP feeds weight names


#: pieces whose work vLLM caches per run (its model-info cache under the run's VLLM_CACHE_ROOT): the registry's
#: model inspection runs in whichever cell's process inspects the model first
ONCE_PER_RUN = {"vllm registry model inspection"}


def test_a_raise_planted_in_every_piece_that_ran_ends_as_a_harness_fault(clean, vllm_env, tmp_path_factory):
    """Survey: a raise in every piece that ran, each caught by the piece's own fence, which records it and lets the
    piece go on (a raise that propagated would stop whatever runs after it, so one run could test only the first
    piece reached). Every piece's fault must reach the evidence from whichever process it ran in (the shared
    parent, an SM process, a cell), and every cell ends INCOMPLETE with no routing."""
    ran = {key: _ran(f) for key, f in clean["files"].items()}
    todo = set().union(*ran.values())
    kinds = {p.split(" ")[0] for p in todo}
    assert len(todo) > 60 and {"install", "probe", "hook"} & kinds and any(not p.startswith(("install ", "probe "))
                                                                         for p in todo)
    run = _run(vllm_env, tmp_path_factory, "fence-survey", CELLS, plant=todo, survey=True)
    # two runs of the survey render the same routing, but for where the once-per-run work went off (whichever
    # cell's process got there first: survey mode lets a faulted piece go on, so vLLM caches its answer)
    again = _run(vllm_env, tmp_path_factory, "fence-survey-again", CELLS, plant=todo, survey=True)
    assert _without(run["routing"], ONCE_PER_RUN) == _without(again["routing"], ONCE_PER_RUN)
    went_off = set()
    for key in CELLS:
        cell = run["cells"][key]
        pieces = {f["piece"] for f in cell["harness_faults"]}
        went_off |= pieces
        # every piece that ran here went off here, but for work vLLM caches once per run (whichever cell's process
        # gets there first does it; the others read vLLM's cache): that goes off in some cell, checked below
        assert ran[key] - ONCE_PER_RUN <= pieces, (key, sorted(ran[key] - ONCE_PER_RUN - pieces))
        assert pieces <= todo, (key, sorted(pieces - todo))  # and nothing but what was planted
        assert {f["type"] for f in cell["harness_faults"]} == {"probes.core.fence:PlantedFault"}, key
        assert cell["status"] == "INCOMPLETE" and cell["lanes"] == {} and "harness fault" in cell["failure"]["message"]
    assert todo <= went_off, sorted(todo - went_off)  # every piece that ran anywhere went off somewhere


def _without(routed: dict, pieces: set[str]) -> str:
    """*routed* as text, without the faults of *pieces* (a cell's reason, which names its first fault and counts
    the others, said again of what is left)."""
    cells = []
    for c in routed["cells"]:
        kept = [f for f in c["harness_faults"] if f["piece"] not in pieces]
        if kept != c["harness_faults"]:
            c = dict(c, harness_faults=kept, failure=dict(c["failure"], message=routing.fault_reason(kept)))
        cells.append(c)
    return json.dumps(dict(routed, cells=cells), indent=1, sort_keys=True)


def test_raises_that_propagate_into_vllm_end_as_harness_faults(clean, vllm_env, tmp_path_factory):
    """A planted raise that goes on into vLLM, as a broken piece's own would: the first stand-in that answers a
    Humming device query during post-load (in vLLM's call path), and the first probe's bookkeeping around a
    wrapped call (the wrapper reports it and the call goes on): each ends the cell as its own harness fault."""
    key = ("h200_sxm", "dp8-ep")
    ran = sorted(_ran(clean["files"][key]))
    stand_in = next(p for p in ran if p.startswith("humming device info"))
    probe = next(p for p in ran if p.startswith("probe moe."))
    run = _run(vllm_env, tmp_path_factory, "fence-propagate", [key], plant={stand_in, probe})
    again = _run(vllm_env, tmp_path_factory, "fence-propagate-again", [key], plant={stand_in, probe})
    assert json.dumps(run["routing"], sort_keys=True) == json.dumps(again["routing"], sort_keys=True), \
        "two runs of the same planted faults routed differently"
    cell = run["cells"][key]
    pieces = {f["piece"] for f in cell["harness_faults"]}
    # the stand-in's fence records its own raise; the wrapper reports its bookkeeping's (":before") as a probe error
    assert stand_in in pieces and f"{probe}:before" in pieces, sorted(pieces)
    assert cell["status"] == "INCOMPLETE" and cell["lanes"] == {}


def _audit_twice(tmp_path, plant: str, expectations: str) -> list[HarnessFaultError]:
    """The planted fault audited twice from scratch (no evidence cache) through the core, each time into a copy of
    the committed report: both exit 4 and leave the copy byte for byte as it was, and both INCOMPLETE routing.json
    files beside the runs are the same bytes (the faults suite's answers are facts of the code: no run directory,
    pid or time leaks into them). The two errors, for the case's own checks."""
    out = []
    for i in range(2):
        reports = tmp_path / f"reports-{i}"
        shutil.copytree(ROOT / "reports" / "v0.33.0", reports / "v0.33.0")
        before = {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()}
        with pytest.raises(HarnessFaultError) as e:
            run_audit("v0.33.0", AuditOptions(lock_path=ROOT / "images.lock", systems=["h200_sxm"], layouts=["tp8"],
                                              reports_dir=reports, expectations=expectations, baseline="none",
                                              accepted="none", cache=False, replace=True, profile=KIMI_K3,
                                              plant_fault=plant))
        assert e.value.exit_code == ExitCode.RUN_FAILED == 4
        assert {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()} == before
        out.append(e.value)
    first, second = ((e.incomplete_ledger.parent / "routing.json").read_bytes() for e in out)
    assert first == second, "two runs of the same planted fault rendered different routing.json"
    return out


def test_a_fault_swallowed_by_vllm_ends_the_audit_with_exit_4_and_touches_no_report(vllm_env, tmp_path):
    """The case that made a committed report wrong: a raise inside Humming's import, which vLLM's
    ``_has_module`` swallows and answers "not available" (the oracle then falls through to Marlin)."""
    piece = "install humming.device:DeviceInfo.__new__|DeviceInfo.__init__(index=...)"
    err = _audit_twice(tmp_path, piece, "none")[0]
    assert piece in str(err) and [f["piece"] for f in err.faults] == [piece]
    ledger = err.incomplete_ledger.read_text(encoding="utf-8")
    assert "## Harness faults" in ledger and "PlantedFault" in ledger and "HUMMING" not in ledger.split("## Harness")[0]
    routed = json.loads((err.incomplete_ledger.parent / "routing.json").read_text(encoding="utf-8"))
    assert [c["status"] for c in routed["cells"]] == ["INCOMPLETE"] and routed["cells"][0]["lanes"] == {}


@pytest.mark.parametrize("piece", ["vllm.platforms.cuda:CudaPlatform.get_device_capability",
                                   "vllm.platforms.cuda:CudaPlatform.num_compute_units", "torch.cuda.device_count"])
def test_a_wrong_value_a_stand_in_returns_ends_the_audit_with_exit_4_never_as_a_limit(piece, vllm_env, tmp_path):
    """The platform stand-in answering with what vLLM's own function never returns (a tuple where a DeviceCapability
    belongs, a non-int count): vLLM would raise a line later in its own frame, and that stop once read as "a limit
    of resolve mode" and passed the gate. The stand-in's contract makes it a harness fault: exit 4, the report
    untouched, the piece named; two runs render the same INCOMPLETE routing byte for byte."""
    err = _audit_twice(tmp_path, f"wrong value: {piece}", "auto")[0]
    assert piece in [f["piece"] for f in err.faults]
    assert any("ContractBroken" in f["type"] for f in err.faults if f["piece"] == piece)
    assert b"ContractBroken" in (err.incomplete_ledger.parent / "routing.json").read_bytes()


def test_an_edited_memo_entry_changes_nothing_in_the_routing(vllm_env, tmp_path_factory, monkeypatch):
    """The memo of Humming's heuristics is evidence too: every entry edited to another answer (the seal left as
    it was) is rejected and computed again, the routing is the clean run's field by field, and the ledger says
    how many entries did not verify."""
    from audit.report.render import render_ledger

    memo_dir = tmp_path_factory.mktemp("memo")
    monkeypatch.setenv("SERVING_TRUTH_MEMO", str(memo_dir))
    cell = [("h200_sxm", "tp8")]
    clean = _run(vllm_env, tmp_path_factory, "memo-clean", cell)
    files = sorted(memo_dir.glob("*.json"))
    assert files, "the cell computes Humming's heuristics through the memo"
    for path in files:
        entries = json.loads(path.read_text())
        for e in entries:
            e["result"] = {"__memo_tuple__": [999]} if not isinstance(e["result"], dict) else {
                k: 999 for k in e["result"]}
        path.write_text(json.dumps(entries))
    edited = _run(vllm_env, tmp_path_factory, "memo-edited", cell)
    a, b = clean["cells"][cell[0]], edited["cells"][cell[0]]
    for key in ("lanes", "dispatch", "candidates", "postload", "status"):
        assert json.dumps(a[key], sort_keys=True) == json.dumps(b[key], sort_keys=True), key
    pin = vllm_env[1].as_provenance()
    before = routing.build_routing(list(clean["files"].values()), KIMI_K3, pin=pin, expected=cell)
    after = routing.build_routing(list(edited["files"].values()), KIMI_K3, pin=pin, expected=cell)
    assert "memo_rejected" not in before["run"] and after["run"]["memo_rejected"] >= len(files)
    assert json.dumps(before["cells"], sort_keys=True) == json.dumps(after["cells"], sort_keys=True)
    assert "did not verify (edited, moved or malformed): each was computed again" in render_ledger(
        after, profile=KIMI_K3, reproduce="x")
