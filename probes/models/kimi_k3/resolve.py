"""Kimi-K3's resolve-side probes: what its post-load leaves behind (the latent-MoE tail fusion, the specialized
decode it builds once the weights are loaded) and its per-call dispatch lanes (the latent MoE tail tier, the
specialized decode, the routed down-projection overlap, the low-latency GEMM plans, the KDA projection overlap and
the KDA kernel by batch type), plus observe mode's phase attribution checked against its KDA metadata.

Loaded by the resolve agent when the plan names ``kimi_k3`` (:func:`probes.models.load`); the lanes follow
:mod:`probes.resolve.dispatch`'s contract and run after its shared ones. Imported only inside the pinned
environment; vLLM is imported inside the functions.
"""
from __future__ import annotations

import dataclasses
import importlib
import types

from probes.core import fence
from probes.core.recorder import describe
from probes.core.tiers import needs_gpu, not_resolved, not_taken, raises
from probes.models import StepPath
from probes.resolve.dispatch import (SERVING_PATHS, Stop, Workload, _mla_builder, capture, draft_speculator, err, meta,
                                     mla_split, optional, runners)
from probes.resolve.postload import attempt, failing_condition


# --- post-load ----------------------------------------------------------------------------------------------------

def postload_steps(lm) -> list[tuple]:
    """What ``KimiK3ModelState.__init__`` does once the weights are loaded: build the specialized decode (where the
    layout asks for it), as a post-load step of its own."""
    if getattr(lm, "specialized_decode_config", None) is not None and hasattr(lm, "build_specialized_decode"):
        return [("model-state", "", lm, lm.build_specialized_decode,
                 f"{type(lm).__module__}:{type(lm).__qualname__}.build_specialized_decode")]
    return []


def runner_facts(module) -> dict:
    """The latent MoE tail fusion of a runner: whether it is enabled, whether the fused path is taken (vLLM
    re-evaluates it once the MoE kernel exists) and, when not, the check in vLLM's condition that decided."""
    facts: dict = {}
    if not hasattr(module, "enable_k3_latent_moe_tail_fusion"):
        return facts
    facts["tail_fusion_enabled"] = bool(module.enable_k3_latent_moe_tail_fusion)
    if callable(getattr(module, "_use_fused_path", None)):
        facts["fused_path"] = attempt(lambda: bool(module._use_fused_path()))
        if facts["fused_path"] is False:
            facts["fused_path_fails"] = attempt(lambda: failing_condition(module._use_fused_path, module))
    op = getattr(module, "_k3_latent_moe_tail_op", None)
    contract = getattr(op, "contract", None)
    facts["tail_op"] = None if op is None else describe(type(op))
    facts["tail_max_tokens"] = getattr(contract, "max_num_tokens", None) if contract is not None else None
    return facts


def block_facts(module) -> dict | None:
    """K3's MoE block (``KimiMoE``): whether it built the MegaMoE experts in place of the latent MoE runner. vLLM
    decides it once, at construction, into ``use_mega_moe`` (from the MoE backend the layout asks for); that
    attribute is read, not re-derived. With it set there is no runner, so no latent tail fusion and no deferred
    finalize: the routed output transform runs as its own module."""
    if not hasattr(module, "use_mega_moe") or not hasattr(module, "experts"):
        return None
    mega = bool(module.use_mega_moe)
    transform = getattr(module, "routed_output_transform", None)
    facts = {"block": describe(type(module)), "use_mega_moe": mega,
             "experts": describe(type(getattr(module, "experts", None))),
             "routed_output_transform": None if transform is None else describe(type(transform))}
    if mega:
        facts["runner_absent_because"] = f"{type(module).__qualname__}.use_mega_moe is True"
    return facts


def model_facts(lm) -> dict | None:
    """The specialized decode: whether the layout asked for it, its config, and what was built."""
    if not hasattr(lm, "specialized_decode_config"):
        return None
    cfg = lm.specialized_decode_config
    built = getattr(lm, "specialized_decode", None)
    return {"specialized_decode_requested": cfg is not None,
            "specialized_decode_config": describe(vars(cfg)) if cfg is not None and hasattr(cfg, "__dict__") else
            (describe(cfg) if cfg is not None else None),
            "specialized_decode": None if built is None else describe(type(built))}


# --- observe mode's phase attribution ------------------------------------------------------------------------------

