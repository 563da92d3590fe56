"""DeepSeek-V3 (FP8 block-quantized experts, MLA) on the real vLLM wheel pinned in images.lock (v0.33.0), through
the same audit as the other models: its own report beside K3's, its experts chosen by vLLM's FP8 MoE oracle (the
fp8_block scheme's probes, none of MXFP4's), its layers attributed to the kinds its profile names, and claims in
the FP8 scheme's precision lanes judged against what vLLM chose."""
import json

import pytest

from audit.models.deepseek_v3 import DEEPSEEK_V3
from tests.conftest import audit_beside_k3

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def audit(vllm_env, tmp_path_factory):
    out = audit_beside_k3(tmp_path_factory, DEEPSEEK_V3, "l40s,h200_sxm,b200_sxm", "tp8,dp8-ep")
    return {**out, "labels": json.loads((out["outcome"].report_dir / "labels.json").read_text())}


def _value(cell, lane):
    groups = cell["lanes"][lane]
    assert len(groups) == 1, groups
    return groups[0]["value"]


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
    assert _value(cells[("h200_sxm", "tp8")], "mla.decode") == "FlashAttnMLABackend / FlashAttnMLAImpl"
    assert _value(b200, "mla.decode") == "FlashInferMLABackend / FlashInferMLAImpl"


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
