"""What the probes wrap, as data.

Each target names a role (``id``) and the places vLLM implements it, as ``module:qualname`` specs
tried in order; a spec may carry a version range (``"0.30<=v"``, ``"v<0.30"``) that is checked
against the installed vLLM. The first spec that resolves is patched. When none resolves in a
module that was imported, the target is reported as *probe drift* (the ledger says so); a target
whose module vLLM never imported is *not reached*.

Kinds:

``scope``      push the call's ``prefix`` argument (a model-layer name) while the call runs, so
               selections made inside are attributed to that layer.
``select``     record the chosen arguments and the result of a selector.
``candidates`` the call returns experts classes to try (``backend_to_kernel_cls``): wrap their
               ``is_supported_config`` where defined, and note the backend being tried.
``check``      (installed by ``candidates``) record ``(supported, reason)`` per class tried.
``construct``  record that an object of a class was constructed inside the current scope, with
               named arguments (e.g. MegaMoE experts).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    id: str
    kind: str
    specs: tuple[str, ...]
    #: argument names (from inspect.signature binding) to record
    args: tuple[str, ...] = ()
    #: the layer phase this selection governs, when it governs one
    phase: str = ""
    #: what the ledger calls it
    title: str = ""
    #: False for targets that only exist in some releases and whose absence is expected
    required: bool = True
    #: scope targets: also record what the object chose at construction (enums, classes, flags)
    construct: bool = False


VLLM = "vllm."
MOE = VLLM + "model_executor.layers.fused_moe."
K3 = VLLM + "models.kimi_k3.nvidia."

TARGETS: tuple[Target, ...] = (
    # --- scopes: which layer is being built (and what it chose) ------------------------------
    Target("scope.decoder_layer", "scope", (K3 + "model:KimiDecoderLayer.__init__",), args=("prefix",),
           title="decoder layer"),
    Target("scope.kimi_moe", "scope", (K3 + "model:KimiMoE.__init__",), args=("prefix",), construct=True,
           title="K3 MoE block"),
    Target("scope.routed_experts", "scope", (MOE + "routed_experts:RoutedExperts.__init__",),
           args=("layer_name",), construct=True, title="routed experts", required=False),
    Target("scope.latent_runner", "scope", (K3 + "latent_moe_runner:LatentMoERunner.__init__",
                                            MOE + "runner.latent_moe_runner:LatentMoERunner.__init__"),
           args=("layer_name", "prefix"), construct=True, title="latent MoE runner", required=False),
    Target("scope.kda", "scope", (K3 + "kda:KimiK3DeltaAttention.__init__",), args=("prefix",), construct=True,
           title="KDA layer"),
    Target("scope.mla", "scope", (K3 + "mla:MultiHeadLatentAttention.__init__",), args=("prefix",),
           construct=True, title="MLA layer"),
    Target("scope.mlp", "scope", (K3 + "model:KimiMLP.__init__",), args=("prefix",), construct=True,
           title="dense / shared-expert MLP", required=False),
    Target("scope.mtp_layer", "scope", (K3 + "mtp:KimiK3MultiTokenPredictorLayer.__init__",), args=("prefix",),
           title="MTP draft layer", required=False),
    # --- routed experts ------------------------------------------------------------------------
    Target("moe.quant_method", "construct",
           (VLLM + "model_executor.layers.quantization.mxfp4:Mxfp4MoEMethod.__init__",),
           title="MoE quant method"),
    Target("moe.oracle.deepseek_v4", "select",
           (MOE + "oracle.mxfp4:select_deepseek_v4_mxfp4_moe_backend",), title="MXFP4 MoE oracle (DSv4/K3)"),
    Target("moe.oracle.mxfp4", "select", (MOE + "oracle.mxfp4:select_mxfp4_moe_backend",),
           title="MXFP4 MoE oracle (gpt-oss style)", required=False),
    Target("moe.candidates", "candidates", (MOE + "oracle.mxfp4:backend_to_kernel_cls",),
           args=("backend",), title="MoE backend candidates (auto)"),
    Target("moe.requested", "candidates", (MOE + "oracle.mxfp4:_requested_kernel_cls@0.33<=v",),
           args=("backend",), title="MoE backend candidates (--moe-backend)", required=False),
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
    # --- MLA ---------------------------------------------------------------------------------------
    Target("mla.attn_backend", "select", (VLLM + "platforms.cuda:CudaPlatformBase.get_attn_backend_cls",),
           args=("selected_backend",), phase="decode", title="attention backend"),
    Target("mla.attn_candidates", "select", (VLLM + "platforms.cuda:CudaPlatformBase.get_valid_backends",),
           phase="decode", title="attention backend candidates", required=False),
    Target("mla.prefill", "select", (VLLM + "v1.attention.backends.mla.prefill.selector:get_mla_prefill_backend",),
           phase="prefill", title="MLA prefill backend"),
)


def parse_version(text: str) -> tuple[int, ...] | None:
    pieces = text.split("+")[0].split(".")
    if not all(p.isdigit() for p in pieces):
        return None  # dev/rc builds: no range applies, every spec is tried
    parts = tuple(int(p) for p in pieces)
    return parts if len(parts) >= 2 else None


def spec_applies(spec_range: str, version: str) -> bool:
    """``"0.30<=v"``, ``"v<0.30"``, ``"0.27<=v<0.30"`` against an installed version; unknown -> True."""
    v = parse_version(version)
    if not spec_range or v is None:
        return True
    lo, _, rest = spec_range.partition("v")
    if lo.endswith("<="):
        lo_v = parse_version(lo[:-2])
        if lo_v and v < lo_v:
            return False
    if rest.startswith("<"):
        hi_v = parse_version(rest[1:])
        if hi_v and v >= hi_v:
            return False
    return True


def split_spec(spec: str) -> tuple[str, str, str]:
    """``"pkg.mod:Qual.name@0.30<=v"`` -> (module, qualname, version range)."""
    spec, _, vrange = spec.partition("@")
    module, _, qualname = spec.partition(":")
    return module, qualname, vrange
