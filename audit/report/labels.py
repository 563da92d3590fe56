"""Perf-database vocabulary derived from evidence: a kernel_source label and a backend family per
lane group. Mappings are data (facts from docs/notes/labels-and-kernels.md), not guesses made at
run time; a value the tables do not know gives label/family "unknown", never an invented one.

The tables here are vLLM's attention backends; the experts' backend families are the profile's quantization
schemes' (``probes/schemes``); what a model brings (the kernels its
backend-string lanes enter, a path of its own that serves some steps) is its profile's
(``Profile.backend_labels``, ``Profile.step_path``)."""
from __future__ import annotations

from audit.profiles import MOE_LANE, Profile
from audit.report.dispatch import STEP_PATH_SOURCE
from audit.report.routing import short

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


def derive(profile: Profile, lane: str, group: dict, label_map: dict[str, str]) -> tuple[str, str, str]:
    """(label, family, how) for one lane group of *profile*'s model; how says where the family came from."""
    raw = group.get("raw") or {}
    fields = raw.get("fields") or []
    source = raw.get("source", "")
    path = profile.step_path
    if source == STEP_PATH_SOURCE and path is not None:  # a step the model's own path takes: its kernels serve it
        part = short(fields[0]).lower() if fields else lane.split(".", 1)[0]
        return f"vllm_{path.family}_{part}", path.family, f"{path.owner} serves this step"
    backend = profile.backend_labels
    if backend is not None and lane in backend.kernels:  # the lane's value is a backend string the profile maps
        if not fields:
            return "unknown", "unknown", "no evidence"
        label = backend.kernels[lane].get(fields[0], "unknown")
        family = label_map.get(label) or backend.families.get(label, "unknown")
        return label, family, "label map" if label in label_map else "backend -> family table"
    if lane == MOE_LANE:
        for scheme in profile.scheme_parts():  # experts recorded by class, not through the oracle
            if source in scheme.experts_labels and fields:
                prefix, family, how = scheme.experts_labels[source]
                return prefix + short(fields[0]).lower(), family, how
        if len(fields) < 3 or not all(fields[:3]):
            return "unknown", "unknown", "no quant method evidence"
        backend, experts, qm = (short(f) for f in fields[:3])
        method = qm[:-len("Method")] if qm.endswith("Method") else qm
        label = f"vllm_{method}_{backend}_{experts}".lower()
        if label in label_map:
            return label, label_map[label], "label map"
        family = profile.moe_family(backend)
        return label, family, "backend -> family table"
    if lane.startswith(("mla.", "attention.")):  # an attention lane's value is the backend class vLLM chose
        cls = short(fields[0]) if fields else ""
        return cls.lower() or "unknown", ATTN_FAMILY.get(cls, "unknown"), "attention class -> family table"
    return "unknown", "unknown", "lane has no vocabulary"

