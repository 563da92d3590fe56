"""The routing diff between pins: empty against itself, stable and grouped between real releases."""
import copy
import json

from audit.lanevalue import make, text
from audit.report.diff import diff_routings, render_diff
from tests.conftest import ROOT
from tests.goldtest import compare
from audit.models.gpt_oss import GPT_OSS_120B
from audit.models.kimi_k3 import KIMI_K3

DATA = ROOT / "tests" / "data"  # routing.json of real audits


def load(pin):
    return json.loads((DATA / f"routing-{pin}.json").read_text(encoding="utf-8"))


def _set(group, kernel, **parts):
    """A lane group's value replaced by a record of another kernel (what a changed vLLM would choose)."""
    group["value"] = make(kernel, **parts)


def test_pin_against_itself_is_empty():
    for pin in ("v0.30.0", "v0.33.0"):
        r = load(pin)
        d = diff_routings(r, copy.deepcopy(r), KIMI_K3)
        assert d["empty"] and d["changes"] == [] and d["unchanged_lanes"] == d["compared_lanes"] > 0
        assert "**No change.**" in render_diff(d, KIMI_K3)


def test_real_releases_diff_is_stable_and_grouped():
    old, new = load("v0.30.0"), load("v0.33.0")
    first = render_diff(diff_routings(old, new, KIMI_K3), KIMI_K3)
    assert first == render_diff(diff_routings(copy.deepcopy(old), copy.deepcopy(new), KIMI_K3), KIMI_K3)
    d = diff_routings(old, new, KIMI_K3)
    keys = [(c["facet"], c["title"], c["before"], c["after"], json.dumps([c.get("a"), c.get("b")], sort_keys=True),
             c.get("refused_both")) for c in d["changes"]]
    assert len(keys) == len(set(keys)), "one upstream change must read as one row"
    compare("diff-v0.30.0..v0.33.0.md", first)


def test_a_single_change_is_one_row_naming_all_cells():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    for c in changed["cells"]:
        for g in c["lanes"].get("mla.prefill", []):
            if g["value"]["kernel"] == "FlashAttnPrefillBackend":  # the default (an option picks FlashInfer's)
                _set(g, "SomeNewPrefillBackend")
    d = diff_routings(r, changed, KIMI_K3)
    rows = [c for c in d["changes"] if c["lane"] == "mla.prefill"]
    refused = {(c["system"], c["layout"]) for c in r["cells"] if c.get("load_refused") or
               (c.get("failure") or {}).get("outcome") == "refused"}
    built = {(c["system"], c["layout"]) for c in r["cells"]
             if any(g["value"]["kernel"] == "FlashAttnPrefillBackend" for g in c["lanes"].get("mla.prefill", []))}
    # one row where it serves, one (information) inside deployments vLLM refuses in both builds
    assert [r_["after"] for r_ in rows] == ["SomeNewPrefillBackend"] * len(rows) and len(rows) <= 2
    assert {tuple(x) for row in rows for x in row["cells"]} == built
    assert {tuple(x) for row in rows if row["serving"] for x in row["cells"]} == built - refused


def test_ledger_shows_changes_since_its_baseline():
    from audit.report.render import render_ledger

    old, new = load("v0.30.0"), load("v0.33.0")
    text = render_ledger(new, profile=KIMI_K3, reproduce="x", changes=diff_routings(old, new, KIMI_K3))
    section = text.split("## Changes since `v0.30.0`", 1)[1].split("\n## ", 1)[0]
    assert "| experts | Routed experts | MarlinExperts | HummingIndexedExperts |" in section
    same = render_ledger(new, profile=KIMI_K3, reproduce="x", changes=diff_routings(new, new, KIMI_K3))
    assert "None: every lane of every cell audited in both pins routes the same way" in same


def test_attention_rejection_reason_drift_probe_errors_and_availability_are_changes():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    cell = next(c for c in changed["cells"] if c.get("attention_candidates") and c["attention_candidates"]["rejected"])
    cell["attention_candidates"]["rejected"][0]["reasons"] = ["a new reason vLLM gives"]
    d = diff_routings(r, changed, KIMI_K3)
    rows = [c for c in d["changes"] if c["field"] == "attention candidates"]
    assert len(rows) == 1 and "a new reason vLLM gives" in rows[0]["after"] and not d["empty"]
    assert rows[0]["cells"] == [[cell["system"], cell["layout"]]]

    changed = copy.deepcopy(r)
    c0 = changed["cells"][0]
    c0["probe_errors"] = [{"where": "kda.prefill", "error": {"type": "AttributeError", "message": "x"}}]
    key = next(iter(c0["availability"]))
    c0["availability"][key] = "flipped"
    d = diff_routings(r, changed, KIMI_K3)
    fields = {c["field"] for c in d["changes"]}
    assert {"probe errors", f"vLLM availability: {key}"} <= fields


