"""MXFP4 experts (4-bit E2M1 weights, E8M0 scales per 32): vLLM's MXFP4 MoE quant method and oracle, the DeepGEMM
MegaMoE experts (FP8 activations x FP4 weights), and the perf database's lanes for them, named by the activation
precision (W4A16: BF16 activations; W4A8: MXFP8 activations). Standard library only."""
from __future__ import annotations

from probes.core.targets import Kernel, Target
from probes.observe import kernel_names as _names
from probes.observe.kernel_names import KernelName
from probes.schemes import TRTLLM_AUTOTUNED

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
DEVICE_EXPERTS = {
    "TrtLlmMxfp4ExpertsMonolithic": TRTLLM_AUTOTUNED,
    "TrtLlmMxfp4ExpertsModular": TRTLLM_AUTOTUNED,
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
EXPERTS_SOURCES = {"DeepGemmMegaMoEExperts": "moe.mega_moe_experts"}

_EXPERTS = _MOE + "experts."
#: observe mode: the experts entries of MXFP4's own backends (those several schemes share are the shared entries)
KERNELS: tuple[Kernel, ...] = (
    *(Kernel("moe", name, _EXPERTS + spec) for name, spec in (
        ("TRT-LLM MXFP4 (monolithic)", "trtllm_mxfp4_moe:TrtLlmMxfp4ExpertsMonolithic.apply"),
        ("TRT-LLM MXFP4 (modular)", "trtllm_mxfp4_moe:TrtLlmMxfp4ExpertsModular.apply"),
        ("DeepGEMM FP4", "deep_gemm_moe:DeepGemmFP4Experts.apply"),
        ("CUTLASS MXFP4", "cutlass_moe:CutlassExpertsMxfp4.apply"),
        ("OAI Triton MXFP4 (monolithic)", "gpt_oss_triton_kernels_moe:OAITritonMxfp4ExpertsMonolithic.apply"),
        ("OAI Triton", "gpt_oss_triton_kernels_moe:OAITritonExperts.apply"),
        ("OAI Triton (unfused)", "gpt_oss_triton_kernels_moe:UnfusedOAITritonExperts.apply"),
    )),
    Kernel("moe", "B12x", _MOE + "b12x:B12xExperts.apply"),
    Kernel("moe", "DeepGEMM MegaMoE", _MOE + "deep_gemm_mega_moe:DeepGemmMegaMoEExperts.forward",
           layer_attr="layer_id", backend="DeepGemmMegaMoEExperts"),
)

_TRTLLM_MOE = ("TRT-LLM MXFP4 (monolithic)", "TRT-LLM MXFP4 (modular)")
_OAI = ("OAI Triton MXFP4 (monolithic)", "OAI Triton", "OAI Triton (unfused)")
_OAI_MOD = "vllm.model_executor.layers.fused_moe.experts.gpt_oss_triton_kernels_moe"


def _others(group, me):
    return tuple(p for p in group if p != me)


#: the GPU kernels those entries launch (vLLM 0.33.0, docs/notes/kernel-names-0.33.md)
KERNEL_NAMES: tuple[KernelName, ...] = (
    *(KernelName(p, r"bmm_\w*MxE2m1", "runtime-download:FlashInfer trtllm-gen batched-GEMM cubins (TRTLLM_GEN_BMM)",
                 shares=_others(_TRTLLM_MOE, p)) for p in _TRTLLM_MOE),
    *(KernelName(p, _names.TRTLLM_MOE_DEV[0], _names.TRTLLM_MOE_DEV[1], shares=_others(_TRTLLM_MOE, p), look_for=_names.TRTLLM_MOE_DEV[2])
      for p in _TRTLLM_MOE),
    KernelName("DeepGEMM MegaMoE", r"sm100_fp8_fp4_mega_moe(?:_situ)?_impl", _names.DG_IMPLS),
    KernelName("DeepGEMM FP4", r"sm100_fp8_fp4_gemm_1d1d_impl|sm120_fp8_fp4_gemm_1d1d_impl", _names.DG_IMPLS,
               shares=("DeepGEMM (batched)", "Triton or DeepGEMM / CUTLASS fallback"),
               note="SM100 and SM120 families"),
    KernelName("B12x", r"kernel_cutlass_kernel_b12xmoe_sharedkernels",
               "jit-source:flashinfer/experimental/b12x/moe/_shared/kernels",
               look_for=r"class (?:MoEDynamicKernelSitu|W4A16FusedMoeKernel|W4A16TopKSumKernel)\b",
               note="CuTe DSL, SM120/121 only, --moe-backend b12x"),
    KernelName("CUTLASS MXFP4", r"MainloopSm100ArrayTmaUmmaWarpSpecializedBlockScaled.*float_e2m1_t(?:, cutlass::|ENS_13)"
               r"float_ue8m0_t.*SM100_MMA_MXF4_SS|mxfp4_cvt_fp16_to_fp4|__mxfp4_get_group_gemm_starts", _names.VLLM_C,
               note="no --moe-backend maps to it in 0.33"),
    *(KernelName(p, r"^_(?:p_)?matmul_ogs_[NT]{3}_", "triton:vllm.third_party.triton_kernels.matmul_ogs_details",
                 look_for=r"^_(?:p_)?matmul_ogs$", shares=_others(_OAI, p),
                 note="triton_kernels names its specialisations (layout, dtypes, tile, fused activation)") for p in _OAI),
    KernelName("OAI Triton MXFP4 (monolithic)", r"^_topk_forward$", "triton:vllm.third_party.triton_kernels.topk_details"),
    KernelName("OAI Triton", r"^pack_bitmatrix$", "triton:" + _OAI_MOD, shares=("OAI Triton (unfused)",)),
    KernelName("OAI Triton (unfused)", r"^pack_bitmatrix$", "triton:" + _OAI_MOD, shares=("OAI Triton",)),
    KernelName("OAI Triton (unfused)", r"^_masked_topk_sum_kernel$", "triton:" + _OAI_MOD),
)
