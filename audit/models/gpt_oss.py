"""gpt-oss-120b: everything the host knows about this model, in one place.

OpenAI's open-weight MoE model: 36 decoder layers alternating sliding-window (128 tokens) and full attention,
both with learned attention sinks; 128 routed experts per layer (top 4) with MXFP4 weights, chosen through
vLLM's MXFP4 MoE oracle (the same one K3's experts go through) and vLLM's own gpt-oss quant method; a SwiGLU
with a clamp (vLLM's ``swigluoai`` activation). Its config is the published one, shipped as package data.

Its probe-side module is ``probes/models/gpt_oss`` (named in the plan): vLLM's attention layer as a scope, so each
backend choice is attributed to its layer, and vLLM's gpt-oss MXFP4 quant method.
"""
from __future__ import annotations

from audit.profiles import JudgedLane, Lane, Profile, Source
from audit.systems import Layout

LAYOUTS: dict[str, Layout] = {l.name: l for l in (
    Layout("tp1", "single GPU", ("--tensor-parallel-size", "1"), 1),
    Layout("tp8", "single-node TP8", ("--tensor-parallel-size", "8"), 8),
    Layout("dp8-ep", "DP8 + EP8, default MoE backend (plain expert parallel)",
           ("--data-parallel-size", "8", "--enable-expert-parallel"), 8),
)}

_ATTENTION = Source("construct", "scope.attention", ("attrs.attn_backend",))
_EXPERTS = ("attrs.mxfp4_backend", "attrs.experts_cls")

GPT_OSS_120B = Profile(
    name="gpt-oss-120b",
    title="gpt-oss-120b",
    architecture="GptOssForCausalLM",
    config_package_path="gpt-oss-120b/config.json",
    warm_imports=(
        "vllm.config",
        "vllm.engine.arg_utils",
        "vllm.model_executor.model_loader",
        "vllm.model_executor.models.gpt_oss",
    ),
    layer_classes={"Attention": "attention", "GptOssRoutedExperts": "moe"},
    probes="gpt_oss",
    lanes=(
        Lane("moe", "Routed experts", "moe", "all", (
            Source("construct", "moe.gpt_oss_quant_method", _EXPERTS, extra=("cls",)),
            Source("construct", "moe.quant_method", _EXPERTS, extra=("cls",)),
        ), candidates_target="moe.candidate"),
        Lane("attention.prefill", "Attention with sinks (prefill)", "attention", "prefill", (_ATTENTION,)),
        Lane("attention.decode", "Attention with sinks (decode)", "attention", "decode", (_ATTENTION,)),
        Lane("moe.kernel", "MoE kernel built at load", "moe", "all", (Source("postload", "moe_kernel", ()),),
             level="post-load"),
        Lane("moe.activation", "Experts activation (SwiGLU-OAI check)", "moe", "all",
             (Source("postload", "activation", ()),), level="post-load"),
    ),
    layouts=LAYOUTS,
    schemes=("mxfp4",),
    judged=(
        JudgedLane("moe", "moe", None, "prefill+decode", ("decode", "prefill", "verify")),
        JudgedLane("attention.prefill", "attention", "attention.context", "prefill", ("prefill",)),
        JudgedLane("attention.decode", "attention", "attention.generation", "decode", ("decode",)),
    ),
    perf_lanes={
        "attention.context": "attention.prefill",
        "attention.generation": "attention.decode",
    },
    perf_lane_phases={"attention.context": ("prefill",), "attention.generation": ("decode",)},
    kind_titles={"attention": "attention", "moe": "MoE"},
    ledger_notes={
        "glossary": (
            ("W4A16 / W4A8", "4-bit (MXFP4) expert weights with 16-bit activations / with 8-bit (MXFP8) activations"),
            ("sinks", "gpt-oss's learned attention sinks (one logit per head); an attention backend that does not "
                      "support them cannot serve its layers"),
            ("sliding / full", "gpt-oss alternates sliding-window attention (128 tokens; even layers) and full "
                               "attention (odd layers)"),
            ("SWIGLUOAI", "gpt-oss's clamped SwiGLU in its experts (vLLM's `swigluoai` activation)"),
        ),
        "layer_numbers": "Layer numbers are vLLM's 0-based module indices (`model.layers.N`).",
        "candidates_of": "attention layers",
    },
)
