"""Kimi-K3's probes, as data: its layer scopes and selectors (KDA, MLA, its MoE block, the MTP draft layer), the
observe-mode kernel entries and scopes of its KDA and MLA, and its MegaMoE experts class of releases before 0.33.

Standard library only; the resolve-side readings and dispatch lanes are in :mod:`probes.models.kimi_k3.resolve`.
"""
from __future__ import annotations

from probes.core.targets import Kernel, Scope, Target
from probes.observe.kernel_names import VLLM_C, KernelName

VLLM = "vllm."
MOE = VLLM + "model_executor.layers.fused_moe."
K3 = VLLM + "models.kimi_k3.nvidia."

TARGETS: tuple[Target, ...] = (
    # --- scopes: which layer is being built (and what it chose) ------------------------------
    Target("scope.decoder_layer", "scope", (K3 + "model:KimiDecoderLayer.__init__",), args=("prefix",),
           title="decoder layer"),
    Target("scope.kimi_moe", "scope", (K3 + "model:KimiMoE.__init__",), args=("prefix",), construct=True,
           title="K3 MoE block"),
    Target("scope.latent_runner", "scope", (K3 + "latent_moe_runner:LatentMoERunner.__init__",
                                            MOE + "runner.latent_moe_runner:LatentMoERunner.__init__"),
           args=("layer_name", "prefix"), construct=True, title="latent MoE runner", required=False),
    Target("scope.kda", "scope", (K3 + "kda:KimiK3DeltaAttention.__init__",), args=("prefix",), construct=True,
           title="KDA layer"),
    Target("scope.mla", "scope", (K3 + "mla:MultiHeadLatentAttention.__init__",), args=("prefix",),
           construct=True, title="MLA layer"),
    Target("scope.mlp", "scope", (K3 + "model:KimiMLP.__init__",), args=("prefix",), construct=True,
           title="dense / shared-expert MLP", required=False),
    # K3 itself builds no plain attention layer: one is a speculative draft's (an EAGLE3 Llama draft)
    Target("scope.attention", "scope", ("vllm.model_executor.layers.attention.attention:Attention.__init__",
                                        "vllm.attention.layer:Attention.__init__"),
           args=("prefix",), construct=True, title="plain attention layer (a draft's)", required=False),
    Target("scope.mtp_layer", "scope", (K3 + "mtp:KimiK3MultiTokenPredictorLayer.__init__",), args=("prefix",),
           title="MTP draft layer", required=False),
    # --- routed experts: before 0.33 K3 built its MegaMoE experts in its own module -----------------
    Target("moe.mega_moe_experts", "construct",
           (MOE + "deep_gemm_mega_moe:DeepGemmMegaMoEExperts.__init__@0.33<=v",
            K3 + "model:KimiK3MegaMoEExperts.__init__@v<0.33"),
           title="DeepGEMM MegaMoE experts"),
    # --- KDA -------------------------------------------------------------------------------------
    Target("kda.prefill", "select", (K3 + "kda:resolve_kda_prefill_backend",), phase="prefill",
           args=("backend", "num_heads"), title="KDA prefill backend"),
    Target("kda.decode", "select", (K3 + "kda:resolve_kda_decode_backend@0.30<=v",), phase="decode",
           args=("backend", "num_heads"), title="KDA decode backend"),
    # before 0.30 the decode path is a yes/no check: the fused conv+KDA+norm decode kernel or not
    Target("kda.decode_fused_check", "select", (K3 + "kda:is_fused_kda_decode_supported@v<0.30",),
           phase="decode", args=("num_heads", "num_spec"), title="fused KDA decode supported (pre-0.30)"),
    Target("kda.spec_decode", "select", (K3 + "kda:resolve_kda_spec_decode_backend@0.32<=v",),
           phase="spec-verify", args=("backend", "num_heads", "num_spec"), title="KDA spec-decode backend"),
)

#: observe mode: the KDA kernel entries, by lane
KERNELS: tuple[Kernel, ...] = (
    # KDA prefill
    Kernel("kda.prefill", "flashkda", K3 + "kda:_flashkda_prefill", backend="flashkda"),
    Kernel("kda.prefill", "flashinfer", K3 + "kda:_flashinfer_kda_prefill", backend="flashinfer"),
    Kernel("kda.prefill", "triton chunk_kda", K3 + "ops.third_party.kda:chunk_kda_with_fused_gate",
           backend="triton"),
    # KDA decode
    Kernel("kda.decode", "fused_kda_decode (native)", "vllm._custom_ops:fused_kda_decode", backend="native"),
    Kernel("kda.decode", "flashinfer fused decode", K3 + "kda:flashinfer_fused_kda_decode",
           backend="flashinfer"),
    Kernel("kda.decode", "triton packed decode", K3 + "ops.third_party.kda:fused_recurrent_kda_packed_decode",
           backend="triton"),
    # KDA speculative verify
    Kernel("kda.spec_verify", "flashinfer packed fused decode", K3 + "kda:flashinfer_packed_fused_kda_decode",
           backend="flashinfer"),
    Kernel("kda.spec_verify", "triton fused_recurrent_kda", K3 + "ops.third_party.kda:fused_recurrent_kda",
           backend="native"),
    Kernel("kda.spec_verify", "RecoverSSM verify", K3 + "kda:KimiK3DeltaAttention._recoverssm_verify",
           layer_attr="layer_idx"),
)

#: observe mode: K3's KDA and MLA attention are eager breaks of vLLM's breakable CUDA graphs; the KDA scope also
#: gives the step's phase from its metadata
SCOPES: tuple[Scope, ...] = (
    Scope(K3 + "kda:KimiK3DeltaAttention._forward", "layer_idx", phase_from="metadata", eager_break=True),
    Scope(K3 + "mla:MultiHeadLatentAttention._attention", "layer_name", eager_break=True),
)

