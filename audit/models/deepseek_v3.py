"""DeepSeek-V3: everything the host knows about this model, in one place.

DeepSeek's 671B MoE (the architecture of DeepSeek-V3/R1 and Kimi-K2): 61 decoder layers, all multi-head latent
attention (MLA: 128 heads, a 512-wide latent KV, 64 rope dimensions); the first 3 layers dense, the other 58 MoE
with 256 routed experts (top 8, sigmoid scores grouped 8/4) and one shared expert. Weights are FP8 (E4M3) with one
scale per 128x128 block; activations are quantized to FP8 per token in groups of 128 at run time. Its experts go
through vLLM's FP8 MoE oracle (the ``fp8_block`` scheme), its attention through vLLM's shared MLA layer.

Its config is the published one (``audit/data/deepseek-v3/README.md`` says where from), shipped as package data;
its probe-side module is ``probes/models/deepseek_v3``.
"""
from __future__ import annotations

from audit.profiles import JudgedLane, Lane, Profile, Source
from audit.systems import Layout

LAYOUTS: dict[str, Layout] = {l.name: l for l in (
    Layout("tp8", "single-node TP8", ("--tensor-parallel-size", "8"), 8),
    Layout("dp8-ep", "DP8 + EP8, default MoE backend (plain expert parallel)",
           ("--data-parallel-size", "8", "--enable-expert-parallel"), 8),
    Layout("tp16", "two-node TP16", ("--tensor-parallel-size", "16"), 16),
)}

_MLA = "scope.mla"

DEEPSEEK_V3 = Profile(
    name="deepseek-v3",
    title="DeepSeek-V3",
    architecture="DeepseekV3ForCausalLM",
    config_package_path="deepseek-v3/config.json",
    warm_imports=(
        "vllm.config",
        "vllm.engine.arg_utils",
        "vllm.model_executor.model_loader",
        "vllm.model_executor.models.deepseek_v2",
    ),
    probes="deepseek_v3",
    schemes=("fp8_block",),
    layer_classes={"MLAAttention": "mla", "DeepseekV2MoE": "moe", "DeepseekV2MLP@mlp": "dense"},
    lanes=(
        Lane("moe", "Routed experts (FP8 block)", "moe", "all", (
            Source("construct", "moe.quant_method", ("attrs.fp8_backend", "attrs.experts_cls"), extra=("cls",)),
        ), candidates_target="moe.candidate"),
        Lane("mla.decode", "MLA attention (decode)", "mla", "decode", (
            Source("construct", _MLA, ("attrs.attn_backend", "attrs.impl")),
        )),
        Lane("mla.prefill", "MLA prefill", "mla", "prefill", (
            Source("construct", _MLA, ("attrs.prefill_backend",)),
        )),
        Lane("dense", "Dense MLP linears", "dense", "all", (
            Source("module", r"\.mlp\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),
        )),
        Lane("shared", "Shared-expert linears", "moe", "all", (
            Source("module", r"\.shared_experts\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),
        )),
        Lane("moe.kernel", "MoE kernel built at load", "moe", "all", (Source("postload", "moe_kernel", ()),),
             level="post-load"),
        Lane("moe.activation", "Experts activation (SiLU check)", "moe", "all",
             (Source("postload", "activation", ()),), level="post-load"),
    ),
    layouts=LAYOUTS,
    judged=(
        JudgedLane("moe", "moe", None, "prefill+decode", ("decode", "prefill", "verify")),
        JudgedLane("mla.decode", "mla", "mla.decode", "decode", ("decode", "verify")),
        JudgedLane("mla.prefill", "mla", "mla.prefill", "prefill", ("prefill",)),
    ),
    perf_lanes={"mla.decode": "mla.decode", "mla.prefill": "mla.prefill"},
    kind_titles={"mla": "MLA", "moe": "MoE", "dense": "dense MLP"},
    ledger_notes={
        "glossary": (
            ("W8A8 block FP8", "FP8 (E4M3) expert weights with a scale per 128x128 block, activations quantized to FP8 "
                               "per token in groups of 128 at run time"),
            ("W8A16", "FP8 expert weights with 16-bit activations (Marlin)"),
            ("MLA", "multi-head latent attention: a 512-wide compressed KV shared by all heads, plus 64 rope "
                    "dimensions"),
        ),
        "layer_numbers": "Layer numbers are vLLM's 0-based module indices (`model.layers.N`); layers 0-2 are dense, "
                         "3-60 MoE.",
        "candidates_of": "MLA layers",
    },
)