def test_a_drifted_lane_is_explained_as_drift_not_as_a_missing_selector():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    c0 = changed["cells"][0]
    c0["lanes"]["kda.prefill"] = []
    c0["drift"] = [{"target": "kda.prefill", "title": "KDA prefill selector", "required": True, "attempts": []}]
    d = diff_routings(r, changed, KIMI_K3)
    row = next(c for c in d["changes"] if c["lane"] == "kda.prefill")
    assert row["after"] == "— (not seen: probe target drifted: kda.prefill)"
    assert any(c["field"] == "probe drift" for c in d["changes"])


def test_two_audits_of_one_pin_label_their_sides_distinctly():
    r = load("v0.33.0")
    sub = copy.deepcopy(r)
    sub["cells"] = sub["cells"][:1]
    text = render_diff(diff_routings(r, sub, KIMI_K3), KIMI_K3)
    assert "only in the *from* audit (`v0.33.0`)" in text and "only in the *to* audit" not in text


def test_an_availability_answer_only_one_audit_recorded_is_no_change():
    """An audit made before the harness asked a question (here: whether vLLM reached NVIDIA's artifactory) is
    not a change of how the model is served; the same answer differing between two audits is."""
    old, new = load("v0.33.0"), load("v0.33.0")
    for c in old["cells"]:
        c["availability"].pop("nvidia_artifactory", None)
    for c in new["cells"]:
        c["availability"]["nvidia_artifactory"] = False
    assert diff_routings(old, new, KIMI_K3)["empty"]
    for c in old["cells"]:
        c["availability"]["nvidia_artifactory"] = True
    fields = {c["field"] for c in diff_routings(old, new, KIMI_K3)["changes"]}
    assert fields == {"vLLM availability: nvidia_artifactory"}


def test_routings_of_two_models_are_refused_naming_both():
    """A gpt-oss audit diffed against a K3 audit compares different layers under the same lane names: refused,
    with both audits' models and the command that diffs one model's pins."""
    import pytest

    from audit.errors import UsageError

    k3, oss = load("v0.33.0"), load("gpt-oss-120b-v0.33.0")
    with pytest.raises(UsageError) as err:
        diff_routings(k3, oss, KIMI_K3)
    assert "'kimi-k3'" in str(err.value) and "'gpt-oss-120b'" in str(err.value)
    assert "--model gpt-oss-120b" in err.value.hint
    assert diff_routings(oss, copy.deepcopy(oss), GPT_OSS_120B)["empty"]  # one model's audits still compare
    with pytest.raises(UsageError) as err:  # a profile handed down must be the routings' own
        diff_routings(oss, copy.deepcopy(oss), KIMI_K3)
    assert "'gpt-oss-120b', not of 'kimi-k3'" in str(err.value) and "--model gpt-oss-120b" in err.value.hint
    unnamed = {k: v for k, v in oss.items() if k != "model"}
    with pytest.raises(UsageError, match="names no model"):  # never read as the default model's
        diff_routings(unnamed, copy.deepcopy(unnamed), KIMI_K3)


def test_the_written_diff_names_its_model(tmp_path):
    """reports/diffs/<from>..<to>.json says whose routings it compares, as the rendered diff does."""
    from audit.report.diff import write_diff

    for pin in ("v0.30.0", "v0.33.0"):
        (tmp_path / pin).mkdir()
        (tmp_path / pin / "routing.json").write_text((DATA / f"routing-{pin}.json").read_text(encoding="utf-8"),
                                                     encoding="utf-8")
    md, js, d = write_diff(tmp_path, "v0.30.0", "v0.33.0", KIMI_K3)
    assert json.loads(js.read_text(encoding="utf-8"))["model"] == "kimi-k3" == d["model"]
    assert md.read_text(encoding="utf-8") == render_diff(d, KIMI_K3)


# --- serving or information: what the gate fails on ---------------------------------------------------------------

def _rows(d, **match):
    return [c for c in d["changes"] if all(c.get(k) == v for k, v in match.items())]


def _cell(r, system, layout):
    return next(c for c in r["cells"] if (c["system"], c["layout"]) == (system, layout))


