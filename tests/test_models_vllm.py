"""gpt-oss-120b on the real vLLM wheel pinned in images.lock (v0.33.0), through the same audit K3 goes through:
its own report beside K3's (which it never touches), construction and post-load to the end, and what vLLM 0.33.0
chooses for it: MXFP4 experts per SM family and layout, attention with sinks per SM family, and the FlashInfer
attention candidate vLLM turns down here for sinks (resolve mode runs offline: no TRT-LLM cubins)."""

import pytest

from audit.lanevalue import text

from audit.models.gpt_oss import GPT_OSS_120B
from tests.conftest import audit_beside_k3

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def audit(vllm_env, tmp_path_factory):
    return audit_beside_k3(tmp_path_factory, GPT_OSS_120B, "l40s,h100_sxm,b200_sxm", "tp1,tp8,dp8-ep")


def _value(cell, lane):
    """The lane's one value in words; a selector's answer as "BACKEND / Kernel" (vLLM's value beside what runs)."""
    groups = cell["lanes"][lane]
    assert len(groups) == 1, groups
    value = groups[0]["value"]
    return f"{value['backend']} / {value['kernel']}" if value.get("backend") else text(groups[0])


def test_its_report_goes_beside_k3s_and_leaves_it_alone(audit):
    assert audit["outcome"].report_dir == audit["reports"] / "gpt-oss-120b" / "v0.33.0"
    assert audit["routing"]["model"] == "gpt-oss-120b" and audit["routing"]["architecture"] == "GptOssForCausalLM"
    assert {p.name: p.read_bytes() for p in (audit["reports"] / "v0.33.0").iterdir()} == audit["before"]
    assert "make audit PIN=v0.33.0 MODEL=gpt-oss-120b" in audit["outcome"].ledger.read_text()


def test_every_cell_builds_and_post_loads_to_the_end(audit):
    assert len(audit["cells"]) == 9
    for key, cell in audit["cells"].items():
        assert cell["status"] == "COMPLETE", key
        post = cell["postload"]
        assert post["ran"] and post["refused"] == 0 and post["limits"] == [], key
        assert cell["layer_kinds"] == {"attention": list(range(36)), "moe": list(range(36))}, key


def test_what_vllm_chooses_for_its_experts(audit):
    cells = audit["cells"]
    assert _value(cells[("l40s", "tp1")], "moe") == "MARLIN / MarlinExperts"
    assert _value(cells[("h100_sxm", "tp8")], "moe") == "TRITON / OAITritonMxfp4ExpertsMonolithic"
    assert _value(cells[("b200_sxm", "tp8")], "moe") == "FLASHINFER_TRTLLM_MXFP4_BF16 / TrtLlmMxfp4ExpertsMonolithic"
    assert _value(cells[("b200_sxm", "dp8-ep")], "moe.kernel") == (
        "TrtLlmMxfp4ExpertsModular with MoEPrepareAndFinalizeNaiveDPEPModular (all2all: AgRsAll2AllManager)")
    for key, cell in cells.items():  # vLLM asked the kernel it built whether it takes gpt-oss's activation
        assert _value(cell, "moe.activation").startswith("SWIGLUOAI (") and "vLLM asked the kernel" in \
            _value(cell, "moe.activation"), key


def test_attention_with_sinks_and_the_candidate_vllm_turned_down(audit):
    cells = audit["cells"]
    assert _value(cells[("l40s", "tp8")], "attention.decode") == "TritonAttentionBackend"
    assert _value(cells[("h100_sxm", "tp8")], "attention.prefill") == "FlashAttentionBackend"
    b200 = cells[("b200_sxm", "tp8")]
    # vLLM offers FlashInfer for sinks only with TRT-LLM's cubins: fetched from NVIDIA's artifactory (a request vLLM
    # makes) or installed (flashinfer-cubin). Offline, as here, its check says no and FlashAttention serves.
    av = b200["availability"]
    assert av["nvidia_artifactory"] in (True, False), av  # vLLM asked on SM 10.0, and the answer was recorded
    rejected = {r["backend"]: r["reasons"] for r in b200["attention_candidates"]["rejected"]}
    if av["nvidia_artifactory"] is False and av.get("flashinfer_cubin") is False:
        assert "attention sinks not supported" in rejected.get("FLASHINFER", [])
        assert _value(b200, "attention.decode") == "FlashAttentionBackend"
    else:  # a machine that reaches the artifactory: sinks are no reason to turn FlashInfer down
        assert "attention sinks not supported" not in rejected.get("FLASHINFER", [])
