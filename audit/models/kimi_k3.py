"""Kimi-K3: everything the host knows about this model, in one place.

Its config (shipped as package data), the modules worth importing once per SM, its layer kinds, the lanes the
ledger reports and where their answers come from, its serving layouts, its observe-mode slices, and its
vocabulary: which harness lanes perf databases label, and the perf database's names for them (one map, read
both ways). Shared code reads these through the registry (:mod:`audit.models`) and knows no model by name.
"""
from __future__ import annotations

import re

from audit.profiles import BackendLabels, BatchRoute, DispatchLanes, JudgedLane, Lane, ModelState, Profile, Slice, Source, StepPath
from audit import lanevalue as values
from audit.systems import Layout

MTP_SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'
#: the draft's config is written into the cell's model directory (``<model>/draft``, the layout's draft_config)
DSPARK_SPEC = '{"method": "dspark", "model": "<model>/draft", "num_speculative_tokens": 4}'
EAGLE3_SPEC = '{"method": "eagle3", "model": "<model>/draft", "num_speculative_tokens": 3}'
SPECIALIZED_DECODE = '{"decode_backend": "latency_specialized"}'
#: what K3's fp8 KV-cache prefill asks for (its assertion names the first key); the second picks a prefill backend
#: whose fp8 query vLLM accepts (FlashInfer, TRT-LLM ragged or TokenSpeed, SM 10.x only, in 0.33)
FP8_PREFILL = '{"use_prefill_query_quantization": true, "mla_prefill_backend": "FLASHINFER"}'


def _draft_layout(name: str, method: str, folder: str, spec: str, draft: str, required_by: str) -> Layout:
    """A TP8 layout with a speculative draft whose config ships as data (``audit/data/kimi-k3/drafts/<folder>``)."""
    return Layout(name, f"single-node TP8 + {method} speculative decoding ({draft})",
                  ("--tensor-parallel-size", "8", "--speculative-config", spec), 8, opt_in=True,
                  draft_config=f"kimi-k3/drafts/{folder}/config.json",
                  note=f"No {method} draft for K3 is published with its config; the draft's config.json was written "
                       f"for this harness from what vLLM's {required_by} (audit/data/kimi-k3/drafts/{folder}/README.md "
                       "says each value's source), with dummy weights like the target's.")


LAYOUTS: dict[str, Layout] = {l.name: l for l in (
    Layout("tp8", "single-node TP8", ("--tensor-parallel-size", "8"), 8),
    Layout("tp16", "two-node TP16", ("--tensor-parallel-size", "16"), 16),
    Layout("dep8", "DEP8 MegaMoE (DP8 + EP8, --moe-backend deep_gemm_mega_moe)",
           ("--data-parallel-size", "8", "--enable-expert-parallel", "--moe-backend", "deep_gemm_mega_moe"), 8),
    Layout("tp8-mtp", "single-node TP8 + MTP speculative decoding",
           ("--tensor-parallel-size", "8", "--speculative-config", MTP_SPEC), 8,
           config_patch=(("text_config.num_nextn_predict_layers", 1),),
           note="The published config has num_nextn_predict_layers = 0, with which vLLM cannot start MTP "
                "(it divides by it). This layout serves a copy with one MTP layer, the only change."),
    Layout("dp8-ep", "DP8 + EP8, default MoE backend (plain expert parallel)",
           ("--data-parallel-size", "8", "--enable-expert-parallel"), 8),
    Layout("tp8-specdec", "single-node TP8 + K3 specialized decode (--additional-config decode_backend)",
           ("--tensor-parallel-size", "8", "--additional-config", SPECIALIZED_DECODE), 8,
           capabilities=((10, 0), (10, 3)),
           note="K3's latency-specialized decode is built after the weights load and runs only inside FULL "
                "CUDA graphs; vLLM offers it on SM 10.x, so this layout is audited there only."),
    # deployment options (opt-in: `--layouts all` or by name; `make reports` audits them)
    Layout("tp8-fp8kv", "single-node TP8, fp8 KV cache (--kv-cache-dtype fp8)",
           ("--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8"), 8, opt_in=True),
    Layout("tp8-fp8kv-fp8prefill", "single-node TP8, fp8 KV cache with fp8 prefill queries (FlashInfer MLA prefill)",
           ("--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8", "--attention-config", FP8_PREFILL), 8,
           opt_in=True),
    Layout("dp2-tp4-ep", "DP2 x TP4 + expert parallel",
           ("--data-parallel-size", "2", "--tensor-parallel-size", "4", "--enable-expert-parallel"), 8, opt_in=True),
    Layout("dp4-tp2-ep", "DP4 x TP2 + expert parallel",
           ("--data-parallel-size", "4", "--tensor-parallel-size", "2", "--enable-expert-parallel"), 8, opt_in=True),
    _draft_layout("tp8-dspark", "DSpark", "dspark", DSPARK_SPEC, "K3's dense MLA draft",
                  "K3DSparkConfig and K3DSparkModel require"),
    _draft_layout("tp8-eagle3", "EAGLE3", "eagle3", EAGLE3_SPEC, "a Llama-style EAGLE3 draft",
                  "EAGLE3 Llama draft requires of a K3 target"),
    Layout("tp8-fp8dsmla", "single-node TP8, DeepSeek-layout fp8 KV cache (--kv-cache-dtype fp8_ds_mla)",
           ("--tensor-parallel-size", "8", "--kv-cache-dtype", "fp8_ds_mla"), 8, opt_in=True),
)}