def check_phase(rec, session, model, vllm_config) -> None:
    """Observe mode's phase attribution against vLLM's real KDA metadata class and forward context:
    for a built KDA layer, what phase the scope reads for a prefill, decode, spec-verify and mixed batch."""
    out: dict = {}
    try:
        from vllm.config import set_current_vllm_config
        from vllm.forward_context import set_forward_context
        from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
        from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadata

        layer = next(m for m in model.modules() if isinstance(m, KimiK3DeltaAttention))
        cases = {"prefill": (2, 0, 0), "decode": (0, 4, 0), "spec-verify": (0, 0, 4), "mixed": (1, 3, 0)}
        for name, (p, d, s) in cases.items():
            # the counts a batch of this kind has; every other required field is left empty
            kw = {f.name: None for f in dataclasses.fields(KimiK3KDAMetadata)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
            kw.update(num_prefills=p, num_prefill_tokens=p * 64, num_decodes=d, num_decode_tokens=d,
                      num_spec_decodes=s, num_spec_decode_tokens=s * 4, num_actual_tokens=p * 64 + d + s * 4)
            md = KimiK3KDAMetadata(**kw)
            with set_current_vllm_config(vllm_config), set_forward_context({layer.prefix: md}, vllm_config):
                out[name] = session.metadata_phase(layer)
        out["layer"] = layer.prefix
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    rec.emit("observe-phase-check", **out)


# --- dispatch lanes ------------------------------------------------------------------------------------------------

def lane_latent_tail(models, vllm_config, works):
    """K3's latent MoE tail: LatentMoERunner._use_fused_path, moe_config.should_defer_moe_finalize
    and LatentMoERunner._select_tail_tier, called per token count."""
    runner_cls = optional("vllm.models.kimi_k3.nvidia.latent_moe_runner:LatentMoERunner") or \
        optional("vllm.model_executor.layers.fused_moe.runner.latent_moe_runner:LatentMoERunner")
    if runner_cls is None:
        return
    for role, model in models:
        for name, runner in runners(model):
            if not isinstance(runner, runner_cls):
                continue
            tiers = []
            fused = runner._use_fused_path() if hasattr(runner, "_use_fused_path") else None
            select = getattr(runner, "_select_tail_tier", None)
            transform = getattr(runner, "routed_output_transform", None)
            for w in works:
                if fused is None or select is None:
                    choice = not_resolved("this LatentMoERunner has no tail-tier selector")
                elif not fused:
                    check = failing_condition(runner._use_fused_path, runner)
                    choice = ("native runner path (no fused tail: _use_fused_path() is False" +
                              (f", at `{check}`)" if check else ")"))
                else:
                    try:
                        choice = _tail_choice(runner, select, transform, w.tokens)
                    except Exception as exc:
                        choice = not_resolved(err(exc))
                tiers.append(choice)
            yield role, name, tiers, f"{runner_cls.__module__}:{runner_cls.__qualname__}._select_tail_tier"


def _tail_choice(runner, select, transform, tokens: int) -> str:
    # _fused_forward first asks whether this call may leave the top-k reduction to the tail (then it
    # runs tier 0 directly); deferral is only ever requested without hidden-dim padding, the other
    # condition of that branch. Otherwise the tier selector decides from the output's row count.
    hidden, latent = transform.up_proj.weight.shape[0], transform.up_proj.weight.shape[1]
    defer = getattr(runner.moe_config, "should_defer_moe_finalize", None)
    if defer is not None and defer(tokens):
        return "TAIL_FUSION (deferred top-k finalize)"
    tier = select(meta(tokens, latent), meta(tokens, hidden))
    return getattr(tier, "name", str(tier))


def _config_text(config) -> str:
    """A SkinnyGemmConfig without its row count (the M it is for): ``block_size=224 outputs_per_block=3 ...``."""
    if not dataclasses.is_dataclass(config):
        return str(config)
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
                    if f.name != "num_rows" and getattr(config, f.name) is not None)


def _gemm_availability() -> tuple[bool, bool]:
    """Whether the CuTe skinny GEMM and the dsv3 fused-A op the low-latency plans name are usable here."""
    import torch

    skinny = optional("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm:shape_dynamic_skinny_gemm")
    try:
        skinny_ok = bool(skinny.is_available()) if skinny is not None else False
    except Exception:
        skinny_ok = False
    return skinny_ok, hasattr(torch.ops._C, "dsv3_fused_a_gemm")


def _plan_choice(qm, m: int, skinny_ok: bool, dsv3_ok: bool) -> str:
    """What a K3 low-latency method's per-M plan runs for an M-row call (its table entry, or the base GEMM)."""
    plan = getattr(qm, "_plan", {}) or {}
    gemm = getattr(getattr(qm, "_gemm_impl", None), "__name__", "base GEMM")
    fallback = f"base linear ({gemm})"
    entry = plan.get(m)
    if entry is None:
        return fallback
    if entry[0] == "cute":
        return f"CuTe skinny GEMM ({_config_text(entry[1])})" if skinny_ok else \
            f"{fallback}: the plan's CuTe skinny GEMM is not available here"
    return str(entry[0]) if dsv3_ok else f"{fallback}: the plan's {entry[0]} op is not compiled in"


def _plan_lane(models, works, method: str, rows_of):
    """One row per module whose quant method is K3's low-latency *method*: the plan's choice at ``rows_of(w)`` rows
    for each workload, prefixed by the row count where it is not the batch's token count."""
    cls = optional(f"vllm.models.kimi_k3.nvidia.low_latency_gemm:{method}")
    if cls is None:
        return
    skinny_ok, dsv3_ok = _gemm_availability()
    for role, model in models:
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if type(qm) is not cls:
                continue
            tiers = [_plan_choice(qm, w.tokens, skinny_ok, dsv3_ok) if rows_of is None else
                     f"M={rows_of(role, w)}: {_plan_choice(qm, rows_of(role, w), skinny_ok, dsv3_ok)}" for w in works]
            yield role, name, tiers, f"{cls.__module__}:{cls.__qualname__}._plan"


def lane_low_latency_gemm(models, vllm_config, works):
    """K3's shape-selected decode GEMMs: the per-M plan KimiK3LowLatencyLinearMethod consults on each call
    (built by vLLM from its measured table for this SM), then the runtime gates it checks on the host."""
    return _plan_lane(models, works, "KimiK3LowLatencyLinearMethod", None)


def _specialized(model, vllm_config):
    """K3's specialized decode, as far as vLLM's own constructor goes before it builds anything (its prepared
    batch sizes, query widths, MLA core policy): None where the layout does not ask for it."""
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    config = getattr(lm, "specialized_decode_config", None)
    if config is None:
        return None
    mod = importlib.import_module("vllm.models.kimi_k3.nvidia.specialized_decode.runtime.decode")
    planner = mod.SpecializedDecode.__new__(mod.SpecializedDecode)
    # the constructor up to its first device work (building the CuTe providers): its batch plan and layers
    with capture(mod.SpecializedDecode, "build_providers"):
        try:
            mod.SpecializedDecode.__init__(planner, lm.model, config)
        except Stop:
            pass
    _PLANNED[id(planner)] = (model, vllm_config)
    return planner


#: per planner built here, the model and config it was built for, then the :class:`_Batches` built from them (its
#: plan is asked with their runner's metadata)
_PLANNED: dict = {}


