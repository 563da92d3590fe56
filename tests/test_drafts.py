"""Speculative drafts named apart from their target (issue 48), on the committed reports and the diff.

Every committed routing.json of a draft layout (MTP, EAGLE3, DSpark) keeps the draft under the cell's ``draft``: its
class, its layers as vLLM numbers them, the target modules it holds, its own lanes; no target lane or layer kind
holds a draft layer. The ledger and labels.json name the draft's class on its rows, and the diff compares a draft's
lanes as the draft's own rows.
"""
import copy
import json

import pytest

from audit.evidence.files import EvidenceFile, model_view
from audit.lanevalue import make
from audit.models.kimi_k3 import KIMI_K3
from audit.report import routing
from audit.report.diff import diff_routings
from tests.conftest import ROOT

#: every committed report of a model with draft layouts (Kimi-K3's: every pin, and the pip host's)
REPORTS = sorted(p.parent for p in (ROOT / "reports").glob("v*/routing.json")) + [ROOT / "reports" / "hosts" / "pip" /
                                                                                   "v0.33.0"]
DRAFT_LAYOUTS = {name for name, layout in KIMI_K3.layouts.items() if "--speculative-config" in layout.serve_args}


def _routing(where):
    return json.loads((where / "routing.json").read_text(encoding="utf-8"))


def _draft_cells(r):
    return [c for c in r["cells"] if c["status"] == "COMPLETE" and c.get("draft")]


@pytest.mark.parametrize("where", REPORTS, ids=[str(p.relative_to(ROOT / "reports")) for p in REPORTS])
def test_every_draft_row_is_the_drafts_own_and_names_its_class_and_layers(where):
    r = _routing(where)
    drafts = _draft_cells(r)
    assert DRAFT_LAYOUTS == {"tp8-mtp", "tp8-eagle3", "tp8-dspark"}
    # every built cell of a draft layout names its draft (a cell vLLM refused or the simulation stopped may not)
    assert {(c["system"], c["layout"]) for c in r["cells"] if c["status"] == "COMPLETE" and c["layout"] in DRAFT_LAYOUTS} \
        == {(c["system"], c["layout"]) for c in drafts}
    assert drafts, "K3's draft layouts build a draft somewhere"
    labels = json.loads((where / "labels.json").read_text(encoding="utf-8"))["rows"]
    ledger = (where / "ledger.md").read_text(encoding="utf-8")
    for c in drafts:
        d = c["draft"]
        assert d["cls"] and d["layers"], (c["system"], c["layout"])
        target_layers = {n for ns in c["layer_kinds"].values() for n in ns}
        # the draft's layers come after the target's, and no target row or layer kind holds one of them
        assert min(d["layers"]) > max(target_layers), (c["system"], c["layout"], d["layers"])
        assert not set(d["layers"]) & {n for groups in c["lanes"].values() for g in groups for n in g["layers"]}
        assert {n for groups in d["lanes"].values() for g in groups for n in g["layers"]} <= set(d["layers"])
        own = [x for x in labels if x["system"] == c["system"] and x["layout"] == c["layout"] and x["model"] == "draft"]
        assert all(x["draft_class"] == d["cls"] for x in own)
        assert f"**Speculative draft: `{d['cls'].rsplit(':', 1)[-1]}`**" in ledger
    assert {x["model"] for x in labels} <= {"target", "draft"}


def test_k3s_drafts_are_the_classes_vllm_builds_numbered_as_vllm_serves_them():
    cells = {(c["system"], c["layout"]): c for c in _routing(ROOT / "reports" / "v0.33.0")["cells"]}
    mtp, eagle3, dspark = (cells[("b200_sxm", l)]["draft"] for l in ("tp8-mtp", "tp8-eagle3", "tp8-dspark"))
    assert mtp["cls"].endswith(":KimiK3MTP") and mtp["layers"] == [93] and mtp["numbering"] == {}
    assert eagle3["cls"].endswith(":Eagle3LlamaForCausalLM") and eagle3["numbering"] == {"0": 93}
    assert dspark["cls"].endswith(":K3DSparkForCausalLM") and dspark["numbering"] == {"0": 93, "1": 94}
    for d in (eagle3, dspark):  # vLLM's loader gives them the target's head and embedding
        assert ["lm_head", "language_model.lm_head"] in d["shares"]
    assert [g["ranges"] for g in dspark["lanes"]["dense"]] == ["93-94"]  # not a "layer 1" dense MLP of the target
    assert [g["ranges"] for g in cells[("b200_sxm", "tp8-dspark")]["lanes"]["dense"]] == ["0"]