def reading_tail_fusion(facts: dict, what: str, **_) -> dict | None:
    """The latent MoE tail fusion a runner ended with (its probes package's ``runner_facts``), as a lane value
    record: the fused or unfused tail is the value, its token cap part of it, why it is so a note; where K3's MoE
    block built no runner (MegaMoE), vLLM's attribute that decided it (``block_facts``)."""
    if what == "moe-block" and facts.get("runner_absent_because"):
        transform = facts.get("routed_output_transform")
        return values.inactive("not built", note=f"vLLM's `{facts['runner_absent_because']}`: the MegaMoE experts "
                               "replace the latent MoE runner that holds the fusion" + (
                                   f"; the routed output transform runs unfused in {transform.rsplit(':', 1)[-1]}"
                                   if transform else ""))
    if what != "moe-runner" or "tail_fusion_enabled" not in facts:
        return None
    if not facts["tail_fusion_enabled"]:
        return values.make("unfused tail", note="not enabled at construction")
    fused = facts.get("fused_path")
    if "moe_kernel" in facts and facts["moe_kernel"] is None and fused is True:
        # the fused path reads the MoE kernel built at load: without it, only construction's answer is known
        return values.make("fused tail", detail="enabled at construction",
                           note="fused path not re-read: no MoE kernel was built")
    if fused is True:
        limit = facts.get("tail_max_tokens")
        return values.make("fused tail", detail=f"up to {limit} tokens" if limit else "", note="fused path holds")
    if fused is False:
        why = facts.get("fused_path_fails")
        return values.make("unfused tail", note="enabled at construction; " + (
            f"vLLM's fused-path condition fails at `{why}`" if why else
            "the fused path does not hold once the MoE kernel exists"))
    return values.make("fused tail", detail="enabled at construction", note=f"fused path unknown ({fused})")


def legacy_tail_fusion(said: str, ident: str) -> dict | None:
    """How a schema 2 routing.json worded the tail fusion, read back as :func:`reading_tail_fusion`'s record."""
    if said.startswith("not built: "):
        return values.inactive("not built", note=said[len("not built: "):])
    if said.startswith("off ("):
        return values.make("unfused tail", note=said[len("off ("):].rstrip(")"))
    m = re.fullmatch(r"on \(fused path holds(?:; fused tail up to (\d+) tokens)?\)", said)
    if m:
        return values.make("fused tail", detail=f"up to {m.group(1)} tokens" if m.group(1) else "",
                           note="fused path holds")
    if said.startswith("enabled at construction; "):
        return values.make("fused tail", detail="enabled at construction", note=said[len("enabled at construction; "):])
    return None


