"""Speculative drafts other than MTP against the real vLLM wheel pinned in images.lock (v0.33.0), in resolve mode.

DSpark (``tp8-dspark``, a deployment option): K3's dense MLA draft, its config written into the cell's model directory
from package data. vLLM's runner drafts every token of a DSpark block in one pass, so the draft's rows are that pass's
batch: the requests of the target step times the speculator's query tokens per request, read from the speculator vLLM
builds. A planted change to that count (the DFlash-style 1 + N layout) must move the draft's rows and nothing else.
"""
import json

import pytest

from audit.lanevalue import text

from audit.evidence import files as evidence
from audit.models.kimi_k3 import KIMI_K3, LAYOUTS
from audit.report import routing
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS

pytestmark = pytest.mark.vllm

CELL = ("b200_sxm", "tp8-dspark")


def _cells(vllm_env, run_dir, systems=(CELL[0],), **kw):
    rt, pin, _ = vllm_env
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[CELL[1]]) for s in systems], run_dir=run_dir,
                     **kw)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    return {f.cell[0]: routing.build_cell(f, KIMI_K3) for f in evidence.read_dir(result.evidence_dir)}


def _one_cell(vllm_env, run_dir, **kw):
    return _cells(vllm_env, run_dir, **kw)[CELL[0]]


@pytest.fixture(scope="module")
def both(vllm_env, tmp_path_factory):
    return _cells(vllm_env, tmp_path_factory.mktemp("dspark"), systems=("b200_sxm", "h200_sxm"))


@pytest.fixture(scope="module")
def dspark(both):
    return both[CELL[0]]


@pytest.fixture(scope="module")
def planted(vllm_env, tmp_path_factory):
    from tests.plant import sitecustomize

    run_dir = tmp_path_factory.mktemp("dspark-planted")
    (run_dir / "sitecustomize.py").write_text(sitecustomize([("vllm.v1.worker.gpu.spec_decode.dspark.speculator", [
        ("self.num_query_per_req = self.num_speculative_steps", "self.num_query_per_req = 1 + self.num_speculative_steps")])]),
        encoding="utf-8")
    return _one_cell(vllm_env, run_dir)


def _draft_rows(cell, lane):
    return [g for g in cell["dispatch"]["lanes"].get(lane, []) if g.get("role") == "draft"]


def test_the_dspark_draft_is_built_and_its_rows_are_its_one_pass(dspark):
    """The draft config reaches vLLM through the layout's argv (``<model>/draft``), vLLM builds K3's DSpark draft (two
    MLA layers and dense MLPs after the target's 93), and its MLA rows are one pass of 4 query tokens per request."""
    assert dspark["status"] == "COMPLETE" and not dspark["harness_faults"]
    assert '"model": "<model-dir>/draft"' in " ".join(dspark["argv"])
    # the draft is named apart from the target: its class, its layers as vLLM numbers them (its modules count from
    # 0), the target's embedding and head it holds; no draft layer is filed under a target layer
    draft = dspark["draft"]
    assert draft["cls"] == "vllm.models.kimi_k3.nvidia.dspark_mla:K3DSparkForCausalLM"
    assert draft["layers"] == [93, 94] and draft["numbering"] == {"0": 93, "1": 94}
    assert draft["layer_kinds"]["mla"] == [93, 94] and draft["layer_kinds"]["dense"] == [93, 94]
    assert ["lm_head", "language_model.lm_head"] in draft["shares"]
    assert max(dspark["layer_kinds"]["mla"]) == 92 and dspark["layer_kinds"]["dense"] == [0]
    assert [g["ranges"] for g in draft["lanes"]["dense"]] == ["93-94"] and [g["ranges"] for g in dspark["lanes"]["dense"]] == ["0"]
    assert "UnquantizedLinearMethod" in text(draft["lanes"]["dense"][0]) and "93" not in dspark["lanes"]["mla.decode"][-1]["ranges"]
    for lane in ("mla", "mla_kv_cache"):
        (rows,) = _draft_rows(dspark, lane)
        assert rows["layers"] == [93, 94] and rows["draft"] == "K3DSparkForCausalLM"
        assert rows["tiers"]["decode 8"].startswith("draft pass (8x4): ")
        assert rows["tiers"]["prefill 2048"].startswith("draft pass (1x4): ")
        assert rows["tiers"]["verify 320 (64x5)"].startswith("draft pass (64x4): ")
    (mla,) = _draft_rows(dspark, "mla")
    assert "decode path" in mla["tiers"]["decode 8"]  # 4 query tokens per request are within the decode threshold


