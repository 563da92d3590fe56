"""DeepSeek-V3 (FP8 block-quantized experts, MLA) on the real vLLM wheel pinned in images.lock (v0.33.0), through
the same audit as the other models: its own report beside K3's, its experts chosen by vLLM's FP8 MoE oracle (the
fp8_block scheme's probes, none of MXFP4's), its layers attributed to the kinds its profile names, and claims in
the FP8 scheme's precision lanes judged against what vLLM chose."""
import json

import pytest

from audit.lanevalue import text

from audit.models.deepseek_v3 import DEEPSEEK_V3
from tests.conftest import audit_beside_k3

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def audit(vllm_env, tmp_path_factory):
    out = audit_beside_k3(tmp_path_factory, DEEPSEEK_V3, "l40s,h200_sxm,b200_sxm", "tp8,dp8-ep")
    return {**out, "labels": json.loads((out["outcome"].report_dir / "labels.json").read_text())}


def _value(cell, lane):
    """The lane's one value in words; a selector's answer as "BACKEND / Kernel" (vLLM's value beside what runs)."""
    groups = cell["lanes"][lane]
    assert len(groups) == 1, groups
    value = groups[0]["value"]
    return f"{value['backend']} / {value['kernel']}" if value.get("backend") else text(groups[0])


def test_its_report_goes_beside_k3s_and_every_layer_is_attributed(audit):
    assert audit["outcome"].report_dir == audit["reports"] / "deepseek-v3" / "v0.33.0"
    assert audit["routing"]["architecture"] == "DeepseekV3ForCausalLM"
    assert {p.name: p.read_bytes() for p in (audit["reports"] / "v0.33.0").iterdir()} == audit["before"]
    assert len(audit["cells"]) == 6
    for key, cell in audit["cells"].items():
        assert cell["status"] == "COMPLETE" and not cell.get("harness_faults"), key
        assert cell["layer_kinds"] == {"dense": [0, 1, 2], "mla": list(range(61)), "moe": list(range(3, 61))}, key
        assert cell["postload"]["ran"] and cell["postload"]["refused"] == 0, key


def test_the_fp8_oracle_chooses_its_experts_per_sm_and_layout(audit):
    cells = audit["cells"]
    # vLLM 0.33's FP8 oracle puts Triton first for block FP8 on SM 9.0 under TP, FlashInfer CUTLASS under EP
    assert _value(cells[("h200_sxm", "tp8")], "moe") == "TRITON / TritonExperts"
    assert _value(cells[("h200_sxm", "dp8-ep")], "moe") == "FLASHINFER_CUTLASS / FlashInferExperts"
    assert _value(cells[("b200_sxm", "tp8")], "moe") == "FLASHINFER_TRTLLM / TrtLlmFp8ExpertsMonolithic"
    assert _value(cells[("l40s", "tp8")], "moe") == "TRITON / TritonExperts"
    b200 = cells[("b200_sxm", "tp8")]
    tried = [t for group in b200["candidates"]["moe"] for t in group["value"]]
    assert [t["backend"] for t in tried][-1] == "FLASHINFER_TRTLLM" and tried[-1]["supported"]
    assert all(not t["supported"] for t in tried[:-1]) and all(t["backend"] == "AITER" for t in tried[:-1])
    assert _value(cells[("h200_sxm", "tp8")], "mla.decode") == "FlashAttnMLABackend"
    assert _value(b200, "mla.decode") == "FlashInferMLABackend"