KIMI_K3 = Profile(
    name="kimi-k3",
    title="Kimi-K3",
    architecture="KimiK3ForConditionalGeneration",
    config_package_path="kimi-k3/config.json",
    warm_imports=(
        "vllm.config",
        "vllm.engine.arg_utils",
        "vllm.model_executor.model_loader",
        "vllm.models.kimi_k3",
    ),
    probes="kimi_k3",
    postload_readings={"tail_fusion": reading_tail_fusion},
    postload_legacy={"tail_fusion": legacy_tail_fusion},
    # KimiK3ModelState builds the specialized decode once the weights are loaded (where the layout asks for it)
    model_state=ModelState("specialized_decode", requested_field="specialized_decode_requested",
                           built_field="specialized_decode", config_field="specialized_decode_config"),
    layer_classes={
        "KimiK3DeltaAttention": "kda",
        "MultiHeadLatentAttention": "mla",
        "KimiMoE": "moe",
        "KimiMLP@mlp": "dense",
        "KimiK3MultiTokenPredictorLayer": "mtp",
        "Attention": "attention",  # K3 builds none itself: an EAGLE3 (Llama) draft's attention
    },
    draft_weights=("model.layers.{layer}.enorm.weight",),
    layouts=LAYOUTS,
    schemes=("mxfp4",),
    judged=(
        JudgedLane("moe", "moe", None, "prefill+decode", ("decode", "prefill", "verify"), (
            ("latent_tail", ""), ("shared_overlap", ""), ("moe_experts", ""), ("router", ""), ("moe_routing", ""),
            ("moe_parallel", ""), ("down_proj_overlap", ""))),
        JudgedLane("kda.prefill", "kda", "kda.context", "prefill", ("prefill",), (("kda_batch", "prefill"),)),
        JudgedLane("kda.decode", "kda", "kda.generation", "decode", ("decode",), (("kda_batch", "decode"),)),
        JudgedLane("kda.spec_verify", "kda", "kda.verify", "spec-verify", ("verify",), (("kda_batch", "verify"),)),
        JudgedLane("mla.decode", "mla", "mla.decode", "decode", ("decode", "verify"),
                   (("mla", "decode"), ("mla_kv_cache", "decode"))),
        JudgedLane("mla.prefill", "mla", "mla.prefill", "prefill", ("prefill",),
                   (("mla", "prefill"), ("mla_kv_cache", "prefill"))),
    ),
    perf_lanes={
        "kda.context": "kda.prefill",
        "kda.generation": "kda.decode",
        "kda.verify": "kda.spec_verify",
        "mla.decode": "mla.decode",
        "mla.prefill": "mla.prefill",
    },
    perf_lane_phases={"kda.context": ("prefill",), "kda.generation": ("decode",), "kda.verify": ("verify",)},
    kind_titles={"kda": "KDA", "mla": "MLA", "moe": "MoE", "dense": "dense MLP",
                 "mtp": "MTP draft (separate draft model)", "attention": "plain attention (a speculative draft's)"},
    ledger_notes={
        "glossary": (
            ("W4A16 / W4A8", "4-bit (MXFP4) expert weights with 16-bit activations / with 8-bit (MXFP8) activations"),
            ("SiTU", "Kimi-K3's gated activation in its experts; a kernel that does not whitelist it cannot serve them"),
            ("KDA / MLA", "K3's two attention kinds: Kimi Delta Attention (linear, recurrent state) and multi-head "
                          "latent attention"),
        ),
        "layer_numbers": "Layer numbers are vLLM's 0-based module indices (`language_model.model.layers.N`); the model\n"
                         "config's `kda_layers` / `full_attn_layers` lists count from 1.",
        "candidates_of": "MLA layers",
        "state_example": "K3's specialized decode",
    },
    dispatch=DispatchLanes(
        order=("serving_path", "specialized_decode", "latent_tail", "shared_overlap", "moe_experts", "router",
               "moe_routing", "moe_parallel", "down_proj_overlap", "mla", "mla_kv_cache", "low_latency_gemm", "lm_head", "kda_projection_overlap",
               "kda_batch"),
        titles={
            "serving_path": "Serving path (CUDA-graph mode; K3 specialized decode)",
            "specialized_decode": "K3 specialized decode (steps it takes)",
            "latent_tail": "Latent MoE tail tier",
            "down_proj_overlap": "Routed down-projection stream overlap",
            "low_latency_gemm": "K3 low-latency BF16 GEMMs",
            "lm_head": "lm_head low-latency GEMM (at the step's logits rows)",
            "kda_projection_overlap": "KDA input-projection stream overlap",
            "kda_batch": "KDA kernel by batch type (decode, prefill and verify alone or mixed)",
            "mla_kv_cache": "MLA KV-cache path (cache dtype, query dtype, fused cache insert)",
        },
        notes={
            "serving_path": ("vLLM's CUDA-graph dispatch gives the mode; where the layout has K3's specialized decode, "
                             "its own `SpecializedDecode.plan` says whether it takes the step (its constructor ran up to "
                             "its first device work, which fixes the batch sizes it prepares). A step it takes is served "
                             "by its own kernels: the stock lanes' rows for that cell and batch say what the stock "
                             "forward would run, not what serves it."),
            "specialized_decode": ("The specialized decode itself is not built in the simulation (its CuTe DSL kernels "
                                   "need a device; see the post-load stage): its MLA core per batch is vLLM's "
                                   "`core_for`, everything else is marked `needs GPU`."),
            "mla_kv_cache": ("K3's MLA `_attention` ran on meta tensors up to its attention core: the fused op that "
                             "writes the batch's latent into the paged cache (K3 picks it by cache dtype), the dtype "
                             "of the query the core receives (fp8 where the cache is fp8 and the backend takes an fp8 "
                             "query; the prefill query's dtype is the metadata builder's), and `vLLM raises` where "
                             "K3's fp8 policy asserts on the batch (a server fails at that batch; claims there are "
                             "REFUSED)."),
            "kda_batch": ("vLLM's KDA `_forward` ran on meta tensors up to the kernel it calls, for each kind of batch "
                          "as vLLM's runner builds its metadata for the layout: pure decode, a prefill chunk and a "
                          "verify batch each alone and with 8 decode requests beside it (mixed; where the speculative "
                          "rows' kernel is followed by another launch, both are named)."),
        },
        stand_ins={
            "mla_kv_cache": ("dispatch `mla_kv_cache`: K3 MultiHeadLatentAttention._attention's inputs and callees",
                             "a forward context holding the batch's metadata: its decode/prefill token split as "
                             "vLLM's split_decodes_and_prefills counts it with the builder's threshold, the metadata "
                             "builder's own prefill query dtype, no chunked context; the paged KV cache as a meta "
                             "tensor of the layer's own KV-cache spec; the fused cache-insert CUDA ops (launched by "
                             "vLLM's wrappers, which allocate their outputs) write nothing; the decode core "
                             "(forward_mqa) and the prefill backend's run_prefill_new_tokens stop the call"),
            # the shared serving-path lane asks K3's planner (SpecializedDecode.plan) whether it takes each step
            "serving_path": ("dispatch `serving_path`: SpecializedDecode.plan's inputs",
                             "a forward context holding the step's CUDA-graph mode and, per layer, the request counts "
                             "of the padded batch (meta index tensors); the current stream answers 'capturing' exactly "
                             "when vLLM dispatched the step to a graph"),
            "kda_batch": ("dispatch `kda_batch`: KimiK3DeltaAttention._forward's inputs and callees",
                          "a forward context holding the batch's metadata (built by vLLM's model state and the "
                          "layer's own builder from a described batch, index tensors on meta); the layer's conv and "
                          "recurrent state as meta tensors of its own state shapes; causal_conv1d_fn/_update, "
                          "gather_initial_states and the workspace return tensors of their output shapes; the "
                          "builder's prefix-cache state slots and CUDA-graph staging (GPU kernels) give tensors of "
                          "their shapes; host copies are not pinned; each KDA kernel stops the call when reached, "
                          "except the speculative rows' kernel where other rows follow, which returns an output of "
                          "its shape (nothing runs)"),
        },
    ),
    # K3's latency-specialized decode (``--additional-config decode_backend``): a step it takes runs its own kernels
    batch_routes=(
        # vLLM's MLA metadata builder splits a batch into decode and prefill rows by query length: a short
        # prefill chunk takes the decode path
        BatchRoute("mla", ("mla.decode", "mla.prefill"), {"decode path": "mla.decode", "prefill path": "mla.prefill"},
                   "MLA", named=True),
        # under a draft method, vLLM's runner (0.32 on) builds every decode row as a speculative row, so the KDA
        # layer serves a decode batch with its spec-verify kernel
        BatchRoute("kda_batch", ("kda.decode",), {"speculative rows": "kda.spec_verify"}, "KDA"),
    ),
    step_path=StepPath(name="specialized decode", lane="specialized_decode", owner="K3's specialized decode",
                       family="specialized_decode",
                       parts={"moe": "experts", "mla.decode": "mla_core", "kda.decode": "kda", "kda.spec_verify": "kda"}),
    # a KDA lane's value is vLLM's resolved KDA backend string (facts from docs/notes/labels-and-kernels.md)
    backend_labels=BackendLabels(
        term="KDA value",
        kernels={
            "kda.prefill": {"flashkda": "flashkda_fwd", "triton": "chunk_kda_with_fused_gate",
                            "flashinfer": "flashinfer_recurrent_kda"},
            "kda.decode": {"native": "fused_kda_decode", "triton": "fused_recurrent_kda_packed_decode",
                           "flashinfer": "flashinfer_fused_kda_decode",
                           True: "fused_kda_decode",  # pre-0.30: the fused decode check said yes
                           False: "fused_recurrent_kda_packed_decode"},
            "kda.spec_verify": {"native": "fused_recurrent_kda", "flashinfer": "flashinfer_packed_fused_kda_decode"},
        },
        # labels the perf database has no entry for, with the family their kernels belong to
        families={"flashinfer_recurrent_kda": "flashinfer", "flashinfer_fused_kda_decode": "flashinfer",
                  "flashinfer_packed_fused_kda_decode": "flashinfer"},
    ),
    selftest_slice="slice4",
    # the selftest workload has no speculative decoding
    selftest_lanes=("kda.prefill", "kda.decode", "mla.prefill", "mla.decode", "moe"),
    lanes=(
        Lane("moe", "Routed experts", "moe", "all", (
            Source("construct", "moe.quant_method", ("attrs.mxfp4_backend", "attrs.experts_cls"), extra=("cls",)),
            Source("construct", "moe.mega_moe_experts", ("cls",), label="MegaMoE"),
        ), candidates_target="moe.candidate"),
        Lane("kda.prefill", "KDA prefill", "kda", "prefill", (Source("select", "kda.prefill", ("result",)),)),
        Lane("kda.decode", "KDA decode", "kda", "decode", (
            Source("select", "kda.decode", ("result",)),
            Source("select", "kda.decode_fused_check", ("result",), label="fused decode kernel supported:"),
            Source("construct", "scope.kda", ("attrs.kda_decode_backend",)),
        )),
        Lane("kda.spec_verify", "KDA spec-verify", "kda", "spec-verify", (
            Source("select", "kda.spec_decode", ("result",)),
        ), exercised_if=("args.num_spec", "no speculative decoding in this layout (num_spec=0)")),
        Lane("mla.decode", "MLA attention (decode)", "mla", "decode", (
            Source("construct", "scope.mla", ("attrs.attn_backend", "attrs.impl")),
        )),
        Lane("mla.prefill", "MLA prefill", "mla", "prefill", (
            Source("construct", "scope.mla", ("attrs.prefill_backend",)),
        )),
        Lane("attention", "Draft attention (plain multi-head: an EAGLE3 draft's)", "attention", "all", (
            Source("construct", "scope.attention", ("attrs.attn_backend",)),
        )),
        Lane("dense", "Dense MLP linears", "dense", "all", (
            Source("module", r"\.mlp\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),
        )),
        Lane("shared", "Shared-expert linears", "moe", "all", (
            Source("module", r"\.shared_experts\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),
        )),
        Lane("moe.kernel", "MoE kernel built at load", "moe", "all", (Source("postload", "moe_kernel", ()),),
             level="post-load"),
        Lane("moe.activation", "Experts activation (SiTU check)", "moe", "all",
             (Source("postload", "activation", ()),), level="post-load"),
        Lane("moe.tail_fusion", "Latent-MoE tail fusion", "moe", "all", (Source("postload", "tail_fusion", ()),),
             level="post-load"),
        Lane("moe.deferred_finalize", "Deferred MoE finalize", "moe", "all",
             (Source("postload", "deferred_finalize", ()),), level="post-load"),
        Lane("decode.specialized", "Specialized decode (decode_backend)", "model", "decode",
             (Source("postload", "specialized_decode", ()),), level="post-load"),
    ),
)

_K3_LAYERS = "text_config.num_hidden_layers"
_K3_KDA = "text_config.linear_attn_config.kda_layers"
_K3_FULL = "text_config.linear_attn_config.full_attn_layers"
KIMI_K3.slices.update({
    "slice4": Slice("slice4", 4, ((_K3_LAYERS, 4), (_K3_KDA, [1, 2, 3]), (_K3_FULL, [4])),
                    kept="layers 0-3: 0 (KDA, dense MLP), 1-2 (KDA, latent MoE), 3 (MLA, latent MoE)",
                    cut="layers 4-92 (66 KDA, 23 MLA, 89 MoE layers of the same shapes as the kept ones)"),
    "slice8": Slice("slice8", 8, ((_K3_LAYERS, 8), (_K3_KDA, [1, 2, 3, 5, 6, 7]), (_K3_FULL, [4, 8])),
                    kept="layers 0-7: 0 (KDA, dense MLP), 1-2 and 4-6 (KDA, latent MoE), 3 and 7 (MLA, latent MoE)",
                    cut="layers 8-92 (63 KDA, 22 MLA, 85 MoE layers of the same shapes as the kept ones)"),
})