def test_a_drafts_lane_change_is_a_draft_row_of_the_diff_and_gates():
    old = _routing(ROOT / "reports" / "v0.33.0")
    new = copy.deepcopy(old)
    cell = next(c for c in new["cells"] if c["layout"] == "tp8-eagle3" and c["status"] == "COMPLETE")
    (group,) = cell["draft"]["lanes"]["attention"]
    group["value"] = make("TritonAttentionBackend")
    d = diff_routings(old, new, KIMI_K3)
    (row,) = [r for r in d["changes"] if r["facet"] == "lane"]
    assert row["role"] == "draft" and row["layers"] == "draft layers 93"
    assert row["title"].endswith("(speculative draft Eagle3LlamaForCausalLM)") and row["class"] == "kernel"
    assert row["cells"] == [[cell["system"], cell["layout"]]]


def test_the_pr_summary_names_a_drafts_change_as_the_drafts():
    """The MTP draft's routed experts moving (and not the target's): the summary's line names the draft's class, so a
    reviewer never reads it as the target's experts."""
    old = _routing(ROOT / "reports" / "v0.33.0")
    new = copy.deepcopy(old)
    cell = next(c for c in new["cells"] if (c["system"], c["layout"]) == ("b200_sxm", "tp8-mtp"))
    for g in cell["draft"]["lanes"]["moe"]:  # TRT-LLM-Gen MXFP4 there
        g["value"] = make("MarlinExperts")
    d = diff_routings(old, new, KIMI_K3)
    (row,) = [r for r in d["changes"] if r["facet"] == "lane"]
    assert row["class"] == "experts" and row["role"] == "draft"
    assert "Routed experts (speculative draft KimiK3MTP)" in " ".join(d["summary"].split())


def test_a_draft_of_another_class_is_a_path_change():
    old = _routing(ROOT / "reports" / "v0.33.0")
    new = copy.deepcopy(old)
    cell = next(c for c in new["cells"] if c["layout"] == "tp8-mtp" and c["status"] == "COMPLETE")
    cell["draft"]["cls"] = "vllm.models.kimi_k3.nvidia.mtp:SomeOtherMTP"
    rows = [r for r in diff_routings(old, new, KIMI_K3)["changes"] if r["facet"] == "draft"]
    assert [(r["name"], r["class"], r["after"]) for r in rows] == [("draft class", "path", "SomeOtherMTP (layers 93)")]


def _file(records: list[dict]) -> EvidenceFile:
    recs = [{"seq": i, **r} for i, r in enumerate(records, 1)]
    return EvidenceFile(path=ROOT / "x.jsonl", header={"mode": "resolve", "cell": {"system": "b200_sxm",
                                                                                    "layout": "tp8-eagle3"}},
                        records=recs)


def test_a_model_view_takes_its_own_records_and_renumbers_the_drafts_modules():
    f = _file([{"kind": "stage", "stage": "construct", "ok": True, "seconds": 1.0},
               {"kind": "module", "name": "model.layers.0.mlp.down_proj", "layer": 0, "facts": {}},
               {"kind": "module", "name": "model.layers.0.mlp.down_proj", "layer": 0, "facts": {}, "role": "draft"},
               {"kind": "postload-step", "step": "x", "fn": "f", "outcome": "ok", "layer": 0, "role": "draft"}])
    target, draft = model_view(f, "target"), model_view(f, "draft", {0: 93})
    assert [r["layer"] for r in target.of_kind("module")] == [0] and not target.of_kind("postload-step")
    assert [r["layer"] for r in draft.of_kind("module")] == [93]
    assert [r["layer"] for r in draft.of_kind("postload-step")] == [93]
    assert target.of_kind("stage") == draft.of_kind("stage")  # the cell's own records are in both
    assert f.records[2]["layer"] == 0  # the file itself is left as it was


@pytest.mark.parametrize("record, fragment", [
    ({"numbering": {"0": "ninety-three"}, "shares": []}, "numbers module layer '0' as 'ninety-three'"),
    ({"numbering": {"zero": 93}, "shares": []}, "numbers module layer 'zero'"),
    ({"numbering": {}, "shares": [["lm_head"]]}, "not [draft module, target module] pairs"),
])
def test_a_draft_record_that_says_what_none_can_is_a_harness_fault(record, fragment):
    """The draft record is written by the probes: numbers that are no layer numbers are the harness's fault, and the
    cell shows no routing rather than rows filed under made-up layers."""
    numbering, wrong = routing._numbering(record)
    assert numbering == {} and fragment in wrong
    (fault,) = routing._draft_fault(wrong, "b200_sxm", "tp8-eagle3")
    assert fault["piece"] == "probe draft description" and fragment in fault["message"]