def test_only_the_fp8_schemes_probes_were_installed(audit):
    status = {}
    for path in (audit["outcome"].run_dir / "evidence" / "b200_sxm--tp8").glob("evidence-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "target":
                status[rec["target"]] = rec["status"]
    assert status["moe.oracle.fp8"] == "patched" and status["moe.candidates"] == "patched"
    assert status["moe.quant_method"] == "patched"
    assert "moe.oracle.mxfp4" not in status and "moe.mega_moe_experts" not in status


def test_claims_are_judged_in_the_fp8_schemes_precision_lanes(audit):
    rows = audit["routing"]["verdicts"]["rows"]
    hopper = [r for r in rows if r["claim"] == "moe-hopper-deepgemm" and r["system"] == "h200_sxm"]
    assert {r["layout"]: r["verdict"] for r in hopper} == {"tp8": "MISMATCH", "dp8-ep": "MISMATCH"}
    blackwell = [r for r in rows if r["claim"] == "moe-blackwell-trtllm-gen" and r["system"] == "b200_sxm"]
    assert blackwell and all(r["verdict"] == "MATCH" for r in blackwell)
    moe_rows = [r for r in audit["labels"]["rows"] if r["harness_lane"] == "moe"]
    assert moe_rows and {r["lane"] for r in moe_rows} == {"w8a8_fp8_block"}


# -- post-load through the FP8 stand-ins (DeepGEMM's scale layout, vLLM's compiled re-quantization) ---------------

EAGER = "vllm.utils.deep_gemm:per_block_cast_to_fp8 (torch.compile)"
DEEP_GEMM = "deep_gemm:transform_sf_into_required_layout"
#: vLLM refuses (planted) once DeepGEMM's scale layout is made, after the weight was re-quantized: both stand-ins ran
REFUSED_AFTER_LAYOUT = ("vllm.model_executor.layers.quantization.utils.fp8_utils", [
    ("    return transform_sf_into_required_layout(\n        sf=ws,",
     "    _planted = transform_sf_into_required_layout(\n        sf=ws,"),
    ("        is_sfa=is_sfa,\n    )\n\n\ndef deepgemm_post_process_fp8_weight_block(",
     "        is_sfa=is_sfa,\n    )\n    raise ValueError('planted: refused once the scale layout is made')\n\n\n"
     "def deepgemm_post_process_fp8_weight_block("),
])


def _run_cells(vllm_env, tmp_path_factory, name, cells, *, plants=(), plant_fault=""):
    from audit.evidence import files as evidence
    from audit.models.deepseek_v3 import LAYOUTS
    from audit.report import routing
    from audit.runtimes import RunRequest
    from audit.systems import SYSTEMS
    from tests.plant import sitecustomize

    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name)
    if plants:
        (run_dir / "sitecustomize.py").write_text(sitecustomize(list(plants)), encoding="utf-8")
    req = RunRequest(pin=pin, profile=DEEPSEEK_V3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in cells],
                     run_dir=run_dir, parallel=2, plant_fault=plant_fault)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    files = evidence.read_dir(result.evidence_dir)
    r = routing.build_routing(files, DEEPSEEK_V3, pin=pin.as_provenance(), expected=list(cells))
    return {"files": {f.cell: f for f in files if f.cell}, "cells": {(c["system"], c["layout"]): c for c in r["cells"]}}


def test_post_load_on_hopper_runs_to_the_end_through_the_fp8_stand_ins(audit):
    """On SM 9.0 vLLM re-quantizes every block-FP8 linear weight to UE8M0 scales (its compiled helper, run eagerly)
    and has DeepGEMM lay the scales out (its SM 9.0 FP32 branch): post-load runs to the end, both are listed and
    ran, and the experts kernel is the one post-load built."""
    for layout in ("tp8", "dp8-ep"):
        key = ("h200_sxm", layout)
        cell = audit["cells"][key]
        assert cell["postload"]["limit"] == 0 and cell["postload"]["limits"] == [], key
        assert EAGER in cell["simulated"] and DEEP_GEMM in cell["simulated"], key
        assert {g["level"] for g in cell["lanes"]["moe.kernel"]} == {"post-load"}, key
    calls = {}
    for path in (audit["outcome"].run_dir / "evidence" / "h200_sxm--tp8").glob("evidence-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "simulated":
                calls.update(rec["kernel_calls"])
    assert calls.get("vllm.utils.deep_gemm.per_block_cast_to_fp8 (eager)", 0) > 0, calls
    assert calls.get("deep_gemm transform_sf_into_required_layout (meta)", 0) > 0, calls
    # on SM 10.0 MLA's post-load calls vLLM's fused per-token-group quantization op
    # (_C::per_token_group_fp8_quant_packed), which has no meta kernel: the one limit left there, named as such
    b200 = audit["cells"][("b200_sxm", "tp8")]["postload"]["limits"]
    assert [l["vllm_function"].rsplit(":", 1)[1] for l in b200] == ["per_token_group_quant_fp8_packed_for_deepgemm"]


def test_a_refusal_after_the_fp8_stand_ins_is_vllms(vllm_env, tmp_path_factory):
    run = _run_cells(vllm_env, tmp_path_factory, "fp8-refused", [("h200_sxm", "tp8")], plants=[REFUSED_AFTER_LAYOUT])
    cell = run["cells"][("h200_sxm", "tp8")]
    r = cell["load_refused"]
    assert r is not None and r["message"] == "planted: refused once the scale layout is made", r
    assert r["function"].endswith("deepgemm_post_process_weight_scale_block") and r["type"] == "builtins:ValueError"
    assert cell["harness_faults"] == [] and cell["postload"]["refused"] > 0 and cell["postload"]["limit"] == 0
    calls = run["files"][("h200_sxm", "tp8")].of_kind("simulated")[-1]["kernel_calls"]
    assert calls.get("vllm.utils.deep_gemm.per_block_cast_to_fp8 (eager)", 0) > 0, calls


def test_a_fault_in_the_eager_stand_in_is_a_harness_fault(vllm_env, tmp_path_factory):
    run = _run_cells(vllm_env, tmp_path_factory, "fp8-eager-fault", [("h200_sxm", "tp8")], plant_fault=EAGER)
    cell = run["cells"][("h200_sxm", "tp8")]
    assert [f["piece"] for f in cell["harness_faults"]][:1] == [EAGER], cell["harness_faults"]
    assert cell["status"] == "INCOMPLETE" and cell["lanes"] == {}