def test_a_kernel_change_is_serving_and_a_count_or_a_newly_read_idle_lane_is_information():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    b200 = _cell(changed, "b200_sxm", "tp8")
    _set(b200["lanes"]["mla.prefill"][0], "SomeNewPrefillBackend")  # a kernel
    b200["postload"]["steps"] = b200["postload"].get("steps", 0) + 1  # a count
    old = copy.deepcopy(r)
    _cell(old, "b200_sxm", "tp8")["lanes"].pop("decode.specialized", None)  # an audit that did not read the lane
    d = diff_routings(old, changed, KIMI_K3)
    kernel = _rows(d, lane="mla.prefill")
    assert len(kernel) == 1 and kernel[0]["serving"] and kernel[0]["class"] == "kernel"
    count = _rows(d, field="post-load")
    assert len(count) == 1 and not count[0]["serving"] and "count" in count[0]["information"]
    idle = _rows(d, lane="decode.specialized")
    assert len(idle) == 1 and idle[0]["before"] == "—" and idle[0]["after"] == "not requested"
    assert not idle[0]["serving"] and idle[0]["information"] == "a lane newly read that takes nothing"
    assert d["serving_changes"] == 1 and d["by_class"]["kernel"] == 1 and d["serving_cells"] == 1
    # the same lane newly read and *requested* is a change of what serves
    on = copy.deepcopy(changed)
    _set(_cell(on, "b200_sxm", "tp8")["lanes"]["decode.specialized"][0], "SpecializedDecode", note="built")
    row = _rows(diff_routings(old, on, KIMI_K3), lane="decode.specialized")[0]
    assert row["serving"] and row["class"] == "path"


def test_a_note_beside_an_unchanged_serving_value_is_information_and_a_changed_identity_is_not():
    r = load("v0.33.0")
    lane, cell = "moe.activation", ("b200_sxm", "dep8")
    old, new = copy.deepcopy(r), copy.deepcopy(r)
    g_old, g_new = _cell(old, *cell)["lanes"][lane][0], _cell(new, *cell)["lanes"][lane][0]
    _set(g_old, "situ", note="MegaMoE; vLLM records no kernel-support check")
    _set(g_new, "situ", note="MegaMoE; in the experts' declared activations situ, swiglu")
    row = _rows(diff_routings(old, new, KIMI_K3), lane=lane)
    assert len(row) == 1 and not row[0]["serving"] and "only its note differs" in row[0]["information"]
    _set(g_new, "situ", detail="NOT declared by the experts", note="MegaMoE; their declared activations: swiglu")
    row = _rows(diff_routings(old, new, KIMI_K3), lane=lane)
    assert len(row) == 1 and row[0]["serving"] and row[0]["class"] == "kernel"


def test_an_availability_answer_gates_only_where_a_selection_in_its_cell_moved():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    for c in changed["cells"]:
        c["availability"]["deep_ep"] = True
    d = diff_routings(r, changed, KIMI_K3)
    row = _rows(d, field="vLLM availability: deep_ep")
    assert len(row) == 1 and not row[0]["serving"] and "changed no selection" in row[0]["information"]
    assert d["serving_changes"] == 0
    _set(_cell(changed, "b200_sxm", "dp8-ep")["lanes"]["moe"][0], "SomeExperts", backend="DEEPEP")
    d = diff_routings(r, changed, KIMI_K3)
    gating = [c for c in _rows(d, field="vLLM availability: deep_ep") if c["serving"]]
    assert gating and gating[0]["class"] == "availability" and ["b200_sxm", "dp8-ep"] in gating[0]["cells"]


def test_candidates_with_the_same_choice_and_a_newly_rejected_attention_backend_are_information():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    cell = next(c for c in changed["cells"] if len((c.get("attention_candidates") or {}).get("valid", [])) > 1)
    cell["attention_candidates"]["rejected"].append({"backend": "NEW_MLA", "reasons": ["not on this device"]})
    d = diff_routings(r, changed, KIMI_K3)
    row = _rows(d, field="attention candidates")
    assert len(row) == 1 and not row[0]["serving"] and "same valid backends" in row[0]["information"]
    cell["attention_candidates"]["valid"] = list(reversed(cell["attention_candidates"]["valid"]))
    assert _rows(diff_routings(r, changed, KIMI_K3), field="attention candidates")[0]["serving"]


