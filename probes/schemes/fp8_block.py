"""FP8 experts with block scales (E4M3 weights, one scale per 128x128 block; activations quantized per token in
groups of 128 at run time, ``activation_scheme = "dynamic"``): vLLM's FP8 MoE quant method and oracle, and the perf
database's lanes for them, named by the activation precision (W8A8 block FP8; W8A16 where Marlin serves FP8
weights with BF16 activations). Standard library only."""
from __future__ import annotations

from probes.core.targets import Kernel, Target
from probes.observe import kernel_names as _names
from probes.observe.kernel_names import KernelName
from probes.schemes import TRTLLM_AUTOTUNED

TITLE = "FP8 block (128x128)"
_MOE = "vllm.model_executor.layers.fused_moe."

TARGETS: tuple[Target, ...] = (
    Target("moe.quant_method", "construct", ("vllm.model_executor.layers.quantization.fp8:Fp8MoEMethod.__init__",),
           title="MoE quant method"),
    Target("moe.oracle.fp8", "select", (_MOE + "oracle.fp8:select_fp8_moe_backend",),
           title="FP8 MoE oracle"),
    Target("moe.candidates", "candidates", (_MOE + "oracle.fp8:backend_to_kernel_cls",),
           args=("backend",), title="MoE backend candidates"),
)

DEVICE_EXPERTS = {
    "TrtLlmFp8ExpertsMonolithic": TRTLLM_AUTOTUNED,
    "TrtLlmFp8ExpertsModular": TRTLLM_AUTOTUNED,
}

#: Fp8MoeBackend member prefix -> backend family
FAMILIES = (
    ("FLASHINFER_TRTLLM", "flashinfer_trtllm_gen"),
    ("FLASHINFER_CUTLASS", "cutlass"),
    ("BATCHED_DEEPGEMM", "deepgemm"),
    ("DEEPGEMM", "deepgemm"),
    ("MARLIN", "marlin"),
    ("HUMMING", "humming"),
    ("BATCHED_TRITON", "triton"),
    ("TRITON", "triton"),
    ("BATCHED_VLLM_CUTLASS", "cutlass"),
    ("VLLM_CUTLASS", "cutlass"),
    ("AITER", "aiter"),
)

PRECISION_LANES = {"w8a8_fp8_block": "FP8 activations, per-token groups of 128 (W8A8 block FP8)",
                   "w8a16_fp8": "BF16 activations, FP8 weights (W8A16)"}
#: facts from vLLM's source: Marlin runs FP8 weights with 16-bit activations; the other CUDA backends take the
#: block-quantized FP8 activations the quant method's activation key asks for
PRECISION_RULES = (
    (r":(?:BATCHED_)?MARLIN$", "w8a16_fp8"),
    (r":(?:FLASHINFER_TRTLLM|FLASHINFER_CUTLASS|(?:BATCHED_)?DEEPGEMM|(?:BATCHED_)?TRITON|(?:BATCHED_)?VLLM_CUTLASS)$",
     "w8a8_fp8_block"),
)

#: observe mode: the experts entries of block FP8's own backends (DeepGEMM's TritonOrDeepGemmExperts, Triton, FlashInfer
#: CUTLASS and Marlin run through the shared entries)
KERNELS: tuple[Kernel, ...] = tuple(
    Kernel("moe", name, _MOE + "experts.trtllm_fp8_moe:" + spec) for name, spec in (
        ("TRT-LLM FP8 (monolithic)", "TrtLlmFp8ExpertsMonolithic.apply"),
        ("TRT-LLM FP8 (modular)", "TrtLlmFp8ExpertsModular.apply"),
    ))

_TRTLLM = ("TRT-LLM FP8 (monolithic)", "TRT-LLM FP8 (modular)")
#: the GPU kernels those entries launch: TRT-LLM-gen's batched GEMM cubins (FP8 inputs; a pattern from the cubins'
#: dtype naming, not yet checked against a trace) and the routing/finalize kernels every TRT-LLM-gen MoE launches
KERNEL_NAMES: tuple[KernelName, ...] = tuple(
    entry for p in _TRTLLM for entry in (
        KernelName(p, r"bmm_\w*(?<!Mx)E4m3(?!\w*MxE2m1)",
                   "runtime-download:FlashInfer trtllm-gen batched-GEMM cubins (TRTLLM_GEN_BMM)",
                   shares=tuple(o for o in _TRTLLM if o != p)),
        KernelName(p, _names.TRTLLM_MOE_DEV[0], _names.TRTLLM_MOE_DEV[1], shares=tuple(o for o in _TRTLLM if o != p),
                   look_for=_names.TRTLLM_MOE_DEV[2]),
    ))
