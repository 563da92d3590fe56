"""MXFP4 experts (4-bit E2M1 weights, E8M0 scales per 32): vLLM's MXFP4 MoE quant method and oracle, the DeepGEMM
MegaMoE experts (FP8 activations x FP4 weights), and the perf database's lanes for them, named by the activation
precision (W4A16: BF16 activations; W4A8: MXFP8 activations). Standard library only."""
from __future__ import annotations

from probes.core.targets import Target

TITLE = "MXFP4"
_MOE = "vllm.model_executor.layers.fused_moe."

TARGETS: tuple[Target, ...] = (
    Target("moe.quant_method", "construct",
           ("vllm.model_executor.layers.quantization.mxfp4:Mxfp4MoEMethod.__init__",),
           title="MoE quant method"),
    Target("moe.oracle.deepseek_v4", "select",
           (_MOE + "oracle.mxfp4:select_deepseek_v4_mxfp4_moe_backend",), title="MXFP4 MoE oracle (DeepSeek-V4 style)"),
    Target("moe.oracle.mxfp4", "select", (_MOE + "oracle.mxfp4:select_mxfp4_moe_backend",),
           title="MXFP4 MoE oracle (gpt-oss style)", required=False),
    Target("moe.candidates", "candidates", (_MOE + "oracle.mxfp4:backend_to_kernel_cls",),
           args=("backend",), title="MoE backend candidates (auto)"),
    Target("moe.requested", "candidates", (_MOE + "oracle.mxfp4:_requested_kernel_cls@0.33<=v",),
           args=("backend",), title="MoE backend candidates (--moe-backend)", required=False),
    Target("moe.mega_moe_experts", "construct", (_MOE + "deep_gemm_mega_moe:DeepGemmMegaMoEExperts.__init__@0.33<=v",),
           title="DeepGEMM MegaMoE experts"),
)

_MEGA = "BLOCK_M from DeepGEMM's MegaMoE scheduler, sized by a symmetric buffer allocated on the device"
_TRTLLM = "FlashInfer's AutoTuner picks the TRTLLM-Gen tactic"
DEVICE_EXPERTS = {
    "TrtLlmMxfp4ExpertsMonolithic": _TRTLLM,
    "TrtLlmMxfp4ExpertsModular": _TRTLLM,
    "DeepGemmFP4Experts": "DeepGEMM's runtime picks the grouped GEMM's configuration per call",
    "DeepGemmMegaMoEExperts": _MEGA,
}
EXPERTS_MODULES = ("DeepGemmMegaMoEExperts",)

#: Mxfp4MoeBackend member prefix -> backend family
FAMILIES = (
    ("FLASHINFER_TRTLLM", "flashinfer_trtllm_gen"),
    ("FLASHINFER_CUTLASS", "cutlass"),
    ("BATCHED_MARLIN", "marlin"),
    ("MARLIN", "marlin"),
    ("DEEPGEMM", "deepgemm"),
    ("HUMMING", "humming"),
    ("TRITON", "triton"),
    ("CUTLASS", "cutlass"),
)

PRECISION_LANES = {"w4a16_mxfp4": "BF16 activations (W4A16)", "w4a8_mxfp4_mxfp8": "MXFP8 activations (W4A8)"}
#: the member's own suffix where it has one (``..._MXFP8``, ``..._BF16``), else facts from vLLM's source: Marlin is
#: weight-only; DeepGEMM FP4 experts and MegaMoE quantize activations to FP8
PRECISION_RULES = (
    (r"^moe\.mega_moe_experts:", "w4a8_mxfp4_mxfp8"),
    (r":\w*_MXFP8$", "w4a8_mxfp4_mxfp8"),
    (r":(?:\w*_BF16|MARLIN|BATCHED_MARLIN)$", "w4a16_mxfp4"),
    (r":DEEPGEMM_MXFP4$", "w4a8_mxfp4_mxfp8"),
)

EXPERTS_LABELS = {"moe.mega_moe_experts": ("vllm_megamoe_", "deepgemm", "MegaMoE experts (DeepGEMM fp8_fp4_mega_moe)")}
