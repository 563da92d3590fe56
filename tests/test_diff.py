"""The routing diff between pins: empty against itself, stable and grouped between real releases."""
import copy
import json

from audit.report.diff import diff_routings, render_diff
from tests.conftest import ROOT
from tests.goldtest import compare

DATA = ROOT / "tests" / "data"  # routing.json of real audits


def load(pin):
    return json.loads((DATA / f"routing-{pin}.json").read_text(encoding="utf-8"))


def test_pin_against_itself_is_empty():
    for pin in ("v0.30.0", "v0.33.0"):
        r = load(pin)
        d = diff_routings(r, copy.deepcopy(r))
        assert d["empty"] and d["changes"] == [] and d["unchanged_lanes"] == d["compared_lanes"] > 0
        assert "**No change.**" in render_diff(d)


def test_real_releases_diff_is_stable_and_grouped():
    old, new = load("v0.30.0"), load("v0.33.0")
    first = render_diff(diff_routings(old, new))
    assert first == render_diff(diff_routings(copy.deepcopy(old), copy.deepcopy(new)))
    d = diff_routings(old, new)
    keys = [(c["kind"], c["lane"] or c["field"], c["before"], c["after"]) for c in d["changes"]]
    assert len(keys) == len(set(keys)), "one upstream change must read as one row"
    compare("diff-v0.30.0..v0.33.0.md", first)


def test_a_single_change_is_one_row_naming_all_cells():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    for c in changed["cells"]:
        for g in c["lanes"].get("mla.prefill", []):
            g["value"] = "SomeNewPrefillBackend"
    d = diff_routings(r, changed)
    rows = [c for c in d["changes"] if c["lane"] == "mla.prefill"]
    assert len(rows) == 1 and rows[0]["after"] == "SomeNewPrefillBackend"
    built = {(c["system"], c["layout"]) for c in r["cells"] if c["lanes"].get("mla.prefill")}
    assert {tuple(x) for x in rows[0]["cells"]} == built


def test_ledger_shows_changes_since_its_baseline():
    from audit.report.render import render_ledger

    old, new = load("v0.30.0"), load("v0.33.0")
    text = render_ledger(new, profile_title="Kimi-K3", reproduce="x", changes=diff_routings(old, new))
    section = text.split("## Changes since `v0.30.0`", 1)[1].split("\n## ", 1)[0]
    assert "| Routed experts | MARLIN / MarlinExperts | HUMMING / HummingIndexedExperts |" in section
    same = render_ledger(new, profile_title="Kimi-K3", reproduce="x", changes=diff_routings(new, new))
    assert "None: every lane of every cell audited in both pins routes the same way" in same


def test_attention_rejection_reason_drift_probe_errors_and_availability_are_changes():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    cell = next(c for c in changed["cells"] if c.get("attention_candidates") and c["attention_candidates"]["rejected"])
    cell["attention_candidates"]["rejected"][0]["reasons"] = ["a new reason vLLM gives"]
    d = diff_routings(r, changed)
    rows = [c for c in d["changes"] if c["field"] == "attention candidates"]
    assert len(rows) == 1 and "a new reason vLLM gives" in rows[0]["after"] and not d["empty"]
    assert rows[0]["cells"] == [[cell["system"], cell["layout"]]]

    changed = copy.deepcopy(r)
    c0 = changed["cells"][0]
    c0["probe_errors"] = [{"where": "kda.prefill", "error": {"type": "AttributeError", "message": "x"}}]
    key = next(iter(c0["availability"]))
    c0["availability"][key] = "flipped"
    d = diff_routings(r, changed)
    fields = {c["field"] for c in d["changes"]}
    assert {"probe errors", f"vLLM availability: {key}"} <= fields


def test_a_drifted_lane_is_explained_as_drift_not_as_a_missing_selector():
    r = load("v0.33.0")
    changed = copy.deepcopy(r)
    c0 = changed["cells"][0]
    c0["lanes"]["kda.prefill"] = []
    c0["drift"] = [{"target": "kda.prefill", "title": "KDA prefill selector", "required": True, "attempts": []}]
    d = diff_routings(r, changed)
    row = next(c for c in d["changes"] if c["lane"] == "kda.prefill")
    assert row["after"] == "— (not seen: probe target drifted: kda.prefill)"
    assert any(c["field"] == "probe drift" for c in d["changes"])


def test_two_audits_of_one_pin_label_their_sides_distinctly():
    r = load("v0.33.0")
    sub = copy.deepcopy(r)
    sub["cells"] = sub["cells"][:1]
    text = render_diff(diff_routings(r, sub))
    assert "only in the *from* audit (`v0.33.0`)" in text and "only in the *to* audit" not in text


def test_an_availability_answer_only_one_audit_recorded_is_no_change():
    """An audit made before the harness asked a question (here: whether vLLM reached NVIDIA's artifactory) is
    not a change of how the model is served; the same answer differing between two audits is."""
    old, new = load("v0.33.0"), load("v0.33.0")
    for c in old["cells"]:
        c["availability"].pop("nvidia_artifactory", None)
    for c in new["cells"]:
        c["availability"]["nvidia_artifactory"] = False
    assert diff_routings(old, new)["empty"]
    for c in old["cells"]:
        c["availability"]["nvidia_artifactory"] = True
    fields = {c["field"] for c in diff_routings(old, new)["changes"]}
    assert fields == {"vLLM availability: nvidia_artifactory"}


def test_routings_of_two_models_are_refused_naming_both():
    """A gpt-oss audit diffed against a K3 audit compares different layers under the same lane names: refused,
    with both audits' models and the command that diffs one model's pins."""
    import pytest

    from audit.errors import UsageError

    k3, oss = load("v0.33.0"), load("gpt-oss-120b-v0.33.0")
    with pytest.raises(UsageError) as err:
        diff_routings(k3, oss)
    assert "'kimi-k3'" in str(err.value) and "'gpt-oss-120b'" in str(err.value)
    assert "--model gpt-oss-120b" in err.value.hint
    assert diff_routings(oss, copy.deepcopy(oss))["empty"]  # one model's audits still compare


def test_the_written_diff_names_its_model(tmp_path):
    """reports/diffs/<from>..<to>.json says whose routings it compares, as the rendered diff does."""
    from audit.report.diff import write_diff

    for pin in ("v0.30.0", "v0.33.0"):
        (tmp_path / pin).mkdir()
        (tmp_path / pin / "routing.json").write_text((DATA / f"routing-{pin}.json").read_text(encoding="utf-8"),
                                                     encoding="utf-8")
    md, js, d = write_diff(tmp_path, "v0.30.0", "v0.33.0")
    assert json.loads(js.read_text(encoding="utf-8"))["model"] == "kimi-k3" == d["model"]
    assert md.read_text(encoding="utf-8") == render_diff(d)
