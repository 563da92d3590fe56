"""labels.json: the perf-database labels each (system, layout, phase, tier) gets from the evidence, in
the database's own vocabulary, checked on the routing of real audits."""
import json

from audit.models.kimi_k3 import KIMI_K3
from audit.report.expectations import load, load_label_map
from audit.report.perflabels import build_labels, labels_json, moe_perf_lane
from audit.report.verdicts import judge
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data"


def routing(pin):
    return json.loads((DATA / f"routing-{pin}.json").read_text())


def test_labels_use_the_perf_database_vocabulary_and_agree_with_the_verdicts():
    exp = load(ROOT / "expectations" / "kimi-k3.toml")
    r = routing("v0.33.0")
    doc = build_labels(r, KIMI_K3, exp.label_map)
    assert doc["rows"] and set(r["lane"] for r in doc["rows"]) <= set(KIMI_K3.perf_lanes) | {"unknown"}
    # each judged verdict row with a derived label says the same label as labels.json for that cell/layers (and, for
    # a row judged at one batch, as that batch's by_tokens entry)
    label_rows = {(l["system"], l["layout"], l["harness_lane"], l["layers"]): l for l in doc["rows"]}
    compared = 0
    for v in judge(r, exp, KIMI_K3):
        row = label_rows.get((v["system"], v["layout"], v["lane"], v["layers"]))
        if not v.get("label") or row is None:
            continue
        if v.get("at"):
            at = next(t for t in row["by_tokens"] if t["tokens"].split(" (")[0] == v["at"])
            assert at["kernel_source"] == v["label"], v
        else:
            assert row["kernel_source"] == v["label"], v
        compared += 1
    assert compared > 20
    # the Marlin claim's lane: Marlin rows are w4a16, TRT-LLM MXFP8 rows are w4a8
    moe = [l for l in doc["rows"] if l["harness_lane"] == "moe"]
    assert {l["lane"] for l in moe if l["kernel"] == "MarlinExperts"} == {"w4a16_mxfp4"}
    assert {l["lane"] for l in moe if "MXFP8" in l["kernel_source"] or "megamoe" in l["kernel_source"]} == \
        {"w4a8_mxfp4_mxfp8"}
    assert all(l["evidence"] for l in doc["rows"])


def test_labels_are_deterministic_and_never_invent_a_lane():
    r = routing("v0.30.0")
    assert labels_json(r, KIMI_K3) == labels_json(json.loads(json.dumps(r)), KIMI_K3)
    unknown = {"raw": {"source": "moe.routed", "fields": ["Mxfp4MoeBackend.SOMETHING_NEW", "x:Y", "z:Mxfp4MoEMethod"]}}
    assert moe_perf_lane(KIMI_K3, unknown) == "unknown"
    assert moe_perf_lane(KIMI_K3, {"raw": {"fields": ["Mxfp4MoeBackend.FLASHINFER_TRTLLM_MXFP4_BF16"]}}) == "w4a16_mxfp4"


def test_incomplete_and_not_exercised_groups_are_listed_not_labelled():
    r = routing("v0.33.0")
    r["cells"][0]["status"] = "INCOMPLETE"
    doc = build_labels(r, KIMI_K3, load_label_map(ROOT / "expectations" / "kernel_source_backends.toml"))
    first = r["cells"][0]
    assert not [l for l in doc["rows"] if (l["system"], l["layout"]) == (first["system"], first["layout"])]
    assert {"system": first["system"], "layout": first["layout"], "why": "the cell did not finish"} in doc["not_labelled"]
    assert any(s.get("lane") == "kda.spec_verify" for s in doc["not_labelled"])


def test_labels_by_token_count_follow_the_path_that_serves_each_batch():
    """On SM90 FlashAttention MLA counts requests of up to 512 query tokens as decodes: labels.json says a
    512-token prefill chunk carries the decode kernel's label, longer chunks the prefill backend's; on SM100
    the tail tier moves with the batch."""
    exp = load(ROOT / "expectations" / "kimi-k3.toml")
    rows = build_labels(routing("v0.33.0"), KIMI_K3, exp.label_map)["rows"]

    def row(system, layout, lane):
        found = [l for l in rows if (l["system"], l["layout"], l["harness_lane"]) == (system, layout, lane)]
        assert len(found) == 1
        return {t["tokens"]: t for t in found[0]["by_tokens"]}

    mla = row("h100_sxm", "tp8", "mla.prefill")
    assert list(mla) == ["prefill 512", "prefill 2048", "prefill 8192"]
    assert mla["prefill 512"]["kernel_source"] == "flashattnmlabackend" and mla["prefill 512"]["harness_lane"] == "mla.decode"
    assert "decode path" in mla["prefill 512"]["why"]
    assert mla["prefill 8192"]["kernel_source"] == "flashattnprefillbackend" and "why" not in mla["prefill 8192"]
    moe = row("b200_sxm", "tp8", "moe")
    assert moe["decode 1"]["choices"]["latent_tail"].startswith("TAIL_FUSION")
    assert moe["prefill 8192"]["choices"]["latent_tail"] == "COLUMN_PARALLEL"
    assert {t["kernel_source"] for t in moe.values()} == {row_ks for row_ks in
                                                          [next(l["kernel_source"] for l in rows if (l["system"], l["layout"], l["harness_lane"]) == ("b200_sxm", "tp8", "moe"))]}


def test_a_configuration_vllm_refuses_gets_no_labels():
    """v0.30.0 refuses DEP8 MegaMoE on SM 9.0 at load, v0.33.0 already at construction: labels.json offers no
    lane for those cells (a server there never starts), and says why; a simulation limit is no refusal."""
    for pin in ("v0.30.0", "v0.33.0"):
        r = routing(pin)
        doc = build_labels(r, KIMI_K3)
        refused = {(c["system"], c["layout"]) for c in r["cells"]
                   if c.get("load_refused") or (c.get("failure") or {}).get("outcome") == "refused"}
        assert ("h100_sxm", "dep8") in refused
        assert not [l for l in doc["rows"] if (l["system"], l["layout"]) in refused]
        why = {(s["system"], s["layout"]): s["why"] for s in doc["not_labelled"] if "lane" not in s}
        assert all(why[c].startswith("vLLM refuses to") for c in refused)
        assert all("DeepGEMM MegaMoE requires SM100 GPUs." in why[c] for c in refused if c[1] == "dep8")
        # the deployment options vLLM refuses say their own reason (fp8_ds_mla: no MLA backend takes it)
        assert all("fp8_ds_mla" in why[c] for c in refused if c[1] == "tp8-fp8dsmla")
        limited = [c for c in r["cells"] if (c.get("failure") or {}).get("outcome") == "limit"]
        assert all(any((l["system"], l["layout"]) == (c["system"], c["layout"]) for l in doc["rows"]) for c in limited)