#: resolve mode: K3's latent-MoE tail kernels compile (and allocate) on the device when constructed; each is a
#: stand-in that records its constructor arguments (probes/resolve/simulate.py)
STAND_INS: tuple[str, ...] = (
    K3 + "ops.cute_dsl.latent_moe_tail:CollectiveKernel",
    K3 + "ops.cute_dsl.latent_moe_tail:AdaptiveUpProjectionKernel",
    K3 + "ops.cute_dsl.latent_moe_tail:LamportCopyKernel",
)
#: resolve mode: calls given the device a weight lives on (meta) that are passed rank 0's device (cuda:0) instead
#: (probes/resolve/standins.py)
META_DEVICE_ARGS: tuple[tuple[str, str, str, str], ...] = (
    (K3 + "ops.latent_moe_tail", "KimiK3LatentMoETailOp.initialize", "device",
     "the latent-MoE tail op is initialised for the device rank 0's weights sit on"),
)

_MEGAMOE_WHY = "BLOCK_M from DeepGEMM's MegaMoE scheduler, sized by a symmetric buffer allocated on the device"
#: K3's own MegaMoE experts (releases before 0.33): a module of its own, its per-call variant chosen on the device
DEVICE_EXPERTS = {"KimiK3MegaMoEExperts": _MEGAMOE_WHY}
EXPERTS_MODULES = ("KimiK3MegaMoEExperts",)
#: the symmetric-memory buffer cache its MegaMoE experts class keeps (releases before 0.33)
SYMM_BUFFER_CACHES = ("_kimi_symm_buffer_cache",)

#: FlashKDA, the KDA kernels vLLM may pick for K3's linear-attention layers: its packages, and vLLM's own build of it
FINGERPRINT_PACKAGES = ("flash-kda", "flashkda")
FINGERPRINT_MODULES = ("flash_kda", "flashkda", "vllm._flashkda_C")

KDA = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
FI_KDA = "flashinfer/kda_kernels"

#: observe mode: the GPU kernels each KDA kernel path launches (vLLM 0.33.0, researched in
#: docs/notes/kernel-names-0.33.md; the format is :class:`probes.observe.kernel_names.KernelName`)
KERNEL_NAMES: tuple[KernelName, ...] = (
    # -- KDA prefill
    KernelName("flashkda", r"_flash_kda_fwd_(?:prepare|recurrence)", "library:vllm/_flashkda_C*.so"),
    KernelName("flashinfer", r"ChunkKdaFwdK[12]_object_at_", "jit-source:" + FI_KDA,
               look_for=r"class ChunkKdaFwdK[12]\b", note="CuTe DSL, small batch x heads"),
    KernelName("flashinfer", r"^kernel_cutlass_(?:kernel|kernel_prep|kernel_chain_dv2)_(?!vllm|flashinfer|tokenspeed|b12x)"
               r"(?!.*_object_at_)|^kernel_cutlass_packed_metadata_kernel",
               "jit-source:" + FI_KDA, look_for=r"def (?:kernel|kernel_prep|kernel_chain_dv2|packed_metadata_kernel)\(",
               note="CuTe DSL BT=16 engine: free functions (a method kernel's name carries `<module><Class>_object_at_`); "
                    "FlashInfer's free GEMM function `kernel` would match too"),
    KernelName("flashinfer", r"kernel_flashkda_|kernel_cake_kda_|kernel_flashinfer_recurrent_kda_",
               "jit-source:flashinfer/data/csrc/kda"),
    KernelName("flashinfer", r"kernel_cutlass_recurrent_kda_decode_kernel|kernel_cutlass__grouped_kda_kernel",
               "jit-source:" + FI_KDA, look_for=r"def (?:recurrent_kda_decode_kernel|_grouped_kda_kernel)\(",
               note="one-token prefill rows"),
    KernelName("triton chunk_kda", r"^(?:kda_gate_chunk_cumsum_vector_kernel|chunk_kda_fwd_kernel_(?:intra_sub_chunk|"
               r"intra_token_parallel|inter_solve_fused)|recompute_w_u_fwd_kernel|chunk_gla_fwd_kernel_o)$",
               "triton:" + KDA),
    KernelName("triton chunk_kda", r"^chunk_gated_delta_rule_fwd_kernel_h_blockdim64$",
               "triton:vllm.third_party.flash_linear_attention.ops.chunk_delta_h"),
    # -- KDA decode
    KernelName("fused_kda_decode (native)", r"kda_decode_fusion_many_heads_kernel", VLLM_C),
    KernelName("flashinfer fused decode", r"kernel_cutlass__fused_kda_decode_kernel", "jit-source:" + FI_KDA,
               look_for=r"def _fused_kda_decode_kernel\("),
    KernelName("triton packed decode", r"^fused_recurrent_kda_packed_decode_kernel$", "triton:" + KDA),
    # -- KDA speculative verify
    KernelName("flashinfer packed fused decode", r"kernel_cutlass__kda_kernel_", "jit-source:" + FI_KDA,
               look_for=r"def _kda_kernel\("),
    KernelName("triton fused_recurrent_kda", r"^fused_recurrent_kda_fwd_kernel$", "triton:" + KDA),
    KernelName("RecoverSSM verify", r"^_kda_recoverssm_verify_kernel$", "triton:vllm.models.kimi_k3.nvidia.ops.recoverssm"),
    KernelName("RecoverSSM verify", r"KdaTcVerify", "jit-source:vllm/models/kimi_k3/nvidia/recoverssm/cutedsl",
               look_for=r"class KdaTcVerify2?\b"),
)