def test_rows_name_the_cells_they_touched_not_a_product_of_systems_and_layouts():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    for system, layout in (("b200_sxm", "tp8"), ("h100_sxm", "tp16")):
        _set(_cell(changed, system, layout)["lanes"]["mla.prefill"][0], "SomeNewPrefillBackend")
    row = _rows(diff_routings(r, changed, KIMI_K3), lane="mla.prefill")[0]
    assert row["where"] == "tp8: b200_sxm; tp16: h100_sxm"


def test_a_claim_that_passes_only_because_serving_moved_under_it_says_so():
    r = load("v0.33.0")
    failing = next(v for v in r["verdicts"]["rows"] if v["verdict"] == "MISMATCH")
    cell = (failing["system"], failing["layout"])
    changed = copy.deepcopy(r)
    for v in changed["verdicts"]["rows"]:
        if (v["claim"], v["system"], v["layout"], v["lane"]) == (failing["claim"], *cell, failing["lane"]):
            v["verdict"] = "MATCH"
    d = diff_routings(r, changed, KIMI_K3)
    turn = [c for c in _rows(d, facet="verdict") if c["turn"] == "no longer failing"]
    assert turn and "the claim or the harness changed" in turn[0]["because"]  # nothing served differently
    for g in _cell(changed, *cell)["lanes"][failing["lane"]]:
        _set(g, "SomethingElse")
    d = diff_routings(r, changed, KIMI_K3)
    turn = [c for c in _rows(d, facet="verdict") if c["turn"] == "no longer failing"]
    assert turn[0]["because"] == "claim now true because serving changed" and d["now_true_by_serving"] == 1
    assert "true now only because serving changed" in d["summary"]


def test_the_pr_summary_is_deterministic_names_every_serving_row_and_opens_the_diff():
    old, new = load("v0.30.0"), load("v0.33.0")
    d = diff_routings(old, new, KIMI_K3)
    text = d["summary"]
    assert text == diff_routings(copy.deepcopy(old), copy.deepcopy(new), KIMI_K3)["summary"]
    assert text.startswith("**Kimi-K3, vLLM 0.30.0 → 0.33.0**") and "**The pin-bump gate fails**" in text
    assert d["headline"] in text  # the same counts as the diff's headline and the terminal's
    assert "… and" not in text  # nothing consequential is cut
    for c in d["changes"]:
        if c.get("serving") and c["class"] in ("experts", "kernel", "refusal") and c["facet"] == "lane":
            assert c["where"] in text, c["title"]
    assert "MarlinExperts → HummingIndexedExperts (marlin → humming)" in text
    assert "Unchanged" not in text and "SM 9.0 (h100_sxm, h200_sxm)" in text
    top = render_diff(d, KIMI_K3).split("## Summary for the pull request\n\n", 1)[1]
    assert " ".join(top.split()).startswith(" ".join(text.split()))  # the diff opens with it (lines wrapped to fit)
    same = diff_routings(new, copy.deepcopy(new), KIMI_K3)["summary"]
    assert "**No serving change**" in same and "Unchanged on" in same


def test_the_diff_an_audit_computes_before_writing_is_the_one_its_report_rerenders():
    """An audit diffs its routing before writing it, when its lane values do not yet carry what they take from the
    audit (family, refused, raises-at-dispatch); a re-render diffs what was written. Both must tell the same story:
    K3's tp8-fp8kv prefill raise stands in 0.30.0 and 0.31.0 (it once read "gone" at audit time)."""
    import copy

    from audit.report.diff import diff_routings, load_routing
    from audit.report.summary import pr_summary

    old = load_routing(ROOT / "reports", "v0.30.0", KIMI_K3)
    written = load_routing(ROOT / "reports", "v0.31.0", KIMI_K3)
    unwritten = copy.deepcopy(written)
    for cell in unwritten["cells"]:
        for groups in (cell.get("lanes") or {}).values():
            for g in groups:
                v = g.get("value")
                if isinstance(v, dict):  # what values.finish sets: the rest of a record is the evidence's
                    v.pop("family", None)
                    v.pop("raises", None)
                    v["flags"] = [f for f in v.get("flags", ()) if f not in ("refused", "raises-at-dispatch")]
    a = diff_routings(copy.deepcopy(old), written, KIMI_K3)
    b = diff_routings(copy.deepcopy(old), unwritten, KIMI_K3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    text = pr_summary(b, old, unwritten, KIMI_K3)
    assert "in both builds: tp8-fp8kv" in " ".join(text.split()) and "gone: tp8-fp8kv" not in text