def _plan_takes(planner, cg: str, padded: int, w: Workload) -> bool:
    """vLLM's own answer (``SpecializedDecode.plan``) to whether the specialized decode takes a step: the step
    replayed as vLLM dispatched it (``cg``: a graph captured at ``padded`` tokens, or eager), each layer given
    the metadata of that batch (a padded FULL graph holds whole decode or verify requests): for KDA layers what
    vLLM's runner builds (:class:`_Batches`), for MLA layers their request counts. Stand-ins make the objects plan
    reads exist: the forward context, a stream that is capturing exactly when the step replays a graph."""
    import torch

    mod = importlib.import_module(type(planner).__module__)
    kda = importlib.import_module("vllm.models.kimi_k3.nvidia.kda")
    verify = w.phase == "verify"
    q = w.per_request if verify else 1
    batch = Workload(w.phase, padded, max(1, padded // q), q) if w.phase != "prefill" else w
    metadata = {}
    batches = _PLANNED[id(planner)]
    with _KdaProbe(kda):  # its stand-ins for what the metadata builder does on the device
        for layer in planner.layers:
            attention = layer.self_attn
            name = mod.layer_name(attention)
            if isinstance(attention, kda.KimiK3DeltaAttention):
                # the KDA metadata vLLM's runner builds for this batch (:class:`_Batches`)
                if not isinstance(batches, _Batches):
                    batches = _PLANNED[id(planner)] = _Batches(*batches)
                metadata[name] = batches.metadata(attention, batches.rows(batch))
            else:  # MLA: the request counts its metadata carries (no speculative fields)
                reqs = batch.requests if batch.phase != "prefill" else 0
                metadata[name] = types.SimpleNamespace(
                    num_prefills=1 if batch.phase == "prefill" else 0, num_decodes=reqs,
                    num_decode_tokens=batch.tokens if batch.phase != "prefill" else 0)
    modes = importlib.import_module("vllm.config").CUDAGraphMode
    context = types.SimpleNamespace(attn_metadata=metadata, cudagraph_runtime_mode=getattr(modes, cg),
                                    slot_mapping=None)
    guard = fence.guard(PLAN_PROBE)
    swaps = [(mod, "get_forward_context", guard(lambda: context)),
             (mod, "is_forward_context_available", guard(lambda: True)),
             (torch.cuda, "is_current_stream_capturing", guard(lambda: cg != "NONE"))]
    saved = [(m, n, getattr(m, n)) for m, n, _ in swaps]
    try:
        for m, n, fn in swaps:
            setattr(m, n, fn)
        return planner.plan(meta(padded, dtype=torch.int64), None) is not None
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)


def _describe(planner) -> str:
    return "SpecializedDecode.batches " + ",".join(map(str, planner.batches))


#: K3's specialized decode serves the steps its planner takes (the shared serving-path lane asks it per step)
STEP_PATH = StepPath("specialized decode", _specialized, _plan_takes, _describe)


def lane_specialized_decode(models, vllm_config, works):
    """What the specialized decode runs for a step it takes, at the depth the simulation reaches: its MLA core
    per batch (vLLM's core_for), its input projection policy (projection_policies); its CuTe experts, KDA kernel
    and o-projection are built and sized on the device (not simulated)."""
    for role, model in models:
        if role != "target":
            continue
        try:
            planner = _specialized(model, vllm_config)
        except Exception:
            planner = None
        if planner is None:
            continue
        core_for = optional("vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.mla.prepared:core_for")
        tiers = []
        for i, w in enumerate(works):
            path = SERVING_PATHS.get((role, i))
            if path is None or not path[2]:
                tiers.append(not_taken("the stock path serves this step"))
                continue
            batch = path[1]
            try:
                core = core_for(batch // planner.q if planner.q > 1 else batch, planner.mla_core, planner.q) \
                    if core_for is not None and getattr(planner, "dcp", 1) <= 1 else "tokenspeed (DCP)"
            except Exception as exc:
                core = f"not resolved ({err(exc)})"
            tiers.append(f"specialized decode at batch {batch}: MLA core {core}; experts, KDA and projections: "
                         "CuTe DSL kernels compiled and sized for the device (needs GPU)")
        yield role, "", tiers, "vllm.models.kimi_k3.nvidia.specialized_decode.runtime.decode:SpecializedDecode"


def _logits_rows(role: str, w: Workload) -> int:
    """Rows the lm_head computes for a step. The target's: one per request for a decode step, the last token of a
    prefill chunk, every verified token (vLLM's runner gathers hidden states at its logits indices). A draft
    head's: one per request at every draft step, whatever the target step was (vLLM's speculator samples each
    request's last hidden state: ``sample_hidden_states = last_hidden_states[last_token_indices]``)."""
    if role != "target":
        return w.requests
    return {"decode": w.requests, "prefill": 1, "verify": w.tokens}.get(w.phase, w.tokens)


def lane_lm_head(models, vllm_config, works):
    """The lm_head's low-latency GEMM plan (K3's per-M table, KimiK3LowLatencyEmbeddingMethod), at the number of
    logits rows of each step, the target's and the draft head's."""
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "parallel_drafting", False) and any(role == "draft" for role, _ in models):
        # a parallel drafter (DSpark) computes the draft logits of every drafted position in one GEMM before its
        # sequential sampling: requests x its speculator's num_speculative_steps rows (_sample_sequential)
        steps = int(draft_speculator(vllm_config).num_speculative_steps)
        return _plan_lane(models, works, "KimiK3LowLatencyEmbeddingMethod",
                          lambda role, w: w.requests * steps if role != "target" else _logits_rows(role, w))
    return _plan_lane(models, works, "KimiK3LowLatencyEmbeddingMethod", _logits_rows)


def lane_down_proj_overlap(models, vllm_config, works):
    """K3's routed-expert down projection beside the router: KimiMoE._maybe_overlap_router_and_down_proj hands
    maybe_execute_in_parallel an auxiliary stream or None by the step's token count; inside a breakable (PIECEWISE)
    capture maybe_execute_in_parallel runs both on one stream."""
    moe_cls = optional("vllm.models.kimi_k3.nvidia.model:KimiMoE")
    if moe_cls is None or not hasattr(moe_cls, "_maybe_overlap_router_and_down_proj"):
        return
    mod = importlib.import_module(moe_cls.__module__)
    for role, model in models:
        for name, moe in model.named_modules():
            if not isinstance(moe, moe_cls) or getattr(moe, "routed_expert_down_proj", None) is None:
                continue
            hidden = moe.gate.weight.shape[1] if hasattr(moe, "gate") else None
            tiers = []
            for i, w in enumerate(works):
                with capture(mod, "maybe_execute_in_parallel") as seen:
                    try:
                        moe._maybe_overlap_router_and_down_proj(meta(w.tokens, hidden))
                    except Stop:
                        pass
                    except Exception as exc:
                        tiers.append(not_resolved(err(exc)))
                        continue
                args = list(seen.get("args", ())) + list(seen.get("kwargs", {}).values())
                if len(args) < 5:
                    tiers.append(not_resolved("maybe_execute_in_parallel was not reached"))
                    continue
                stream = args[4]
                path = SERVING_PATHS.get(("target", i))
                if stream is None:
                    tiers.append("sequential (no auxiliary stream at this token count)")
                elif path is not None and path[0] == "PIECEWISE":
                    tiers.append("sequential (inside a breakable capture maybe_execute_in_parallel uses one stream)")
                else:
                    tiers.append("overlapped on the auxiliary stream")
            yield role, name, tiers, f"{moe_cls.__module__}:{moe_cls.__qualname__}._maybe_overlap_router_and_down_proj"


def lane_kda_projection_overlap(models, vllm_config, works):
    """K3 KDA's input projections split over two streams for small steps: enabled at construction only for CUDA
    weights at TP8, and the token bound is widened by FlashInfer autotuning at kernel warmup; it applies only
    while a CUDA graph is being captured. All of that happens on the device: stated, not guessed."""
    kda_cls = optional("vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention")
    if kda_cls is None:
        return
    for role, model in models:
        for name, layer in model.named_modules():
            if not isinstance(layer, kda_cls) or not hasattr(layer, "_projection_overlap_max_tokens"):
                continue
            tiers = []
            for i, w in enumerate(works):
                path = SERVING_PATHS.get(("target", i))
                if path is not None and path[0] == "NONE":
                    tiers.append("not overlapped (an eager step: the overlap applies only while a graph is captured)")
                else:
                    tiers.append(needs_gpu("the bound is set for CUDA weights at construction and widened by "
                                           "FlashInfer's autotuning at kernel warmup (autotune_kda_qkvg)"))
            yield role, name, tiers, f"{kda_cls.__module__}:{kda_cls.__qualname__}.forward (_projection_overlap_max_tokens)"


#: the KDA kernels ``_forward`` ends in, by the name it calls them (stopping there: nothing ran)
_KDA_CORES = {
    "flashinfer_packed_fused_kda_decode": "FlashInfer packed fused KDA decode (convolution fused)",
    "flashinfer_fused_kda_decode": "FlashInfer fused KDA decode (convolution fused)",
    "fused_kda_decode": "vLLM's fused_kda_decode CUDA op (convolution fused)",
    "fused_recurrent_kda": "FLA Triton fused_recurrent_kda (after causal_conv1d_update)",
    "fused_recurrent_kda_packed_decode": "FLA Triton fused_recurrent_kda_packed_decode (after causal_conv1d_update)",
    "chunk_kda_with_fused_gate": "FLA Triton chunk_kda_with_fused_gate (after causal_conv1d_fn)",
    "_flashkda_prefill": "FlashKDA prefill (after causal_conv1d_fn)",
    "_flashinfer_kda_prefill": "FlashInfer recurrent KDA prefill (after causal_conv1d_fn)",
    "_recoverssm_verify": "RecoverSSM verify",
}
#: decode requests riding along with a prefill chunk in the mixed batch
MIXED_DECODES = 8


def _spec_out(layer, empty, args, kwargs):
    """What ``fused_recurrent_kda`` returns, in shape: the output (``out`` when given, else of v's shape) and the
    final state, which K3's forward drops."""
    out = kwargs.get("out")
    if out is None:
        out = empty(kwargs["v"] if "v" in kwargs else args[2])
    return out, None


def _verify_out(layer, empty, args, kwargs):
    """What K3's ``_recoverssm_verify(m, mixed_qkv, g1, beta, conv_weights, cu_seqlens, out)`` returns, in shape:
    ``out`` when given, else one row per token of the spec rows' query."""
    import torch

    out = args[6] if len(args) > 6 else kwargs.get("out")
    if out is not None:
        return out
    tokens = (args[1] if len(args) > 1 else kwargs["mixed_qkv"]).shape[0]
    return torch.empty((1, tokens, layer.local_num_heads, layer.head_dim), dtype=torch.bfloat16, device="meta")


#: the kernels of a batch's speculative rows, which other rows of the same batch follow with a launch of their own
_SPEC_CORES = {"fused_recurrent_kda": _spec_out, "_recoverssm_verify": _verify_out}


#: fenced pieces (probes.core.fence): the stand-ins the KDA batch lane and the specialized decode's plan run under
KDA_PROBE = ("KDA batch probe stand-ins (forward context, short convolutions, state gather, workspace, kernel stops, "
             "the spec rows' kernel output, prefix-cache state slots, CUDA-graph staging, unpinned host copies)")
PLAN_PROBE = "specialized decode plan stand-ins (forward context, stream capture state)"


class _AlignedSlots:
    """Stands in for vLLM's prefix-cache state-slot context (``MambaSpecDecodeGPUContext``, built from the
    KV-cache block tables on the device): the aligned slot IDs of every request, in shape
    ([groups, requests, 1 + speculative blocks]); which slot holds a state decides no kernel."""

    is_initialized = True
    per_request = 1

    @fence.guard(KDA_PROBE)
    def compute_aligned_state_indices(self, seq_lens, num_reqs):
        import torch

        return torch.empty((1, num_reqs, self.per_request), dtype=torch.int32, device="meta")


class _Batches:
    """KDA metadata for a batch, built the way vLLM's runner builds it for the layout: the runner's own model
    state (``prepare_attn``: which rows are speculative under a draft method is its decision, and it changed
    between releases) hands the layer's own metadata builder (the backend's ``get_builder_cls``) the batch. The
    batch itself is only described: its requests' query lengths, whether each is prefilling, and each decode's
    draft count, with index tensors on the meta device. The model state is built by vLLM's generic hybrid
    constructor (a model's own state class may add work that has nothing to do with attention metadata: K3's
    builds the specialized decode, which its post-load step covers); ``prepare_attn`` is the class's own."""

    #: context a decode request has already computed (its tokens are in the KV cache; any positive length will do)
    CONTEXT = 1024

    def __init__(self, model, vllm_config):
        import torch

        self.torch, self.vllm_config = torch, vllm_config
        self.k = int(getattr(vllm_config, "num_speculative_tokens", 0) or 0)
        states = importlib.import_module("vllm.v1.worker.gpu.model_states")
        hybrid = importlib.import_module("vllm.v1.worker.gpu.model_states.mamba_hybrid")
        chooser = getattr(states, "resolve_model_state_cls", None)
        self.state_cls = chooser(vllm_config, model) if chooser is not None else hybrid.MambaHybridModelState
        if not issubclass(self.state_cls, hybrid.MambaHybridModelState):
            raise TypeError(f"vLLM's model state for this model is {self.state_cls.__qualname__}, not a hybrid one")
        self.state = self.state_cls.__new__(self.state_cls)
        hybrid.MambaHybridModelState.__init__(self.state, vllm_config, model, None, torch.device("meta"))
        self.slots = _AlignedSlots()
        if getattr(self.state, "_align_mode", False):
            # prefix caching keeps each request's state in aligned slots that a GPU kernel computes from the
            # KV-cache block tables; only their shape reaches the builder
            self.state._mamba_ctx = self.slots
        self.cudagraph_none = hybrid.CUDAGraphMode.NONE
        self.group_cls = importlib.import_module("vllm.v1.worker.utils").AttentionGroup
        self.builders: dict = {}

    def _group(self, layer):
        if layer.prefix not in self.builders:
            backend = layer.get_attn_backend()
            spec = layer.get_kv_cache_spec(self.vllm_config)
            builder = backend.get_builder_cls()(spec, [layer.prefix], self.vllm_config, self.torch.device("meta"))
            self.builders[layer.prefix] = self.group_cls(backend=backend, layer_names=[layer.prefix],
                                                         kv_cache_spec=spec, kv_cache_group_id=0,
                                                         metadata_builders=[builder])
        return self.builders[layer.prefix]

    def rows(self, w: Workload, decodes: int = 0) -> list[tuple[int, bool, int]]:
        """(query tokens, prefilling, drafts) per request, decode rows first as the runner orders them: a decode
        request carries no draft; a verify request k; a prefill chunk is one prompt's first chunk. *decodes*:
        decode requests beside a prefill chunk or a verify batch (a mixed batch)."""
        if w.phase == "prefill":
            return [(1, False, 0)] * decodes + [(w.tokens, True, 0)]
        if w.phase == "verify":  # the drafted rows, then decodes that drafted nothing
            return [(w.per_request, False, w.per_request - 1)] * w.requests + [(1, False, 0)] * decodes
        return [(1, False, 0)] * w.requests

    def metadata(self, layer, rows):
        import numpy as np

        torch = self.torch
        R = len(rows)
        qlens = np.array([q for q, _, _ in rows], dtype=np.int32)
        qsl = np.zeros(R + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        T = int(qsl[-1])
        seq = torch.tensor([q if pre else q + self.CONTEXT for q, pre, _ in rows], dtype=torch.int32)
        width = 2 + self.k
        batch = types.SimpleNamespace(
            num_reqs=R, num_tokens=T, num_reqs_after_padding=R, num_tokens_after_padding=T,
            query_start_loc_np=qsl, query_start_loc=meta(R + 1, dtype=torch.int32), max_query_len=int(qlens.max()),
            num_scheduled_tokens=qlens, seq_lens_cpu_upper_bound=seq, seq_lens=meta(R, dtype=torch.int32),
            is_prefilling_np=np.array([pre for _, pre, _ in rows], dtype=bool), prefill_runs_as_decode_np=None,
            idx_mapping=meta(R, dtype=torch.int64),
            num_draft_tokens_per_req=np.array([d for _, _, d in rows], dtype=np.int32) if self.k else None,
            dcp_local_seq_lens=None, positions=None, prompt_lens=None)
        group = self._group(layer)
        self.slots.per_request = 1 + int(getattr(group.kv_cache_spec, "num_speculative_blocks", 0) or 0)
        out = self.state_cls.prepare_attn(self.state, batch, self.cudagraph_none, [meta(R, width, dtype=torch.int32)],
                                          [meta(T, dtype=torch.int64)], [[group]],
                                          types.SimpleNamespace(kv_cache_groups=[group]))
        return out[layer.prefix]


class _Swaps:
    """A probe's stand-ins, ``self.swaps`` as (module, attribute, replacement): put in on entry, every original put
    back on exit."""

    swaps: list

    def __enter__(self):
        self.saved = [(m, name, getattr(m, name)) for m, name, _ in self.swaps if hasattr(m, name)]
        for m, name, fn in self.swaps:
            setattr(m, name, fn)
        return self

    def __exit__(self, *exc):
        for m, name, fn in self.saved:
            setattr(m, name, fn)


class _KdaProbe(_Swaps):
    """Runs one KDA layer's own ``_forward`` for batches described by their metadata (meta tensors) and names
    the KDA kernel each reaches. Stand-ins only make shapes exist: the forward context holds the batch's
    metadata; the layer's conv and recurrent state are meta tensors of its own state shapes; the short
    convolutions, the initial-state gather and the workspace return tensors of their output shapes; each KDA
    kernel stops the call when reached. Everything swapped is put back on exit."""

    def __init__(self, mod):
        import torch

        self.torch, self.mod, self.reached, self.context = torch, mod, [], None
        cores = importlib.import_module("vllm.models.kimi_k3.nvidia.ops.third_party.kda")
        ops = getattr(mod, "ops", None)

        guard = fence.guard(KDA_PROBE)

        def stop(name):
            @guard
            def grab(*args, **kwargs):
                self.reached.append(name)
                if name in _SPEC_CORES and self._more_rows():
                    # the speculative rows' kernel, with other rows in the batch: the forward goes on to theirs,
                    # so this returns an output of the spec rows' shape instead of stopping
                    return _SPEC_CORES[name](self.layer, empty, args, kwargs)
                raise Stop
            return grab

        def empty(x):  # an op's output of the input's shape (torch.empty_like's Python meta path is slow)
            return torch.empty(x.shape, dtype=x.dtype, device=x.device)

        @guard
        def conv_update(x, *args, out=None, **kwargs):
            return out if out is not None else empty(x)

        class _Workspace:
            @guard
            def get_simultaneous(self, *specs):
                return [torch.empty(tuple(shape), dtype=dt, device="meta") for shape, dt in specs]

        self.stop = stop
        self.swaps = [(mod, "get_forward_context", guard(lambda: self.context)),
                      (mod, "causal_conv1d_update", conv_update),
                      (mod, "causal_conv1d_fn", guard(lambda x, *a, **k: empty(x))),
                      (mod, "gather_initial_states",
                       guard(lambda state, indices, *a, **k: state.new_empty((indices.shape[0], *state.shape[1:])))),
                      (mod, "current_workspace_manager", guard(lambda: _Workspace()))]
        self.swaps += [(m, name, stop(name)) for m in (mod, cores) for name in _KDA_CORES if hasattr(m, name)]
        if ops is not None and hasattr(ops, "fused_kda_decode"):
            self.swaps.append((ops, "fused_kda_decode", stop("fused_kda_decode")))
        md_mod = optional("vllm.models.kimi_k3.nvidia.kda_metadata:KimiK3KDAMetadataBuilder")
        md_mod = importlib.import_module(md_mod.__module__) if md_mod is not None else None
        if hasattr(md_mod, "_mamba_get_block_table_tensor"):
            # the builder's prefix-cache slot gather (a Triton kernel on the device): the table as given, whose
            # first columns stand for the slots (which slot holds a state decides nothing)
            self.swaps.append((md_mod, "_mamba_get_block_table_tensor", guard(lambda table, *a, **k: table)))
        if hasattr(md_mod, "stage_spec_decode_metadata"):
            # copies the spec rows' indices into the builder's CUDA-graph buffers (a Triton kernel): the buffers
            # already have their shapes
            self.swaps.append((md_mod, "stage_spec_decode_metadata", guard(lambda *a, **k: None)))
        for name in ("vllm.utils.torch_utils", "vllm.v1.attention.backends.utils"):
            try:
                host = importlib.import_module(name)
            except Exception:
                continue
            # pinned host copies need a driver; unpinned ones carry the same values
            if hasattr(host, "PIN_MEMORY"):
                self.swaps.append((host, "PIN_MEMORY", False))
            if hasattr(host, "is_pin_memory_available"):
                self.swaps.append((host, "is_pin_memory_available", guard(lambda: False)))

    def _more_rows(self) -> bool:
        md = self.md
        return bool(getattr(md, "num_prefills", 0) or getattr(md, "num_decodes", 0))

    def kernel(self, layer, md, states: list) -> str:
        """``states``: the layer's conv and recurrent state (meta), with a slot for every request of the batch."""
        torch = self.torch
        T = md.num_actual_tokens
        heads, dim, proj = layer.local_num_heads, layer.head_dim, layer.local_projection_size
        bf16 = torch.bfloat16
        self.reached.clear()
        self.layer, self.md = layer, md
        self.context = types.SimpleNamespace(attn_metadata={layer.prefix: md})
        own = layer.__dict__  # plain attributes, set past nn.Module's __setattr__
        had_cache, cache = "kv_cache" in own, own.get("kv_cache")
        try:
            own["kv_cache"] = states
            own["_recoverssm_verify"] = self.stop("_recoverssm_verify")
            layer._forward(mixed_qkv=meta(T, 3 * proj, dtype=bf16), g1=meta(1, T, heads, dim, dtype=bf16),
                           g2=meta(T, heads, dim, dtype=bf16), beta=meta(1, T, heads, dtype=bf16),
                           core_attn_out=meta(1, T, heads, dim, dtype=bf16))
        except Stop:
            pass
        finally:
            if had_cache:
                own["kv_cache"] = cache
            else:
                own.pop("kv_cache", None)
            own.pop("_recoverssm_verify", None)
        if not self.reached:
            return "no KDA kernel reached (the forward returned without one)"
        texts = []
        for name in self.reached:
            text = _KDA_CORES[name]
            if name == "_recoverssm_verify":
                text += " (CuTe)" if getattr(layer, "recoverssm_verify", None) is not None else " (Triton)"
            texts.append(text)
        if len(texts) == 1:
            return texts[0]
        return f"{len(texts)} launches: {texts[0]} for the speculative rows, then " + ", then ".join(texts[1:])


def lane_kda_batch(models, vllm_config, works):
    """Which KDA kernel a batch reaches, by batch type: a pure decode batch, a prefill chunk and a verify batch,
    each alone and with MIXED_DECODES decode requests (no drafts) beside it (a mixed batch). vLLM's KDA layer chooses in
    its ``_forward`` from the batch's metadata and the backends it resolved at construction. The metadata is what
    vLLM's runner builds for the layout (:class:`_Batches`: under a draft method its model state decides which
    rows are speculative); this runs ``_forward`` (meta tensors) up to the kernel it calls, past the speculative
    rows' kernel when other rows follow with a launch of their own. Like every stock lane, it says what the stock
    forward runs; a step K3's specialized decode takes is served by its own KDA (``serving_path``)."""
    mod = optional("vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention")
    if mod is None:
        return
    kda = importlib.import_module(mod.__module__)
    with _KdaProbe(kda) as probe:
        for role, model in models:
            batches = None
            for name, layer in model.named_modules():
                if not isinstance(layer, mod):
                    continue
                tiers = []
                try:
                    if batches is None:
                        batches = _Batches(model, vllm_config)
                    slots = 2 + max(w.requests for w in works) + MIXED_DECODES
                    states = [meta(slots, *shape, dtype=dt)
                              for shape, dt in zip(layer.get_state_shape(), layer.get_state_dtype())]
                except Exception as exc:
                    yield role, name, [not_resolved(err(exc))] * len(works), f"{mod.__module__}:{mod.__qualname__}"
                    continue
                for w in works:
                    try:
                        md = batches.metadata(layer, batches.rows(w))
                        text = probe.kernel(layer, md, states)
                        if w.phase == "decode" and getattr(md, "num_spec_decodes", 0):
                            # vLLM's runner built these decode rows as speculative rows (the profile's batch
                            # route reads the prefix)
                            text = f"speculative rows: {text}"
                        if w.phase in ("prefill", "verify"):
                            mixed = probe.kernel(layer, batches.metadata(layer, batches.rows(w, MIXED_DECODES)),
                                                 states)
                            text = (f"{text} (alone or with {MIXED_DECODES} decode requests in the batch)"
                                    if mixed == text else f"alone: {text}; with {MIXED_DECODES} decode requests: {mixed}")
                    except Exception as exc:
                        text = not_resolved(err(exc))
                    tiers.append(text)
                yield role, name, tiers, f"{mod.__module__}:{mod.__qualname__}._forward"


#: fenced piece: the stand-ins the MLA KV-cache lane runs K3's MLA attention under
MLA_CACHE_PROBE = ("MLA KV-cache probe stand-ins (forward context, batch metadata, the paged cache, the fused "
                   "cache-insert ops, the attention core's stop)")
#: K3's fused MLA epilogues are CUDA ops its Python wrappers launch (after allocating their outputs): their names
_MLA_OPS = "fused_kimi_k3_mla_"


class _MlaCacheProbe(_Swaps):
    """Runs one K3 MLA layer's own ``_attention`` for a batch, up to its attention core, and names what it did with
    the KV cache: the fused cache-insert op its wrapper launched (K3's MLA dispatches it by cache dtype) and the
    dtype of the query the core receives (vLLM's decode query is quantized to the cache's fp8 or dequantized back
    when the backend takes no fp8 query; its prefill query dtype is the metadata builder's ``q_data_type``). A
    raise in vLLM's own code on the way (an assertion its policy makes) is the answer for that batch: the server
    fails there. Stand-ins only make shapes exist: the forward context holds metadata of the batch (the decode /
    prefill split as vLLM's ``split_decodes_and_prefills`` counts it with the builder's threshold, the builder's
    own prefill query dtype, no chunked context), the paged cache is a meta tensor of the layer's own KV-cache spec,
    the fused ops write nothing, and the attention core stops the call."""

    def __init__(self, mod, vllm_config):
        import torch

        self.torch, self.mod, self.vllm_config = torch, mod, vllm_config
        self.context, self.ops, self.core = None, [], None
        guard = self.guard = fence.guard(MLA_CACHE_PROBE)
        self.namespace = torch.ops._C
        # the ops K3's wrappers launch, by the names their code looks up on torch.ops._C
        wrappers = optional("vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache:"
                            "fused_mla_decode_q_concat_kv_cache_insert")
        wrappers = importlib.import_module(wrappers.__module__) if wrappers is not None else None
        self.op_names = sorted({n for f in vars(wrappers).values() if isinstance(f, types.FunctionType)
                                for n in f.__code__.co_names if n.startswith(_MLA_OPS)}) if wrappers else []

        def op(name):
            @guard
            def launched(*args, **kwargs):
                self.ops.append(name)  # writes its outputs in place: nothing to return
            return launched

        self.swaps = [(mod, "get_forward_context", guard(lambda: self.context))]
        self.swaps += [(self.namespace, n, op(n)) for n in self.op_names]

    def _prefill_query(self, builder) -> str:
        """Where the prefill query dtype came from: vLLM's metadata builder, from the attention config and vLLM's
        own check of the prefill backend."""
        mla = importlib.import_module("vllm.model_executor.layers.attention.mla_attention")
        wanted = getattr(self.vllm_config.attention_config, "use_prefill_query_quantization", None)
        text = (f" (the metadata builder's prefill query dtype is {str(builder.q_data_type).replace('torch.', '')}; "
                f"use_prefill_query_quantization is {wanted}")
        check = getattr(mla, "backend_supports_prefill_query_quantization", None)
        if wanted and check is not None:
            prefill = optional("vllm.v1.attention.backends.mla.prefill.selector:get_mla_prefill_backend")
            name = prefill(self.vllm_config).__name__ if prefill is not None else "the prefill backend"
            text += f"; vLLM's backend_supports_prefill_query_quantization() is {check()} with {name} on this SM"
        return text + ")"

    def path(self, layer, builder, w: Workload) -> str:
        torch = self.torch
        n_dec, _, n_dec_tokens, _ = mla_split(builder, w)
        T = w.tokens
        probe = self

        class _Core:
            """The prefill backend as the batch's metadata carries it: its own answers, and a stop at the kernel."""

            def __init__(self, real):
                self.real = real

            def supports_out(self):
                return fence.foreign(self.real.supports_out)

            @probe.guard
            def run_prefill_new_tokens(self, q, k, v, **_):
                probe.core = ("prefill", type(self.real).__name__, q.dtype)
                raise Stop

        impl = layer.impl

        @self.guard
        def forward_mqa(q, *args, **kwargs):
            probe.core = ("decode", type(impl).__name__, (q[0] if isinstance(q, tuple) else q).dtype)
            raise Stop

        spec = layer.get_kv_cache_spec(self.vllm_config)
        prefill = types.SimpleNamespace(q_data_type=builder.q_data_type, chunked_context=None,
                                        prefill_backend=_Core(layer.prefill_backend), output_dtype=None)
        md = types.SimpleNamespace(num_actual_tokens=T, num_decode_tokens=n_dec_tokens, num_decodes=n_dec,
                                   num_prefills=w.requests - n_dec, prefill=prefill if n_dec_tokens < T else None,
                                   query_start_loc=meta(w.requests + 1, dtype=torch.int32))
        self.context = types.SimpleNamespace(attn_metadata={layer.layer_name: md},
                                             slot_mapping={layer.layer_name: meta(T, dtype=torch.int64)})
        heads = layer.num_local_heads
        own = layer.__dict__
        had_cache, cache = "kv_cache" in own, own.get("kv_cache")
        self.ops.clear()
        self.core = None
        try:
            own["kv_cache"] = meta(64, spec.block_size, spec.head_size, dtype=spec.dtype)
            impl.__dict__["forward_mqa"] = forward_mqa  # the instance's attribute, over its class's method
            layer._attention(meta(T, dtype=torch.int64), meta(T, heads, layer.qk_head_dim),
                             meta(T, layer.kv_lora_rank), meta(T, layer.qk_rope_head_dim),
                             meta(T, heads * layer.v_head_dim))
        except Stop:
            pass
        except AssertionError as exc:
            # an assertion on vLLM's own line about what this lane feeds it from vLLM's own decisions (the cache
            # dtype, the builder's query dtype), with no word of the simulation: vLLM's policy refusing the batch.
            # Ours is a fault; anything else (a tensor check, a library's assertion) is a limit, as in stages.
            if fence.check_origin(MLA_CACHE_PROBE, exc) or not _vllm_assertion(exc):
                raise
            return raises(f"AssertionError: {str(exc)[:300]}{self._prefill_query(builder) if n_dec_tokens < T else ''}")
        finally:
            impl.__dict__.pop("forward_mqa", None)
            if had_cache:
                own["kv_cache"] = cache
            else:
                own.pop("kv_cache", None)
        cache = layer.kv_cache_dtype
        cache = f"{str(spec.dtype).replace('torch.', '')} ({cache})" if cache == "auto" else cache
        if self.core is None:
            return not_resolved("the attention core was not reached")
        phase, core, qdtype = self.core
        query = str(qdtype).replace("torch.", "").replace("float8_e4m3fn", "fp8")
        insert = ", ".join(self.ops) or "no fused cache insert"
        note = ""
        if phase == "decode" and "fp8" in insert and query != "fp8":
            note = (f" (dequantized for {core}: its supports_quant_query_input is "
                    f"{getattr(impl, 'supports_quant_query_input', None)})")
        return f"{cache} cache, {query} query{note}: {insert}, then {core}"


def _vllm_assertion(exc: BaseException) -> bool:
    """Whether *exc* is an ``assert`` statement of a vLLM source file whose message does not name the simulation."""
    import linecache
    import traceback

    from probes.core.stages import SIMULATION_WORDS

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    line = (linecache.getline(last.filename, last.lineno) or last.line or "").strip()
    return ("/vllm/" in last.filename.replace("\\", "/") and line.startswith("assert")
            and not SIMULATION_WORDS.search(str(exc)))


def lane_mla_kv_cache(models, vllm_config, works):
    """What K3's MLA does with its KV cache on a batch: the cache dtype, the fused cache-insert op (K3 dispatches
    it by cache dtype, in ``_decode_concat_cache`` and ``_forward_prefill_fused``) and the query dtype its
    attention core receives, or vLLM's raise where its fp8 policy refuses the batch. :class:`_MlaCacheProbe` runs
    the layer's own ``_attention`` (meta tensors) up to the core."""
    cls = optional("vllm.models.kimi_k3.nvidia.mla:MultiHeadLatentAttention")
    if cls is None or not hasattr(cls, "_attention"):
        return
    with _MlaCacheProbe(importlib.import_module(cls.__module__), vllm_config) as probe:
        builders: dict = {}
        for role, model in models:
            for name, layer in model.named_modules():
                if not isinstance(layer, cls):
                    continue
                key = (type(layer.attn_backend), type(layer.impl))
                try:
                    if key not in builders:
                        builders[key] = _mla_builder(layer, vllm_config)
                    builder = builders[key]
                except Exception as exc:
                    yield role, name, [not_resolved(err(exc))] * len(works), f"{cls.__module__}:{cls.__qualname__}"
                    continue
                tiers = []
                for w in works:
                    try:
                        tiers.append(probe.path(layer, builder, w))
                    except Exception as exc:
                        tiers.append(not_resolved(err(exc)))
                yield role, name, tiers, f"{cls.__module__}:{cls.__qualname__}._attention"


LANES = (
    ("specialized_decode", lane_specialized_decode),
    ("latent_tail", lane_latent_tail),
    ("down_proj_overlap", lane_down_proj_overlap),
    ("low_latency_gemm", lane_low_latency_gemm),
    ("lm_head", lane_lm_head),
    ("kda_projection_overlap", lane_kda_projection_overlap),
    ("kda_batch", lane_kda_batch),
    ("mla_kv_cache", lane_mla_kv_cache),
)
