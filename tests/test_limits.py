"""Only vLLM or a declared limit stops a cell (audit/limits.py, audit/report/routing.py): a stop at a place no
declaration covers for the cell's library release, or short of where the committed audit of the same build went,
is a harness fault (the cell INCOMPLETE), never a limit; a declared one is marked and listed in the ledger."""
import copy
import json

from audit import limits
from audit.models.deepseek_v3 import DEEPSEEK_V3
from audit.models.kimi_k3 import KIMI_K3
from audit.report import routing
from audit.report.render import render_ledger
from tests.conftest import ROOT
from tests.test_postload_routing import PIN, _file, _step

CUTE = {"raised_in": "cutlass.base_dsl.runtime.cuda:checkCudaErrors", "type": "cutlass.base_dsl.common:DSLCudaRuntimeError",
        "message": "error: cudaErrorNoDevice (error code: 100)", "rule": "raised outside vLLM"}


def _cell(step, packages, system="b200_sxm"):
    f = _file(system, "tp8", [step, {"kind": "fingerprint", "packages": packages}])
    return routing.build_routing([f], KIMI_K3, pin=PIN, expected=[(system, "tp8")])


def test_a_declared_limit_is_a_limit_and_is_listed():
    r = _cell(_step(None, "limit", **CUTE), {"nvidia-cutlass-dsl": "4.8.0", "vllm": "0.33.0"})
    cell = r["cells"][0]
    assert cell["status"] == "COMPLETE" and not cell["harness_faults"]
    assert cell["postload"]["limits"][0]["declared"] == "cute-dsl-cuda-runtime"
    assert r["declared_limits"] == {"cute-dsl-cuda-runtime": ["b200_sxm/tp8"]}
    r["verdicts"] = None
    text = render_ledger(r, profile=KIMI_K3, reproduce="x")
    assert "| `cute-dsl-cuda-runtime` | nvidia-cutlass-dsl (4.8.0) | `cutlass.base_dsl.runtime.cuda:checkCudaErrors`" in text


def test_a_stop_no_declaration_covers_is_a_harness_fault():
    """The same place in a release it was not checked on, another place, or no fingerprint to tell the release."""
    for step, packages in ((_step(None, "limit", **CUTE), {"nvidia-cutlass-dsl": "4.9.0"}),
                           (_step(None, "limit", **{**CUTE, "raised_in": "torch.cuda:_lazy_init"}),
                            {"nvidia-cutlass-dsl": "4.8.0"}),
                           (_step(1, "limit", raised_in="flashinfer.utils:get_compute_capability",
                                  type="builtins:ValueError", message="device must be a cuda device"), {})):
        r = _cell(step, packages)
        cell = r["cells"][0]
        assert cell["status"] == "INCOMPLETE" and cell["failure"]["stage"] == "harness", step
        [fault] = cell["harness_faults"]
        assert fault["piece"] == routing.UNDECLARED and "no declared limit covers that place" in fault["message"]
        assert fault["where"] == step["raised_in"] and not cell["lanes"]  # no routing of it is shown
        assert r["declared_limits"] == {}


def test_a_refusal_by_vllm_is_never_asked_about():
    r = _cell(_step(None, "refused", raised_in="vllm.x:check", raised_where="vllm/x.py:3", raise_line=True,
                    type="builtins:ValueError", message="no"), {})
    assert r["cells"][0]["status"] == "COMPLETE" and r["cells"][0]["load_refused"]


def test_a_construction_stop_is_asked_about_too():
    where = "<env>/site-packages/cutlass/base_dsl/runtime/cuda.py:88 in checkCudaErrors"
    assert limits.raised_in_of(where) == "cutlass.base_dsl.runtime.cuda:checkCudaErrors"
    assert limits.raised_in_of("nonsense") == ""
    failure = {"stage": "construct", "outcome": "limit", "where": where, **{k: CUTE[k] for k in ("type", "message")}}
    assert routing._undeclared_stops(dict(failure), None, {"packages": {"nvidia-cutlass-dsl": "4.8.0"}}) == []
    [fault] = routing._undeclared_stops(dict(failure), None, {"packages": {}})
    assert fault["where"] == "cutlass.base_dsl.runtime.cuda:checkCudaErrors"


def test_a_stop_short_of_where_the_same_build_went_is_a_harness_fault():
    """The committed audit of this very build ran post-load to the end in the cell; now a (declared) limit stops it:
    the harness changed, not vLLM."""
    before = _cell(_step(None, "ok"), {"nvidia-cutlass-dsl": "4.8.0"})
    assert before["cells"][0]["postload"]["limit"] == 0
    f = _file("b200_sxm", "tp8", [_step(None, "limit", **CUTE), {"kind": "fingerprint",
                                                                 "packages": {"nvidia-cutlass-dsl": "4.8.0"}}])
    r = routing.build_routing([f], KIMI_K3, pin=PIN, expected=[("b200_sxm", "tp8")], previous=before)
    cell = r["cells"][0]
    assert cell["status"] == "INCOMPLETE" and "went further" in cell["harness_faults"][0]["piece"]
    assert "stopped in 0 of 1" in cell["harness_faults"][0]["message"]
    # the same stop as before is no regression
    again = routing.build_routing([copy.deepcopy(f)], KIMI_K3, pin=PIN, expected=[("b200_sxm", "tp8")],
                                  previous=copy.deepcopy(r | {"cells": [_cell(_step(None, "limit", **CUTE),
                                                                              {"nvidia-cutlass-dsl": "4.8.0"})["cells"][0]]}))
    assert again["cells"][0]["status"] == "COMPLETE"


def test_every_stop_in_the_committed_reports_is_declared():
    """What the committed reports call a limit, a declaration covers (the reports were rendered with this code, so
    a stop there that none covers would have ended its cell INCOMPLETE and failed the audit)."""
    for path in sorted((ROOT / "reports").rglob("routing.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        for c in r["cells"]:
            for g in (c.get("postload") or {}).get("limits") or []:
                assert g.get("declared") in {lim.id for lim in limits.LIMITS}, (path, c["system"], c["layout"])
            assert not any(f["piece"] == routing.UNDECLARED for f in c.get("harness_faults") or []), path
    assert DEEPSEEK_V3.name  # the third model's reports are among them
