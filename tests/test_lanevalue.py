"""Lane values as records (audit/lanevalue.py, audit/report/values.py): what a record holds, its identity and its
sentence; how a recorded answer becomes one; the cell-level parts (family, refusal, raises); and a schema 2 routing
(values as sentences) read, upgraded and rendered."""
import copy
import json

import pytest

from audit.lanevalue import FLAGS, cut, from_fields, from_modules, identity, inactive, is_inactive, make, sentence, text
from audit.models.kimi_k3 import KIMI_K3
from audit.report.diff import diff_routings, load_routing
from audit.report.render import render_ledger
from audit.report.values import finish
from tests.conftest import ROOT

REPORTS = ROOT / "reports"


def test_a_record_names_what_runs_and_its_sentence_is_derived():
    v = make("TrtLlmMxfp4ExpertsMonolithic", detail="with MoEPrepareAndFinalizeNoDPEPMonolithic",
             backend="FLASHINFER_TRTLLM_MXFP4_MXFP8")
    assert sentence(v) == "TrtLlmMxfp4ExpertsMonolithic with MoEPrepareAndFinalizeNoDPEPMonolithic"
    assert identity(v) == ("TrtLlmMxfp4ExpertsMonolithic with MoEPrepareAndFinalizeNoDPEPMonolithic", False)
    noted = make("SITU", note="MarlinExperts; vLLM asked the kernel: supported")
    assert sentence(noted) == "SITU (MarlinExperts; vLLM asked the kernel: supported)" and identity(noted) == ("SITU", False)
    off = inactive("not requested")
    assert is_inactive(off) and sentence(off) == "not requested" and identity(off) == ("not requested", True)
    # what would run where nothing runs is no part of the identity
    assert identity(inactive("not exercised: x", kernel="fused_recurrent_kda")) == ("not exercised: x", True)
    assert text({"value": off}) == "not requested"
    with pytest.raises(ValueError, match="unknown lane value flag"):
        make("x", flags=("maybe",))
    assert set(FLAGS) >= {"inactive", "refused", "raises-at-dispatch", "needs-gpu"}


def test_a_recorded_answer_becomes_a_record():
    moe = from_fields(["Mxfp4MoeBackend.MARLIN", "vllm.model_executor.layers.fused_moe.experts.marlin:MarlinExperts"])
    assert (moe["kernel"], moe["backend"], moe["note"]) == ("MarlinExperts", "MARLIN", "")
    mla = from_fields(["vllm.v1.attention.backends.mla.flashmla:FlashMLABackend",
                       "vllm.v1.attention.backends.mla.flashmla:FlashMLAImpl"])
    assert mla["kernel"] == "FlashMLABackend"  # the backend vLLM selected; its implementation class follows from it
    kernels = KIMI_K3.backend_labels.kernels["kda.decode"]
    kda = from_fields(["native"], kernels=kernels)
    assert (kda["kernel"], kda["backend"]) == ("fused_kda_decode", "native")  # one name: the kernel it enters
    old = from_fields([False], label="fused decode kernel supported:", kernels=kernels)
    assert old["kernel"] == "fused_recurrent_kda_packed_decode" and old["note"] == "fused decode kernel supported: no"
    mega = from_fields(["vllm.models.kimi_k3.nvidia.model:KimiK3MegaMoEExperts"], label="MegaMoE")
    assert sentence(mega) == "KimiK3MegaMoEExperts (MegaMoE)"
    linears = from_modules([["down_proj", "vllm.x:UnquantizedLinearMethod"], ["gate_up_proj", "vllm.y:Fp8LinearMethod"]])
    assert linears["kernel"] == "down_proj: UnquantizedLinearMethod, gate_up_proj: Fp8LinearMethod"


def test_messages_are_cut_at_a_words_end():
    assert cut("short", 10) == "short"
    assert cut("CUDA_TOOLKIT_PATH: not set - Target device", 30) == "CUDA_TOOLKIT_PATH: not set …"
    assert not cut("x" * 50, 10).startswith("x" * 11)


def test_the_cell_level_parts_come_from_the_cell():
    """The family in the claims' words, ``refused`` where vLLM refuses the deployment, ``raises-at-dispatch`` (with
    where and why) where vLLM raises on a batch the lane serves: tp8-fp8kv's prefill."""
    r = load_routing(REPORTS, "v0.33.0", KIMI_K3)
    by = {(c["system"], c["layout"]): c for c in r["cells"]}
    prefill = by[("h100_sxm", "tp8-fp8kv")]["lanes"]["mla.prefill"][0]["value"]
    assert "raises-at-dispatch" in prefill["flags"] and prefill["raises"]["at"].startswith("prefill")
    assert "Kimi-K3 fp8 KV cache requires an fp8 prefill query" in prefill["raises"]["why"]
    assert prefill["family"] == "flash_attn"
    refused = by[("h100_sxm", "tp8-fp8kv-fp8prefill")]
    assert all("refused" in g["value"]["flags"] for gs in refused["lanes"].values() for g in gs)
    kda = by[("b200_sxm", "tp8")]["lanes"]["kda.decode"][0]["value"]
    assert kda["family"] == r["verdicts"]["label_map"]["fused_kda_decode"]  # the claims' word for it
    again = finish(copy.deepcopy(r), KIMI_K3, r["verdicts"]["label_map"])
    assert again == r  # idempotent: a committed routing re-finished is itself


def test_a_schema_2_routing_is_upgraded_when_read_renders_and_diffs_as_the_same_serving(tmp_path):
    """A real schema 2 routing (eight cells of the v0.33.0 report as schema 2 wrote it, values as sentences) is
    upgraded to records when read, renders, and compared with today's routing of the same evidence shows no serving
    change: an old baseline still gates a new audit truthfully."""
    (tmp_path / "v0.33.0").mkdir()
    old = (ROOT / "tests" / "data" / "routing-v0.33.0-schema2-sample.json").read_text(encoding="utf-8")
    assert json.loads(old)["schema"] == 2
    (tmp_path / "v0.33.0" / "routing.json").write_text(old, encoding="utf-8")
    upgraded = load_routing(tmp_path, "v0.33.0", KIMI_K3)
    assert upgraded["schema"] == 3
    assert all(isinstance(g["value"], dict) for c in upgraded["cells"] for gs in c["lanes"].values() for g in gs)
    assert "## Summary: what Kimi-K3 runs" in render_ledger(upgraded, profile=KIMI_K3, reproduce="x")
    new = load_routing(REPORTS, "v0.33.0", KIMI_K3)
    keep = {(c["system"], c["layout"]) for c in upgraded["cells"]}
    new["cells"] = [c for c in new["cells"] if (c["system"], c["layout"]) in keep]
    d = diff_routings(upgraded, new, KIMI_K3)
    assert d["serving_changes"] == 0, [(r["title"], r["before"], r["after"]) for r in d["changes"] if r["serving"]]
    with pytest.raises(Exception, match="routing schema 1"):  # older than that: refused, with how to render it
        (tmp_path / "v0.33.0" / "routing.json").write_text(old.replace('"schema": 2', '"schema": 1'), encoding="utf-8")
        load_routing(tmp_path, "v0.33.0", KIMI_K3)
