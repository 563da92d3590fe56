"""The kernel-name map (probes.observe.kernel_names) against the real pinned build: every kernel path observe
mode counts has entries, each entry's kernel is present in the v0.33.0 wheel where the map says it
comes from, and a kernel found for one path is not also claimed by another path of its lane unless the
map says the two share it."""
import json
import re
import subprocess

import pytest

from probes import models as models_probes
from probes.observe.kernel_names import ORIGIN_KINDS, all_names
from probes.observe.session import entries

from audit.models import PROFILES

#: the map and the kernel paths of every model's observe run (the shared ones, its quantization schemes' and its own)
_WHICH = [(p.probes, list(p.schemes)) for p in PROFILES.values()]
_MODELS = [models_probes.load(name, schemes=schemes) for name, schemes in _WHICH]
KERNEL_NAMES = tuple(dict.fromkeys(e for m in _MODELS for e in all_names(m)))
KERNELS = tuple(dict.fromkeys(k for m in _MODELS for k in entries(m)[0]))
from tests.conftest import ROOT

SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from probes import models
from probes.observe.kernel_names import all_names, check_build
entries = tuple(dict.fromkeys(e for name, schemes in json.loads(sys.argv[2])
                              for e in all_names(models.load(name, schemes=schemes))))
print(json.dumps(check_build(entries, roots=sys.path[1:], example_chars=None, examples=None)))
"""


def test_every_observed_path_has_a_well_formed_entry():
    paths = {k.path for k in KERNELS}
    assert {e.path for e in KERNEL_NAMES} == paths
    for e in KERNEL_NAMES:
        re.compile(e.pattern)
        assert e.origin_kind in ORIGIN_KINDS and e.origin_where, e
        assert set(e.shares) <= paths - {e.path}, e


MLA_FI_CUTE = ("kernel_cutlass_split_kv_kernel_flashinfercute_dslattentionmonolithicmla_decode_fp16"
               "BlackwellMultiHeadLatentAttentionForwardFP16_object_at__TiledMMA_0")
#: kernel names as traces show them, from docs/notes/kernel-names-0.33.md: demangled CUDA names, Triton
#: function names, and CuTe DSL names built by the DSL's naming rule (kernel_cutlass_<fn>_<module><class>...)
DOCUMENTED = {
    "void (anonymous namespace)::kda_decode_fusion_many_heads_kernel<false, true, 96, 96, true>(__nv_bfloat16 const*)":
        {"fused_kda_decode (native)"},
    "_ZN59_GLOBAL__N__77034d04_26_fused_kda_decode_kernel_cu_652fd05d35kda_decode_fusion_many_heads_kernelILb0E":
        {"fused_kda_decode (native)"},
    "kernel_cutlass__fused_kda_decode_kernel_tensorptrbf16gmemalign16_o_0": {"flashinfer fused decode"},
    "kernel_cutlass__kda_kernel_tensorptrbf16gmemalign16_o_0": {"flashinfer packed fused decode"},
    "kernel_cutlass__grouped_kda_kernel_tensorptrf32_0": {"flashinfer"},
    "kernel_cutlass_kernel_tensorptrbf16gmemalign16_o_0": {"flashinfer"},
    "kernel_cutlass_kernel_vllmmodelskimi_k3nvidiarecoverssmcutedslverifyKdaTcVerify_object_at__0": {"RecoverSSM verify"},
    "fused_recurrent_kda_packed_decode_kernel": {"triton packed decode"},
    "fused_recurrent_kda_fwd_kernel": {"triton fused_recurrent_kda"},
    "chunk_kda_fwd_kernel_intra_sub_chunk": {"triton chunk_kda"},
    "_causal_conv1d_update_kernel": set(),  # a helper the Triton KDA paths share: claimed by none
    "fmhaSm100fKernel_QkvBfloat16OBfloat16HQk576HV512PagedKvDenseP64VarSeqQ8Kv128PersistentSwapsAbForGen":
        {"FlashInfer MLA"},
    "fmhaSm103aKernel_QkvBfloat16OBfloat16HQk192HV128SeparateQkvCausalVarSeqQ256Kv128PersistentContext":
        {"TRT-LLM ragged prefill"},
    MLA_FI_CUTE: {"FlashInfer MLA"},
    "kernel_cutlass_split_kv_kernel_tokenspeed_mlamla_decode_fp8BlackwellMultiHeadLatentAttentionForwardFP8_object_at__0":
        {"Tokenspeed MLA"},
    "kernel_cutlass_kernel_tokenspeed_mlafmhaBlackwellFusedMultiHeadAttentionForward_object_at__0": {"Tokenspeed prefill"},
    "kernel_cutlass_kernel_vllmvllm_flash_attncuteflash_fwd_sm100FlashAttentionForwardSm100_object_at__t0":
        {"FlashAttn prefill"},
    "kernel_cutlass_kernel_vllmvllm_flash_attncutesm100_hd256_2cta_fmha_forwardBlackwellFusedMultiHeadAttentionForward"
    "_object_at__0": {"FlashAttn prefill"},
    "kernel_cutlass_kernel_b12xmoe_sharedkernelsdynamicMoEDynamicKernelSitu_object_at__0": {"B12x"},
    "kernel_cutlass_kernel_prep_0": {"flashinfer"},
    "void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8>, true>(Flash_fwd_mla_params)":
        {"FlashMLA"},
    "void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<192, 64, 128, 4>, true>(Flash_fwd_params)":
        {"FlashAttn prefill"},
    "void cutlass::device_kernel<cutlass::fmha::kernel::Sm100FmhaFwdKernelTmaWarpspecialized<int>>(int)":
        {"FlashInfer prefill"},
    "_fwd_grouped_kernel_stage1": {"Triton MLA"},
    "void marlin_moe_wna16::Marlin<(vllm::ScalarTypeId)5, 4, 8, 8, true>(int4 const*)": {"Marlin", "Marlin (batched)"},
    "fused_moe_kernel": {"Triton", "Triton or DeepGEMM / CUTLASS fallback"},
    "fused_moe_kernel_gptq_awq": set(),
    "bmm_Bfloat16_MxE2m1Bfloat16_Fp32_t128x8x128u2_s4_et128x8_m128x8x32_cga1x1x1_16dp256b_rM_TN_transOut_sm100f":
        {"TRT-LLM MXFP4 (monolithic)", "TRT-LLM MXFP4 (modular)"},
    "void deep_gemm::sm100_fp8_fp4_mega_moe_situ_impl<7168u, 256u>(int)": {"DeepGEMM MegaMoE"},
    "void deep_gemm::sm100_fp8_fp4_gemm_1d1d_impl<(deep_gemm::GemmType)1, 7168u>(int)":
        {"DeepGEMM FP4", "DeepGEMM (batched)", "Triton or DeepGEMM / CUTLASS fallback"},
    "void deep_gemm::sm90_fp8_gemm_1d2d_impl<(deep_gemm::GemmType)2, 7168u>(int)":
        {"DeepGEMM (batched)", "Triton or DeepGEMM / CUTLASS fallback"},
    "_p_matmul_ogs_NTT_bf16xbf16xmxfp4_64x256x128x1_swiglu": {"OAI Triton MXFP4 (monolithic)", "OAI Triton",
                                                              "OAI Triton (unfused)"},
    "_topk_forward": {"OAI Triton MXFP4 (monolithic)"},
    "void humming<MmaOpClass, Shape<0u, 7168u, 256u>>(int)": {"Humming (indexed)", "Humming (grouped)",
                                                              "Humming (batched grouped)"},
}


def test_documented_kernel_names_map_to_their_paths_only():
    """Across every lane: a kernel name is claimed by exactly the paths documented for it (shared kernels
    by all their sharers, helpers by none)."""
    from probes.observe.kernel_names import matches

    got = {name: {e.path for e in matches(KERNEL_NAMES, name)} for name in DOCUMENTED}
    assert {n: p for n, p in got.items() if p != DOCUMENTED[n]} == {}
    for name, paths in DOCUMENTED.items():
        for e in matches(KERNEL_NAMES, name):
            assert paths - {e.path} <= set(e.shares), (name, e.path)


@pytest.mark.vllm
def test_the_map_matches_kernels_the_pinned_build_contains(vllm_env):
    _rt, _pin, env = vllm_env
    r = subprocess.run([str(env / "bin" / "python"), "-I", "-c", SCRIPT, str(ROOT), json.dumps(_WHICH)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout)
    assert [(f["path"], f["pattern"]) for f in found] == [(e.path, e.pattern) for e in KERNEL_NAMES]
    missing = [(f["path"], f["origin"], f["status"]) for f in found
               if f["status"] != ("not checkable" if f["origin"].startswith("runtime-download") else "in build")]
    assert missing == []
    # every precompiled or Triton kernel found for an entry (all of them, whole names) is claimed by no
    # other path, in any lane, but the ones the entry says share it
    entry_of = {(e.path, e.pattern): e for e in KERNEL_NAMES}
    for f in found:
        e = entry_of[(f["path"], f["pattern"])]
        if e.origin_kind == "jit-source":  # the examples are source lines, not kernel names
            continue
        for name in f["examples"]:
            claimants = {o.path for o in KERNEL_NAMES if re.search(o.pattern, name)}
            assert claimants - {e.path} <= set(e.shares), (e.path, name, claimants)
