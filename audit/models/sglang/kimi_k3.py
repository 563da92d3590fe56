"""Kimi-K3 on SGLang: its serving layouts in SGLang's flags, the layer classes SGLang builds, and the lanes the ledger
reports, each read from a record of SGLang's own answer (``probes/engines/sglang/cell.py``).

Where a lane is a choice of SGLang's model runner rather than of a layer (the attention backends), the value is the
runner's, recorded on every layer of the kind SGLang built; where the layer holds it (the experts' quantization
method and MoE runner), it is read off each built layer.
"""
from __future__ import annotations

from audit.profiles import BackendLabels, JudgedLane, Lane, Profile, Source
from audit.systems import Layout

#: K3's MegaMoE on SGLang: DeepGEMM MegaMoE is an all-to-all backend (it forces the expert-parallel size to the TP
#: size), not a runner name
LAYOUTS: dict[str, Layout] = {l.name: l for l in (
    Layout("tp8", "single-node TP8", ("--tp", "8"), 8),
    Layout("tp16", "two-node TP16 (rank 0 of node 0)", ("--tp", "16", "--nnodes", "2", "--node-rank", "0",
                                                       "--dist-init-addr", "127.0.0.1:5000"), 16),
    Layout("dep8", "DP-attention 8 + EP8 with DeepGEMM MegaMoE (--moe-a2a-backend megamoe)",
           ("--tp", "8", "--dp-size", "8", "--enable-dp-attention", "--moe-a2a-backend", "megamoe"), 8),
    Layout("dp8-ep", "DP-attention 8 + EP8, no all-to-all backend (--ep-size 8)",
           ("--tp", "8", "--dp-size", "8", "--enable-dp-attention", "--ep-size", "8"), 8),
    Layout("tp8-fp8kv", "single-node TP8, fp8 KV cache (--kv-cache-dtype fp8_e4m3)",
           ("--tp", "8", "--kv-cache-dtype", "fp8_e4m3"), 8, opt_in=True),
    Layout("tp8-dspark", "single-node TP8 + DSpark speculative decoding (--speculative-algorithm DSPARK)",
           ("--tp", "8", "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", "<model>/draft"), 8,
           opt_in=True, draft_config="kimi-k3/drafts/dspark-sglang/config.json",
           note="No DSpark draft for K3 is published: the draft's config.json was written for this harness from what "
                "SGLang's DSpark parser requires (audit/data/kimi-k3/drafts/dspark-sglang/README.md says each value's "
                "source). The target is built and judged with SGLang's DSpark settings; the draft (SGLang's "
                "DSparkDraftModel) is built on the meta device as SGLang's draft worker builds it, and its attention "
                "backend is read from SGLang's draft runner resolution."),
    Layout("tp8-eagle3", "single-node TP8 + EAGLE3 speculative decoding (a Llama-style EAGLE3 draft)",
           ("--tp", "8", "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "<model>/draft"), 8,
           opt_in=True, draft_config="kimi-k3/drafts/eagle3/config.json",
           note="No EAGLE3 draft for K3 is published: the draft's config.json (LlamaForCausalLMEagle3, a class SGLang "
                "serves too) was written for this harness (audit/data/kimi-k3/drafts/eagle3/README.md). The target is "
                "built and judged; the draft is built on the meta device as SGLang's draft worker builds it, and its "
                "attention backend is read from SGLang's draft runner resolution."),
    # SGLang-only options that change the experts' kernel
    Layout("tp8-fimxfp4", "single-node TP8, FlashInfer MXFP4 experts asked for (--moe-runner-backend flashinfer_mxfp4)",
           ("--tp", "8", "--moe-runner-backend", "flashinfer_mxfp4"), 8, opt_in=True,
           note="SGLang's own default picks this runner on SM 10.x only; asked for, it serves SM 9.0 and 12.0 with "
                "FlashInfer's CUTLASS MXFP4 kernels too."),
    Layout("tp8-marlin", "single-node TP8, Marlin experts asked for (--moe-runner-backend marlin)",
           ("--tp", "8", "--moe-runner-backend", "marlin"), 8, opt_in=True),
)}

KIMI_K3 = Profile(
    name="kimi-k3",
    title="Kimi-K3",
    architecture="KimiK3ForConditionalGeneration",
    config_package_path="kimi-k3/config.json",
    warm_imports=(),
    engine="sglang",
    layer_classes={
        "KimiK3DeltaAttention": "kda",
        "KimiK3MLAAttention": "mla",
        "KimiK3MoE": "moe",
        "KimiK3MLP@mlp": "dense",
        # K3 builds none of these itself: a speculative draft's blocks (DSpark's DFlash stack, EAGLE3's Llama layer)
        "DFlashAttention": "attention",
        "LlamaAttention": "attention",
        "DFlashMLP@mlp": "dense",
        "LlamaMLP@mlp": "dense",
    },
    layouts=LAYOUTS,
    lanes=(
        Lane("moe", "Routed experts", "moe", "all", (
            # the MoE block's forward takes MegaMoE in place of its experts module where it decided so
            Source("construct", "moe.block", ("attrs.mega_experts",), label="MegaMoE"),
            Source("construct", "moe.flashinfer", ("attrs.fi_kernel", "attrs.runner")),
            Source("construct", "moe.experts", ("attrs.runner",),
                   extra=("attrs.quant_method", "attrs.experts_cls", "attrs.moe_a2a_backend", "attrs.use_mega_moe")),)),
        Lane("kda.prefill", "KDA prefill", "kda", "prefill", (Source("construct", "kda.backends", ("attrs.prefill",)),)),
        Lane("kda.decode", "KDA decode", "kda", "decode", (Source("construct", "kda.backends", ("attrs.decode",)),)),
        Lane("kda.spec_verify", "KDA spec-verify", "kda", "spec-verify",
             (Source("construct", "kda.backends", ("attrs.verify",)),),
             exercised_if=("attrs.speculative_algorithm", "no speculative decoding in this layout")),
        Lane("mla.decode", "MLA attention (decode)", "mla", "decode",
             (Source("construct", "mla.backends", ("attrs.decode",)),)),
        Lane("mla.prefill", "MLA prefill", "mla", "prefill", (Source("construct", "mla.backends", ("attrs.prefill",)),)),
        Lane("mla.spec_verify", "MLA spec-verify", "mla", "spec-verify",
             (Source("construct", "mla.backends", ("attrs.verify", "attrs.verify_mode")),),
             exercised_if=("attrs.speculative_algorithm", "no speculative decoding in this layout")),
        # a draft runner's own backend serves every draft phase where SGLang overrides it; otherwise the process's
        # (prefill, decode) pair
        Lane("attention", "Draft attention (a speculative draft's own layers)", "attention", "all",
             (Source("construct", "draft.attention", ("attrs.prefill", "attrs.decode"),
                     extra=("attrs.draft_override", "attrs.worker_backend")),)),
        Lane("dense", "Dense MLP linears", "dense", "all", (
            Source("module", r"\.mlp\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),)),
        Lane("shared", "Shared-expert linears", "moe", "all", (
            Source("module", r"\.shared_experts\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),)),
    ),
    kind_titles={"kda": "KDA", "mla": "MLA", "moe": "MoE", "dense": "dense MLP",
                 "attention": "plain attention (a speculative draft's)"},
    # the perf database's SGLang rows for K3 label the routed experts by their W4A8 lane (MXFP8 activations): the
    # FlashInfer trtllm-gen kernels and the MegaMoE module; KDA and MLA are not judged on SGLang yet (their kernels
    # have no vocabulary here)
    judged=(JudgedLane("moe", "moe", "w4a8_mxfp4_mxfp8", "prefill+decode", ("decode", "prefill", "verify")),),
    perf_lanes={"w4a8_mxfp4_mxfp8": "moe"},
    # derived labels (this harness's) for what the experts run with, by the first field of the lane's record: the
    # FlashInfer entry Mxfp4MoEMethod picked, the MoE runner SGLang built, or the MoE block's MegaMoE forward; each
    # family from SGLang's source (FlashInfer's trtllm_sm100 entry is trtllm-gen's fused MoE; its SM90/SM120 entries
    # are FlashInfer's CUTLASS fused MoE; MegaMoE calls DeepGEMM's fp8_fp4_mega_moe)
    backend_labels=BackendLabels(
        term="experts value",
        kernels={"moe": {
            "trtllm_sm100": "sglang_mxfp4_flashinfer_trtllm_sm100",
            "cutlass_sm90": "sglang_mxfp4_flashinfer_cutlass_sm90",
            "cutlass_sm120": "sglang_mxfp4_flashinfer_cutlass_sm120",
            "MoeRunnerBackend.TRITON": "sglang_mxfp4_triton",
            "MoeRunnerBackend.TRITON_KERNELS": "sglang_mxfp4_triton_kernels",
            "MoeRunnerBackend.MARLIN": "sglang_mxfp4_marlin",
            "MoeRunnerBackend.DEEP_GEMM": "sglang_mxfp4_deep_gemm",
            "KimiK3MoE._forward_mega_experts": "deepgemm_megamoe",
        }},
        families={"sglang_mxfp4_flashinfer_trtllm_sm100": "flashinfer_trtllm_gen",
                  "sglang_mxfp4_flashinfer_cutlass_sm90": "cutlass", "sglang_mxfp4_flashinfer_cutlass_sm120": "cutlass",
                  "sglang_mxfp4_triton": "triton", "sglang_mxfp4_triton_kernels": "triton",
                  "sglang_mxfp4_marlin": "marlin", "sglang_mxfp4_deep_gemm": "deepgemm",
                  "deepgemm_megamoe": "deepgemm"},
        values_are_kernels=False,
    ),
    ledger_notes={
        "glossary": (
            ("SiTU", "Kimi-K3's gated activation in its experts; a kernel that does not whitelist it cannot serve them"),
            ("KDA / MLA", "K3's two attention kinds: Kimi Delta Attention (linear, recurrent state) and multi-head "
                          "latent attention"),
            ("runner", "SGLang's MoE runner (`MoeRunnerBackend`) and, for FlashInfer MXFP4, the FlashInfer kernel "
                       "family its quantization method picked (`_fi_kernel`)"),
        ),
        "layer_numbers": "Layer numbers are SGLang's 0-based module indices (`language_model.model.layers.N`).",
        "candidates_of": "MLA layers",
    },
)
