"""Perf-database vocabulary derived from evidence: a kernel_source label and a backend family per
lane group. Mappings are data (facts from docs/notes/labels-and-kernels.md), not guesses made at
run time; a value the tables do not know gives label/family "unknown", never an invented one."""
from __future__ import annotations

from audit.report.routing import short

#: Mxfp4MoeBackend member prefix -> backend family
MOE_FAMILY = (
    ("FLASHINFER_TRTLLM", "flashinfer_trtllm_gen"),
    ("FLASHINFER_CUTLASS", "cutlass"),
    ("BATCHED_MARLIN", "marlin"),
    ("MARLIN", "marlin"),
    ("DEEPGEMM", "deepgemm"),
    ("HUMMING", "humming"),
    ("TRITON", "triton"),
    ("CUTLASS", "cutlass"),
)
#: (lane, vLLM's resolved KDA backend string) -> kernel_source label of the kernel it enters
KDA_LABEL = {
    ("kda.prefill", "flashkda"): "flashkda_fwd",
    ("kda.prefill", "triton"): "chunk_kda_with_fused_gate",
    ("kda.prefill", "flashinfer"): "flashinfer_recurrent_kda",
    ("kda.decode", "native"): "fused_kda_decode",
    ("kda.decode", "triton"): "fused_recurrent_kda_packed_decode",
    ("kda.decode", "flashinfer"): "flashinfer_fused_kda_decode",
    ("kda.decode", True): "fused_kda_decode",  # pre-0.30: the fused decode check said yes
    ("kda.decode", False): "fused_recurrent_kda_packed_decode",
    ("kda.spec_verify", "native"): "fused_recurrent_kda",
    ("kda.spec_verify", "flashinfer"): "flashinfer_packed_fused_kda_decode",
}
#: labels the perf database has no entry for, with the family their kernels belong to
OWN_FAMILIES = {
    "flashinfer_recurrent_kda": "flashinfer",
    "flashinfer_fused_kda_decode": "flashinfer",
    "flashinfer_packed_fused_kda_decode": "flashinfer",
}
#: attention backend class -> family
ATTN_FAMILY = {
    "FlashInferMLABackend": "flashinfer", "FlashAttnMLABackend": "flash_attn", "FlashMLABackend": "flashmla",
    "TritonMLABackend": "triton", "CutlassMLABackend": "cutlass", "TokenspeedMLABackend": "tokenspeed",
    "FlashAttnPrefillBackend": "flash_attn", "FlashInferPrefillBackend": "flashinfer",
    "TrtllmRaggedPrefillBackend": "flashinfer_trtllm_gen", "TokenspeedMLAPrefillBackend": "tokenspeed",
    # vLLM's standard (non-MLA) attention backends
    "FlashAttentionBackend": "flash_attn", "TritonAttentionBackend": "triton", "FlashInferBackend": "flashinfer",
    "FlexAttentionBackend": "flex_attention", "TreeAttentionBackend": "tree_attn",
}


def derive(lane: str, group: dict, label_map: dict[str, str]) -> tuple[str, str, str]:
    """(label, family, how) for one lane group; how says where the family came from."""
    raw = group.get("raw") or {}
    fields = raw.get("fields") or []
    source = raw.get("source", "")
    if source == "specialized_decode":  # a step K3's specialized decode takes: its own CuTe DSL kernels serve it
        part = short(fields[0]).lower() if fields else lane.split(".", 1)[0]
        return f"vllm_specialized_decode_{part}", "specialized_decode", "K3's specialized decode serves this step"
    if lane == "moe":
        if source == "moe.mega_moe_experts":
            return "vllm_megamoe_" + short(fields[0]).lower(), "deepgemm", "MegaMoE experts (DeepGEMM fp8_fp4_mega_moe)"
        if len(fields) < 3 or not all(fields[:3]):
            return "unknown", "unknown", "no quant method evidence"
        backend, experts, qm = (short(f) for f in fields[:3])
        method = qm[:-len("Method")] if qm.endswith("Method") else qm
        label = f"vllm_{method}_{backend}_{experts}".lower()
        if label in label_map:
            return label, label_map[label], "label map"
        family = next((fam for prefix, fam in MOE_FAMILY if backend.startswith(prefix)), "unknown")
        return label, family, "backend -> family table"
    if lane.startswith("kda."):
        if not fields:
            return "unknown", "unknown", "no evidence"
        label = KDA_LABEL.get((lane, fields[0]), "unknown")
        family = label_map.get(label) or OWN_FAMILIES.get(label, "unknown")
        return label, family, "label map" if label in label_map else "backend -> family table"
    if lane.startswith(("mla.", "attention.")):  # an attention lane's value is the backend class vLLM chose
        cls = short(fields[0]) if fields else ""
        return cls.lower() or "unknown", ATTN_FAMILY.get(cls, "unknown"), "attention class -> family table"
    return "unknown", "unknown", "lane has no vocabulary"