def test_a_planted_query_count_moves_only_the_draft_rows(dspark, planted):
    """The speculator's query tokens per request planted to 1 + N: every draft row names the 5-token pass; the target's
    rows of every lane and every construction lane stay as they were."""
    for lane in ("mla", "mla_kv_cache"):
        (rows,) = _draft_rows(planted, lane)
        assert rows["tiers"]["decode 8"].startswith("draft pass (8x5): ")
    target = lambda cell: {lane: [g for g in groups if g.get("role") != "draft"]  # noqa: E731
                           for lane, groups in cell["dispatch"]["lanes"].items()}
    assert target(planted) == target(dspark)
    assert json.dumps(planted["lanes"], sort_keys=True) == json.dumps(dspark["lanes"], sort_keys=True)
    moved = {lane for lane in dspark["dispatch"]["lanes"]
             if _draft_rows(dspark, lane) != _draft_rows(planted, lane)}
    assert moved == {"mla", "mla_kv_cache"}


def test_the_draft_is_built_under_the_config_vllms_dspark_loader_derives(both):
    """vLLM's DSpark loader builds the draft with non-causal attention: on SM 9.0 that rules FlashAttention MLA out for
    the draft's layers (Triton MLA), while the target's MLA layers keep FlashAttention MLA. Building the draft under the
    target's config, as an MTP draft is built, would have named FlashAttention for both."""
    h200 = both["h200_sxm"]
    (draft,) = _draft_rows(h200, "mla_kv_cache")
    target = [g for g in h200["dispatch"]["lanes"]["mla_kv_cache"] if g.get("role") != "draft"]
    assert all(t.endswith("then TritonMLAImpl") for t in draft["tiers"].values())  # every pass: 4 tokens a request
    assert target and all("TritonMLAImpl" not in t for g in target for t in g["tiers"].values())
    assert "FlashAttnMLAImpl" in target[0]["tiers"]["decode 8"]
    assert "draft loader's get_model (construction only, no weights)" in h200["simulated"]


def test_a_fault_in_the_draft_loader_stand_in_is_a_harness_fault(vllm_env, tmp_path):
    """A raise planted inside the stand-in for the DSpark loader's get_model ends the cell as a harness fault, never
    as vLLM refusing the draft."""
    from probes.resolve.cell import DRAFT_LOADER

    cell = _one_cell(vllm_env, tmp_path, plant_fault=DRAFT_LOADER)
    assert [f["piece"] for f in cell["harness_faults"]] == [DRAFT_LOADER]


def test_a_refusal_after_the_draft_loader_stand_in_is_vllms(vllm_env, tmp_path):
    """vLLM's DSpark loader refusing after its get_model returned (planted) is vLLM's refusal of the draft: the draft
    stage fails with vLLM's message, and no harness fault is recorded."""
    from tests.plant import sitecustomize

    (tmp_path / "sitecustomize.py").write_text(sitecustomize([("vllm.v1.worker.gpu.spec_decode.dspark.utils", [
        ("    target_language_model = (",
         "    raise ValueError('planted: the DSpark draft is refused once built')\n    target_language_model = (")])]),
        encoding="utf-8")
    cell = _one_cell(vllm_env, tmp_path)
    assert not cell["harness_faults"]
    assert cell["failure"]["stage"] == "construct-draft"
    assert cell["failure"]["message"] == "planted: the DSpark draft is refused once built"


# -- EAGLE3 (``tp8-eagle3``): a Llama-style draft, built by vLLM's EAGLE loader ------------------------------------

def _eagle3(vllm_env, run_dir, systems):
    rt, pin, _ = vllm_env
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS["tp8-eagle3"]) for s in systems],
                     run_dir=run_dir)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    return {f.cell[0]: routing.build_cell(f, KIMI_K3) for f in evidence.read_dir(result.evidence_dir)}


@pytest.fixture(scope="module")
def eagle3(vllm_env, tmp_path_factory):
    return _eagle3(vllm_env, tmp_path_factory.mktemp("eagle3"), ("b200_sxm", "h200_sxm"))


@pytest.fixture(scope="module")
def eagle3_planted(vllm_env, tmp_path_factory):
    from tests.plant import sitecustomize

    run_dir = tmp_path_factory.mktemp("eagle3-planted")
    (run_dir / "sitecustomize.py").write_text(sitecustomize([("vllm.platforms.cuda", [
        ("                AttentionBackendEnum.FLASH_ATTN,\n                AttentionBackendEnum.FLASHINFER,",
         "                AttentionBackendEnum.FLASHINFER,\n                AttentionBackendEnum.FLASH_ATTN,")])]),
        encoding="utf-8")
    return _eagle3(vllm_env, run_dir, ("h200_sxm",))["h200_sxm"]


def _attention(cell):
    return [(text(g), g["ranges"]) for g in cell["draft"]["lanes"]["attention"]]


def test_the_eagle3_draft_has_plain_attention_chosen_per_sm_and_shares_the_target_head(eagle3):
    """The EAGLE3 draft's one layer (93, after the target's) is plain multi-head attention, chosen by vLLM's selector
    for the draft: FlashInfer on SM 10.0, FlashAttention on SM 9.0. vLLM's EAGLE loader gives the draft the target's
    lm_head, so the draft head's rows are K3's low-latency plan at one row per request."""
    b200, h200 = eagle3["b200_sxm"], eagle3["h200_sxm"]
    assert not b200["harness_faults"] and not h200["harness_faults"]
    assert _attention(b200) == [("FlashInferBackend", "93")] and _attention(h200) == [("FlashAttentionBackend", "93")]
    assert b200["draft"]["layer_kinds"] == {"attention": [93]} and "attention" not in b200["layer_kinds"]
    assert b200["draft"]["cls"] == "vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM"
    assert b200["draft"]["numbering"] == {"0": 93} and [g["ranges"] for g in b200["draft"]["lanes"]["dense"]] == ["93"]
    assert ["lm_head", "language_model.lm_head"] in b200["draft"]["shares"]
    (head,) = _draft_rows(b200, "lm_head")
    assert head["tiers"]["decode 8"].startswith("M=8: ") and head["tiers"]["verify 4 (1x4)"].startswith("M=1: ")


def test_a_planted_backend_order_moves_only_the_draft_attention(eagle3, eagle3_planted):
    """FlashInfer planted ahead of FlashAttention in vLLM's plain-attention order for SM 9.0: the draft's attention
    lane names FlashInfer and no other construction lane moves (MLA's backend order is another list). On the
    image's host (flashinfer-cubin installed, as the session's runs arrange it) no dispatch row moves either: the
    step's CUDA-graph mode, which vLLM derives from every attention builder, the draft's included, stays piecewise.
    (Without the cubin package the same plant turned the step eager.)"""
    before = eagle3["h200_sxm"]
    assert _attention(eagle3_planted) == [("FlashInferBackend", "93")]
    assert before["lanes"] == eagle3_planted["lanes"]  # no lane of the target moves
    draft_before, draft_after = before["draft"]["lanes"], eagle3_planted["draft"]["lanes"]
    moved = {lane for lane in set(draft_before) | set(draft_after) if draft_before.get(lane) != draft_after.get(lane)}
    assert moved == {"attention"}
    lanes_before, lanes_after = before["dispatch"]["lanes"], eagle3_planted["dispatch"]["lanes"]
    moved = {lane for lane in lanes_before if lanes_before[lane] != lanes_after.get(lane)}
    assert moved == set() and set(lanes_after) == set(lanes_before), moved
    for lanes in (lanes_before, lanes_after):
        assert lanes["serving_path"][0]["tiers"]["decode 8"] == "PIECEWISE graph (breakable: attention eager), 8 tokens"
