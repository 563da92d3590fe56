"""Resolve mode's dispatch stage: vLLM's own per-call choices at representative token counts.

Some K3 lanes pick a sub-kernel on every call from the number of tokens in the batch (and from shapes,
config, SM and environment variables). After the model is built (and after the post-load stage, when
it ran), this stage calls the pinned vLLM's *own* dispatch functions on the constructed modules for
a set of workloads:

* decode batches of 1, 8, 64 and 256 requests (one token each);
* prefill chunks of 512, 2048 and 8192 tokens (one request);
* with speculative decoding, the verify width: the same batches with 1 + num_speculative_tokens
  tokens each.

Tensors the functions take are meta tensors of the shape and dtype the call would see (they only
read shapes). A choice that only a GPU can make (an autotuned tactic, a measured timing, a gate that
reads device pointers) is recorded as ``needs GPU: ...`` with the reason, never guessed. A function
that could not be called (moved, or it needed more than shapes) is recorded as ``not resolved: ...``.

Each lane emits one ``dispatch`` record per (lane, role, group) and set of layers with the same tier
table; a ``dispatch-stage`` record says how long the stage took and which lanes failed. Nothing
here raises into the cell: construction's evidence always stands.

Which functions are called, and why, is in docs/notes/dispatch-0.33.md.
Imported only inside the pinned environment, after the model was built.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import time
import types

from probes.core.recorder import describe

DECODE_BATCHES = (1, 8, 64, 256)
PREFILL_CHUNKS = (512, 2048, 8192)
LEVEL = "dispatch"
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _layer(name: str) -> int | None:
    m = _LAYER_RE.search(name or "")
    return int(m.group(1)) if m else None


def _group_name(name: str) -> str:
    """A module's name with its layer index taken out (``model.layers.7.mlp.experts`` -> ``mlp.experts``)."""
    return _LAYER_RE.split(name, maxsplit=1)[-1] if _LAYER_RE.search(name) else name


def _attr(spec: str):
    module, _, qual = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _optional(spec: str):
    try:
        return _attr(spec)
    except (ImportError, AttributeError):
        return None


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


@dataclasses.dataclass(frozen=True)
class Workload:
    phase: str       # decode | prefill | verify
    tokens: int      # tokens in the batch (what a layer's input has as its first dimension)
    requests: int    # requests in the batch
    per_request: int  # query tokens of each request

    def as_dict(self) -> dict:
        return {"phase": self.phase, "tokens": self.tokens, "requests": self.requests}


def workloads(vllm_config) -> list[Workload]:
    out = [Workload("decode", b, b, 1) for b in DECODE_BATCHES]
    out += [Workload("prefill", n, 1, n) for n in PREFILL_CHUNKS]
    spec = getattr(vllm_config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    if k > 0:
        out += [Workload("verify", b * (1 + k), b, 1 + k) for b in DECODE_BATCHES]
    return out


def _meta(*shape, dtype=None):
    import torch

    return torch.empty(*shape, dtype=dtype or torch.bfloat16, device="meta")


class _Stop(Exception):
    """Raised by a capture to stop vLLM's function at the first kernel it would launch."""


@contextlib.contextmanager
def _capture(module, name: str):
    """Replace ``module.name`` (a kernel entry a dispatch function calls once it has chosen) for the
    duration of one call: it records its arguments and stops the call. Restored on exit."""
    seen: dict = {}
    original = getattr(module, name)

    def grab(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Stop

    setattr(module, name, grab)
    try:
        yield seen
    finally:
        setattr(module, name, original)


# --- lanes ------------------------------------------------------------------------------------------
# Each lane: (models, vllm_config, works) -> iterable of (role, module name, tiers, source), where
# tiers is [{"phase", "tokens", "requests", "choice"}] in workload order.

def _runner_base():
    return _optional("vllm.model_executor.layers.fused_moe.runner.moe_runner_interface:MoERunnerInterface") or ()


def _runners(model):
    base = _runner_base()
    for name, module in model.named_modules():
        if base and isinstance(module, base):
            yield name, module


def lane_latent_tail(models, vllm_config, works):
    """K3's latent MoE tail: LatentMoERunner._use_fused_path, moe_config.should_defer_moe_finalize
    and LatentMoERunner._select_tail_tier, called per token count."""
    runner_cls = _optional("vllm.models.kimi_k3.nvidia.latent_moe_runner:LatentMoERunner") or \
        _optional("vllm.model_executor.layers.fused_moe.runner.latent_moe_runner:LatentMoERunner")
    if runner_cls is None:
        return
    for role, model in models:
        for name, runner in _runners(model):
            if not isinstance(runner, runner_cls):
                continue
            tiers = []
            fused = runner._use_fused_path() if hasattr(runner, "_use_fused_path") else None
            select = getattr(runner, "_select_tail_tier", None)
            transform = getattr(runner, "routed_output_transform", None)
            for w in works:
                if fused is None or select is None:
                    choice = "not resolved: this LatentMoERunner has no tail-tier selector"
                elif not fused:
                    choice = "native runner path (no fused tail: _use_fused_path() is False)"
                else:
                    try:
                        choice = _tail_choice(runner, select, transform, w.tokens)
                    except Exception as exc:
                        choice = f"not resolved: {_err(exc)}"
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
    tier = select(_meta(tokens, latent), _meta(tokens, hidden))
    return getattr(tier, "name", str(tier))


def lane_shared_overlap(models, vllm_config, works):
    """Whether the shared experts run on the auxiliary stream: SharedExperts._determine_shared_experts_order."""
    for role, model in models:
        for name, runner in _runners(model):
            shared = getattr(runner, "shared_experts", None)
            decide = getattr(shared, "_determine_shared_experts_order", None)
            if decide is None:
                continue
            hidden = runner.moe_config.hidden_dim
            tiers = []
            for w in works:
                try:
                    order = decide(_meta(w.tokens, hidden))
                    tiers.append(getattr(order, "name", str(order)))
                except Exception as exc:  # e.g. the MoE kernel is built at post-load and was not reached
                    tiers.append(f"not resolved: {_err(exc)}")
            yield role, name, tiers, f"{type(shared).__module__}:{type(shared).__qualname__}._determine_shared_experts_order"


def _experts_of(runner):
    qm = getattr(runner, "_quant_method", None) or getattr(runner, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    cls = type(experts) if experts is not None else getattr(qm, "experts_cls", None)
    return qm, experts, cls


def _humming_block(runner, experts, tokens: int, vllm_config) -> str:
    mod = importlib.import_module(type(experts).__module__)
    from vllm.forward_context import set_forward_context

    import torch

    topk = runner.moe_config.experts_per_token
    topk_ids = torch.empty(tokens, topk, dtype=torch.int32, device="meta")
    with set_forward_context(None, vllm_config), _capture(mod, "moe_align_block_size") as seen:
        try:
            experts.prepare_humming_moe_kwargs(topk_ids, None, None)
        except _Stop:
            pass
    if "kwargs" not in seen:
        return "not resolved: prepare_humming_moe_kwargs did not reach moe_align_block_size"
    block = seen["kwargs"].get("block_size", seen["args"][1] if len(seen["args"]) > 1 else "?")
    return f"block_size_m={block} (humming tuning config)"


def _marlin_block(runner, experts, tokens: int, vllm_config) -> str:
    mod = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    import torch

    layer = getattr(runner, "routed_experts", runner)  # the module holding the experts' weights
    w1, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if w1 is None or w2 is None:
        return "not resolved: the layer has no w13_weight/w2_weight"
    topk = runner.moe_config.experts_per_token
    hidden = runner.moe_config.hidden_dim  # the experts' activation width (the latent size for latent MoE)
    with _capture(mod, "moe_align_block_size") as seen:
        try:
            mod.fused_marlin_moe(
                _meta(tokens, hidden), w1, w2, None, None, experts.w1_scale, experts.w2_scale,
                torch.empty(tokens, topk, dtype=torch.float32, device="meta"),
                torch.empty(tokens, topk, dtype=torch.int32, device="meta"),
                quant_type_id=experts.quant_type_id,
                global_num_experts=runner.moe_config.num_experts,
                input_dtype=getattr(experts, "input_dtype", None))
        except _Stop:
            pass
    if "args" not in seen:
        return "not resolved: fused_marlin_moe did not reach moe_align_block_size"
    return f"block_size_m={seen['args'][1]}"


#: experts classes whose per-call kernel variant a GPU decides
_TRTLLM = "FlashInfer's AutoTuner picks the TRTLLM-Gen tactic"
_GPU_EXPERTS = {
    "TrtLlmMxfp4ExpertsMonolithic": _TRTLLM,
    "TrtLlmMxfp4ExpertsModular": _TRTLLM,
    "TrtLlmNvFp4ExpertsMonolithic": _TRTLLM,
    "DeepGemmFP4Experts": "DeepGEMM's runtime picks the grouped GEMM's configuration per call",
    "DeepGemmMegaMoEExperts": "BLOCK_M from DeepGEMM's MegaMoE scheduler, sized by a symmetric buffer allocated on the device",
    "KimiK3MegaMoEExperts": "BLOCK_M from DeepGEMM's MegaMoE scheduler, sized by a symmetric buffer allocated on the device",
    "HummingGroupedExperts": "Humming's kernel launcher picks the config from the tuning table built at load by "
                             "the rows routed to this rank (M) on each call; it depends on M",
}
#: MegaMoE experts are a module of their own, with no MoE runner around them
_MEGAMOE = ("DeepGemmMegaMoEExperts", "KimiK3MegaMoEExperts")
#: experts classes whose per-call variant this stage resolves
_RESOLVERS = {
    "HummingIndexedExperts": _humming_block,
    "MarlinExperts": _marlin_block,
}


def lane_moe_experts(models, vllm_config, works):
    """The routed experts' per-call kernel variant (tile / block size by M), or what decides it."""
    for role, model in models:
        for name, runner in _runners(model):
            qm, experts, cls = _experts_of(runner)
            if cls is None:
                continue
            cname = cls.__name__
            tiers = []
            source = f"{cls.__module__}:{cls.__qualname__}"
            for w in works:
                if cname in _GPU_EXPERTS:
                    kind = "autotuned" if _GPU_EXPERTS[cname] is _TRTLLM else "chosen on the device"
                    choice = f"needs GPU: {kind} ({_GPU_EXPERTS[cname]}"
                    bucket = _optional("vllm.model_executor.layers.fused_moe.utils:fi_moe_largest_bucket")
                    if bucket is not None and _GPU_EXPERTS[cname] is _TRTLLM:
                        with contextlib.suppress(Exception):
                            choice += f", tuned to {bucket(runner.moe_config)} tokens"
                    choice += ")"
                    defer = getattr(runner.moe_config, "should_defer_moe_finalize", None)
                    if defer is not None and defer(w.tokens):
                        choice += "; top-k finalize deferred"
                elif cname in _RESOLVERS:
                    if experts is None:
                        choice = ("not resolved: the experts kernel (and the block-size table it carries) is built at "
                                  "post-load, which stopped before building it here")
                    else:
                        try:
                            choice = _RESOLVERS[cname](runner, experts, w.tokens, vllm_config)
                        except Exception as exc:
                            choice = f"not resolved: {_err(exc)}"
                else:
                    choice = (f"not resolved: this stage has no resolver for {cname}'s per-call choice "
                              "(it may depend on the token count)")
                tiers.append(choice)
            yield role, name, tiers, source
        for name, module in model.named_modules():
            cls = type(module)
            if cls.__name__ in _MEGAMOE and not (_runner_base() and isinstance(module, _runner_base())):
                why = _GPU_EXPERTS[cls.__name__]
                yield role, name, [f"needs GPU: chosen on the device ({why})"] * len(works), \
                    f"{cls.__module__}:{cls.__qualname__}"


def _mla_layers(model):
    """Attention layers built on an MLA backend (vLLM's MLAAttention, or K3's own MultiHeadLatentAttention)."""
    for name, module in model.named_modules():
        backend = getattr(module, "attn_backend", None)
        if backend is None or getattr(module, "impl", None) is None or not hasattr(module, "get_kv_cache_spec"):
            continue
        with contextlib.suppress(Exception):
            if "MLA" in str(backend.get_name()).upper():
                yield name, module


def _attn_metadata(w: Workload):
    """vLLM's CommonAttentionMetadata for a batch of ``w`` (CPU tensors; only the fields the split reads)."""
    import torch

    cls = _attr("vllm.v1.attention.backend:CommonAttentionMetadata")
    kw = {f.name: None for f in dataclasses.fields(cls)
          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    qsl = torch.arange(0, w.tokens + 1, w.per_request, dtype=torch.int32)
    kw.update(query_start_loc=qsl, query_start_loc_cpu=qsl, num_reqs=w.requests, num_actual_tokens=w.tokens,
              max_query_len=w.per_request, max_seq_len=w.per_request)
    md = cls(**kw)
    if "is_prefilling" in {f.name for f in dataclasses.fields(cls)}:
        md = dataclasses.replace(md, is_prefilling=torch.full((w.requests,), w.phase == "prefill"))
    return md


def _mla_builder(layer, vllm_config):
    import torch

    backend = layer.attn_backend
    spec = layer.get_kv_cache_spec(vllm_config)
    return backend.get_builder_cls()(spec, [layer.layer_name], vllm_config, torch.device("meta"))


def _mla_decode_kernel(impl, w: Workload) -> str:
    name = type(impl).__name__
    if name == "FlashInferMLAImpl":
        select = _attr("vllm.v1.attention.backends.mla.flashinfer_mla:_select_mla_decode_backend")
        if getattr(impl, "dcp_world_size", 1) > 1:
            backend = "cute-dsl"
        else:
            backend = select(impl.num_heads)
        ragged = " (ragged multi-token queries)" if w.per_request > 1 else ""
        if backend:
            return f"FlashInfer MLA decode backend={backend}{ragged}"
        return ("needs GPU: autotuned (FlashInfer MLA decode backend=auto: its AutoTuner picks trtllm-gen "
                f"or cute-dsl){ragged}")
    if name == "TritonMLAImpl":
        return "Triton decode_attention (split-KV count from max_seq_len and SM count, not token count)"
    if name == "FlashAttnMLAImpl":
        return "needs GPU: FA3 MLA decode (splits chosen by the FA scheduler on the device)"
    return f"{name} decode"


def lane_mla(models, vllm_config, works):
    """Which path a batch takes through MLA: the metadata builder's decode/prefill split
    (split_decodes_and_prefills with the builder's threshold), then the decode kernel or the prefill backend."""
    split = _attr("vllm.v1.attention.backends.utils:split_decodes_and_prefills")
    qls = _optional("vllm.v1.attention.backend:QueryLenSupport")
    builders: dict = {}
    for role, model in models:
        for name, layer in _mla_layers(model):
            impl = getattr(layer, "impl", None)
            key = (type(layer.attn_backend), type(impl))
            if key not in builders:
                try:
                    builders[key] = _mla_builder(layer, vllm_config)
                except Exception as exc:
                    builders[key] = exc
            builder = builders[key]
            prefill = getattr(layer, "prefill_backend", None) or getattr(impl, "prefill_backend", None)
            tiers = []
            for w in works:
                if isinstance(builder, Exception):
                    tiers.append(f"not resolved: the metadata builder could not be built ({_err(builder)})")
                    continue
                support = getattr(builder, "query_len_support", None)
                n_dec, n_pre, _, _ = split(
                    _attn_metadata(w), decode_threshold=builder.reorder_batch_threshold,
                    require_uniform=(qls is not None and support != qls.VARLEN),
                    treat_short_extends_as_decodes=not getattr(builder, "use_pcp", False))
                if n_pre == 0:
                    tiers.append(f"decode path: {_mla_decode_kernel(impl, w)}")
                elif n_dec == 0:
                    tiers.append(f"prefill path: {type(prefill).__name__ if prefill is not None else 'none'}")
                else:
                    tiers.append(f"split: {n_dec} decode / {n_pre} prefill requests")
            yield role, name, tiers, ("vllm.v1.attention.backends.utils:split_decodes_and_prefills "
                                      f"(threshold {getattr(builder, 'reorder_batch_threshold', '?')})")


def _config_text(config) -> str:
    """A SkinnyGemmConfig without its row count (the M it is for): ``block_size=224 outputs_per_block=3 ...``."""
    if not dataclasses.is_dataclass(config):
        return str(config)
    return " ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
                    if f.name != "num_rows" and getattr(config, f.name) is not None)


def _gemm_availability() -> tuple[bool, bool]:
    """Whether the CuTe skinny GEMM and the dsv3 fused-A op the low-latency plans name are usable here."""
    import torch

    skinny = _optional("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm:shape_dynamic_skinny_gemm")
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


def lane_low_latency_gemm(models, vllm_config, works):
    """K3's shape-selected decode GEMMs: the per-M plan KimiK3LowLatencyLinearMethod consults on each call
    (built by vLLM from its measured table for this SM), then the runtime gates it checks on the host."""
    cls = _optional("vllm.models.kimi_k3.nvidia.low_latency_gemm:KimiK3LowLatencyLinearMethod")
    if cls is None:
        return
    skinny_ok, dsv3_ok = _gemm_availability()
    for role, model in models:
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if type(qm) is not cls:
                continue
            tiers = [_plan_choice(qm, w.tokens, skinny_ok, dsv3_ok) for w in works]
            yield role, name, tiers, f"{cls.__module__}:{cls.__qualname__}._plan"


# --- the path a batch takes: its CUDA-graph mode, and the specialized decode ------------------------------

def _bind(fn, **kwargs):
    """``fn`` called with the keyword arguments its signature takes (vLLM's signatures grow by release)."""
    import inspect

    params = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _min_cudagraph_support(vllm_config):
    """The least CUDA-graph support among the attention backends' metadata builders, as vLLM's GPU model
    runner computes it before it resolves the graph mode (each builder class's own get_cudagraph_support)."""
    layers_of = _attr("vllm.config:get_layers_from_vllm_config")
    base = _attr("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase") \
        if _optional("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase") else \
        _attr("vllm.attention.layer:AttentionLayerBase")
    support_cls = _attr("vllm.v1.attention.backend:AttentionCGSupport")
    support, name = support_cls.ALWAYS, None
    for layer in layers_of(vllm_config, base).values():
        spec = layer.get_kv_cache_spec(vllm_config)
        if spec is None:
            continue
        backend = layer.get_attn_backend()
        s = backend.get_builder_cls().get_cudagraph_support(vllm_config, spec)
        if s.value < support.value:
            support, name = s, backend.__name__
    return support, name


def _graph_manager(model, vllm_config):
    """vLLM's V2 model runner's CUDA-graph manager for this deployment, in the state it is in once its graphs
    are captured at startup: the mode vLLM resolves from the attention backends' support, the capture sizes of
    the config. Its ``dispatch`` is the runner's own per-step decision."""
    import copy

    import torch

    cls = _optional("vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager") or \
        _attr("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager")
    spec = getattr(vllm_config, "speculative_config", None)
    q = int(getattr(spec, "num_speculative_tokens", 0) or 0) + 1 if spec is not None else 1
    support, name = _min_cudagraph_support(vllm_config)
    cc = copy.copy(vllm_config.compilation_config)  # resolving writes the mode back; the cell's config stays
    envs = importlib.import_module("vllm.envs")
    mode = _bind(cc.resolve_cudagraph_mode_and_sizes, min_cg_support=support, min_cg_attn_backend=name,
                 uniform_decode_query_len=q, use_v2_model_runner=True, kv_cache_config=None,
                 max_num_reqs=vllm_config.scheduler_config.max_num_seqs, is_profiling=False,
                 piecewise_capture_available=bool(getattr(envs, "VLLM_USE_BREAKABLE_CUDAGRAPH", False)))
    config = copy.copy(vllm_config)
    config.compilation_config = cc
    manager = cls.__new__(cls)
    _bind(manager.__init__, vllm_config=config, device=torch.device("cuda", 0), cudagraph_mode=mode,
          decode_query_len=q)
    return manager, mode, q


def _graph_step(manager, w: Workload):
    """(mode name, padded tokens, uniform count) vLLM's dispatch gives a step of workload ``w``."""
    uniform_of = _optional("vllm.v1.worker.utils:get_uniform_decode_token_count")
    prefill = w.phase == "prefill"
    uniform = uniform_of(w.requests, w.tokens, w.per_request, decode_graph_eligible=not prefill) \
        if uniform_of is not None else None
    desc = _bind(manager.dispatch, num_reqs=w.requests, num_tokens=w.tokens, uniform_token_count=uniform,
                 num_active_loras=0, max_query_len=None if prefill else w.per_request)
    return getattr(desc.cg_mode, "name", str(desc.cg_mode)), int(desc.num_tokens), uniform


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
    with _capture(mod.SpecializedDecode, "build_providers"):
        try:
            mod.SpecializedDecode.__init__(planner, lm.model, config)
        except _Stop:
            pass
    return planner


def _plan_takes(planner, cg: str, padded: int, w: Workload) -> bool:
    """vLLM's own answer (``SpecializedDecode.plan``) to whether the specialized decode takes a step: the step
    replayed as vLLM dispatched it (``cg``: a graph captured at ``padded`` tokens, or eager), each layer given
    the metadata of that batch (a padded FULL graph holds whole decode or verify requests). Stand-ins make the
    objects plan reads exist: the forward context, a stream that is capturing exactly when the step replays a
    graph, and per layer the batch's request counts."""
    import torch

    mod = importlib.import_module(type(planner).__module__)
    kda = importlib.import_module("vllm.models.kimi_k3.nvidia.kda")
    verify = w.phase == "verify"
    q = w.per_request if verify else 1
    batch = Workload(w.phase, padded, max(1, padded // q), q) if w.phase != "prefill" else w
    metadata = {}
    for layer in planner.layers:
        attention = layer.self_attn
        name = mod.layer_name(attention)
        if isinstance(attention, kda.KimiK3DeltaAttention):
            metadata[name] = _kda_metadata(kda.KimiK3KDAMetadata, batch)
        else:  # MLA: the request counts its metadata carries (no speculative fields)
            reqs = batch.requests if batch.phase != "prefill" else 0
            metadata[name] = types.SimpleNamespace(
                num_prefills=1 if batch.phase == "prefill" else 0, num_decodes=reqs,
                num_decode_tokens=batch.tokens if batch.phase != "prefill" else 0)
    modes = importlib.import_module("vllm.config").CUDAGraphMode
    context = types.SimpleNamespace(attn_metadata=metadata, cudagraph_runtime_mode=getattr(modes, cg),
                                    slot_mapping=None)
    swaps = [(mod, "get_forward_context", lambda: context), (mod, "is_forward_context_available", lambda: True),
             (torch.cuda, "is_current_stream_capturing", lambda: cg != "NONE")]
    saved = [(m, n, getattr(m, n)) for m, n, _ in swaps]
    try:
        for m, n, fn in swaps:
            setattr(m, n, fn)
        return planner.plan(_meta(padded, dtype=torch.int64), None) is not None
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)


#: set by lane_serving_path for the lanes after it: per role, per workload index, (mode, padded, specialized?)
_PATHS: dict = {}


def lane_serving_path(models, vllm_config, works):
    """Which path serves each workload: the CUDA-graph mode vLLM's GPU model runner dispatches the step to (FULL
    graphs replay with no Python; PIECEWISE graphs here are K3's breakable graphs, whose KDA and MLA attention run
    eagerly on every replay), and, where the layout has K3's specialized decode, whether it takes the step: it
    does when the step replays a FULL graph whose padded batch is one of its prepared batch sizes (and, with
    speculation, a uniform verify of its query width), else the stock forward runs."""
    _PATHS.clear()
    for role, model in models:
        if role != "target":
            continue
        try:
            manager, mode, q = _graph_manager(model, vllm_config)
            manager._graphs_captured = True  # the state after vLLM captures its graphs at startup
        except Exception as exc:
            yield role, "", [f"not resolved: vLLM's CUDA-graph manager could not be built ({_err(exc)})"] * len(works), \
                "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.dispatch"
            return
        try:
            planner = _specialized(model, vllm_config)
        except Exception as exc:
            planner = exc
        tiers = []
        for i, w in enumerate(works):
            try:
                cg, padded, uniform = _graph_step(manager, w)
            except Exception as exc:
                tiers.append(f"not resolved: {_err(exc)}")
                continue
            text = {"FULL": "FULL graph", "PIECEWISE": "PIECEWISE graph (breakable: attention eager)",
                    "NONE": "eager"}.get(cg, cg) + f", {padded} tokens"
            takes = None
            if isinstance(planner, Exception):
                text += f"; specialized decode not resolved ({_err(planner)})"
            elif planner is not None:
                try:
                    takes = _plan_takes(planner, cg, padded, w)
                    text += ": specialized decode" if takes else ": stock path (specialized decode not taken)"
                except Exception as exc:
                    text += f"; specialized decode not resolved ({_err(exc)})"
            _PATHS[(role, i)] = (cg, padded, takes)
            tiers.append(text)
        source = f"{type(manager).__module__}:{type(manager).__qualname__}.dispatch (mode {getattr(mode, 'name', mode)})"
        if planner is not None and not isinstance(planner, Exception):
            source += "; SpecializedDecode.batches " + ",".join(map(str, planner.batches))
        yield role, "", tiers, source


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
        core_for = _optional("vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.mla.prepared:core_for")
        tiers = []
        for i, w in enumerate(works):
            path = _PATHS.get((role, i))
            if path is None or not path[2]:
                tiers.append("not taken: the stock path serves this step")
                continue
            batch = path[1]
            try:
                core = core_for(batch // planner.q if planner.q > 1 else batch, planner.mla_core, planner.q) \
                    if core_for is not None and getattr(planner, "dcp", 1) <= 1 else "tokenspeed (DCP)"
            except Exception as exc:
                core = f"not resolved ({_err(exc)})"
            tiers.append(f"specialized decode at batch {batch}: MLA core {core}; experts, KDA and projections: "
                         "CuTe DSL kernels compiled and sized for the device (needs GPU)")
        yield role, "", tiers, "vllm.models.kimi_k3.nvidia.specialized_decode.runtime.decode:SpecializedDecode"


# --- more per-call lanes ---------------------------------------------------------------------------------------

def _logits_rows(w: Workload) -> int:
    """Rows the lm_head computes for a step: one per request for a decode step, the last token of a prefill
    chunk, every verified token (vLLM's runner gathers hidden states at its logits indices)."""
    return {"decode": w.requests, "prefill": 1, "verify": w.tokens}.get(w.phase, w.tokens)


def lane_lm_head(models, vllm_config, works):
    """The lm_head's low-latency GEMM plan (K3's per-M table, KimiK3LowLatencyEmbeddingMethod), at the number of
    logits rows of each step."""
    cls = _optional("vllm.models.kimi_k3.nvidia.low_latency_gemm:KimiK3LowLatencyEmbeddingMethod")
    if cls is None:
        return
    skinny_ok, dsv3_ok = _gemm_availability()
    for role, model in models:
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if type(qm) is not cls:
                continue
            tiers = []
            for w in works:
                m = _logits_rows(w)
                tiers.append(f"M={m}: {_plan_choice(qm, m, skinny_ok, dsv3_ok)}")
            yield role, name, tiers, f"{cls.__module__}:{cls.__qualname__}._plan"


def lane_router(models, vllm_config, works):
    """The MoE router GEMM's tier: GateLinear.forward, run on a meta batch, stopped at the kernel it picks."""
    gate_cls = _optional("vllm.model_executor.layers.fused_moe.router.gate_linear:GateLinear")
    ll = _optional("vllm.model_executor.kernels.linear.cute_dsl.ll_bf16:ll_bf16_gemm")
    if gate_cls is None:
        return
    ll_mod = importlib.import_module("vllm.model_executor.kernels.linear.cute_dsl.ll_bf16") if ll else None
    import torch

    for role, model in models:
        for name, gate in model.named_modules():
            if not isinstance(gate, gate_cls):
                continue
            k = gate.weight.shape[1]
            tiers = []
            for w in works:
                x = torch.empty(w.tokens, k, dtype=torch.bfloat16, device="meta")
                seen: dict = {}
                try:
                    with (_capture(ll_mod, "ll_bf16_gemm") if ll_mod else contextlib.nullcontext({})) as seen, \
                            _Calls() as calls:
                        gate.forward(x)
                except _Stop:
                    pass
                except Exception as exc:
                    tiers.append(f"not resolved: {_err(exc)}")
                    continue
                if "args" in seen:
                    key = ll_mod.ll_bf16_gemm_kernel.dispatch(M=w.tokens, K=k, N=gate.weight.shape[0])
                    variant = f"{key.backend} bs={key.bs}" if key.backend == "dotprod" else \
                        f"{key.backend} split_k={key.split_k} stages={key.num_stages}"
                    tiers.append(f"CuTe ll_bf16_gemm ({variant})")
                else:
                    tiers.append(calls.first_gemm() or "not resolved: no GEMM was reached")
            yield role, name, tiers, f"{gate_cls.__module__}:{gate_cls.__qualname__}.forward"


class _Calls:
    """Records the torch-level GEMM calls a function makes (a TorchFunctionMode), to name the one it reached."""

    _GEMMS = {"mm": "cuBLAS torch.mm", "linear": "F.linear (cuBLAS)", "matmul": "torch.matmul (cuBLAS)"}

    def __enter__(self):
        import torch

        outer = self

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types_, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in _Calls._GEMMS:
                    outer.seen.append((name, kwargs or {}))
                return func(*args, **(kwargs or {}))

        self.seen: list = []
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False

    def first_gemm(self) -> str:
        if not self.seen:
            return ""
        name, kwargs = self.seen[0]
        out = kwargs.get("out_dtype")
        return self._GEMMS[name] + (f" (out_dtype {str(out).replace('torch.', '')})" if out is not None else "")


def lane_down_proj_overlap(models, vllm_config, works):
    """K3's routed-expert down projection beside the router: KimiMoE._maybe_overlap_router_and_down_proj hands
    maybe_execute_in_parallel an auxiliary stream or None by the step's token count; inside a breakable (PIECEWISE)
    capture maybe_execute_in_parallel runs both on one stream."""
    moe_cls = _optional("vllm.models.kimi_k3.nvidia.model:KimiMoE")
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
                with _capture(mod, "maybe_execute_in_parallel") as seen:
                    try:
                        moe._maybe_overlap_router_and_down_proj(_meta(w.tokens, hidden))
                    except _Stop:
                        pass
                    except Exception as exc:
                        tiers.append(f"not resolved: {_err(exc)}")
                        continue
                args = list(seen.get("args", ())) + list(seen.get("kwargs", {}).values())
                if len(args) < 5:
                    tiers.append("not resolved: maybe_execute_in_parallel was not reached")
                    continue
                stream = args[4]
                path = _PATHS.get(("target", i))
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
    kda_cls = _optional("vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention")
    if kda_cls is None:
        return
    for role, model in models:
        for name, layer in model.named_modules():
            if not isinstance(layer, kda_cls) or not hasattr(layer, "_projection_overlap_max_tokens"):
                continue
            tiers = []
            for i, w in enumerate(works):
                path = _PATHS.get(("target", i))
                if path is not None and path[0] == "NONE":
                    tiers.append("not overlapped (an eager step: the overlap applies only while a graph is captured)")
                else:
                    tiers.append("needs GPU: the bound is set for CUDA weights at construction and widened by "
                                 "FlashInfer's autotuning at kernel warmup (autotune_kda_qkvg)")
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


def _kda_metadata(cls, w: Workload, decodes: int = 0):
    """The metadata of a batch as vLLM's KDA builder describes it to the layer: how many prefill, decode and
    verify requests and tokens, and index tensors (meta) of their shapes. It only says what the batch *is*;
    which kernel serves it is decided by the layer's own ``_forward``."""
    import torch

    verify = w.phase == "verify"
    prefills = 1 if w.phase == "prefill" else 0
    plain = w.requests if w.phase == "decode" else decodes
    spec = w.requests if verify else 0
    non_spec_reqs = prefills + plain
    i32 = torch.int32
    md = cls(num_prefills=prefills, num_prefill_tokens=w.tokens if prefills else 0, num_decodes=plain,
             num_decode_tokens=plain, num_spec_decodes=spec, num_spec_decode_tokens=w.tokens if verify else 0,
             num_actual_tokens=(w.tokens if w.phase != "decode" else 0) + plain)
    if non_spec_reqs:
        md.non_spec_state_indices_tensor = _meta(non_spec_reqs, dtype=i32)
        md.non_spec_query_start_loc = _meta(non_spec_reqs + 1, dtype=i32)
        md.has_initial_state = _meta(non_spec_reqs, dtype=torch.bool)
    if spec:
        md.spec_state_indices_tensor = _meta(spec, w.per_request, dtype=i32)
        md.spec_query_start_loc = _meta(spec + 1, dtype=i32)
        md.num_accepted_tokens = _meta(spec, dtype=i32)
    return md


class _KdaProbe:
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

        def stop(name):
            def grab(*args, **kwargs):
                self.reached.append(name)
                raise _Stop
            return grab

        def empty(x):  # an op's output of the input's shape (torch.empty_like's Python meta path is slow)
            return torch.empty(x.shape, dtype=x.dtype, device=x.device)

        def conv_update(x, *args, out=None, **kwargs):
            return out if out is not None else empty(x)

        class _Workspace:
            def get_simultaneous(self, *specs):
                return [torch.empty(tuple(shape), dtype=dt, device="meta") for shape, dt in specs]

        self.stop = stop
        self.swaps = [(mod, "get_forward_context", lambda: self.context), (mod, "causal_conv1d_update", conv_update),
                      (mod, "causal_conv1d_fn", lambda x, *a, **k: empty(x)),
                      (mod, "gather_initial_states",
                       lambda state, indices, *a, **k: state.new_empty((indices.shape[0], *state.shape[1:]))),
                      (mod, "current_workspace_manager", lambda: _Workspace())]
        self.swaps += [(m, name, stop(name)) for m in (mod, cores) for name in _KDA_CORES if hasattr(m, name)]
        if ops is not None and hasattr(ops, "fused_kda_decode"):
            self.swaps.append((ops, "fused_kda_decode", stop("fused_kda_decode")))

    def __enter__(self):
        self.saved = [(m, name, getattr(m, name)) for m, name, _ in self.swaps if hasattr(m, name)]
        for m, name, fn in self.swaps:
            setattr(m, name, fn)
        return self

    def __exit__(self, *exc):
        for m, name, fn in self.saved:
            setattr(m, name, fn)

    def kernel(self, layer, md, states: list) -> str:
        """``states``: the layer's conv and recurrent state (meta), with a slot for every request of the batch."""
        torch = self.torch
        T = md.num_actual_tokens
        heads, dim, proj = layer.local_num_heads, layer.head_dim, layer.local_projection_size
        bf16 = torch.bfloat16
        self.reached.clear()
        self.context = types.SimpleNamespace(attn_metadata={layer.prefix: md})
        own = layer.__dict__  # plain attributes, set past nn.Module's __setattr__
        had_cache, cache = "kv_cache" in own, own.get("kv_cache")
        try:
            own["kv_cache"] = states
            own["_recoverssm_verify"] = self.stop("_recoverssm_verify")
            layer._forward(mixed_qkv=_meta(T, 3 * proj, dtype=bf16), g1=_meta(1, T, heads, dim, dtype=bf16),
                           g2=_meta(T, heads, dim, dtype=bf16), beta=_meta(1, T, heads, dtype=bf16),
                           core_attn_out=_meta(1, T, heads, dim, dtype=bf16))
        except _Stop:
            pass
        finally:
            if had_cache:
                own["kv_cache"] = cache
            else:
                own.pop("kv_cache", None)
            own.pop("_recoverssm_verify", None)
        if not self.reached:
            return "no KDA kernel reached (the forward returned without one)"
        name = self.reached[0]
        text = _KDA_CORES[name]
        if name == "_recoverssm_verify":
            text += " (CuTe)" if getattr(layer, "recoverssm_verify", None) is not None else " (Triton)"
        return text


def lane_kda_batch(models, vllm_config, works):
    """Which KDA kernel a batch reaches, by batch type: a pure decode batch, a prefill chunk alone and with
    MIXED_DECODES decode requests beside it (a mixed batch), and a verify batch. vLLM's KDA layer chooses in
    its ``_forward`` from the batch's request counts and the backends it resolved at construction; this runs
    that ``_forward`` (meta tensors) up to the kernel it calls. Like every stock lane, it says what the stock
    forward runs; a step K3's specialized decode takes is served by its own KDA (``serving_path``)."""
    mod = _optional("vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention")
    if mod is None:
        return
    kda = importlib.import_module(mod.__module__)
    md_cls = getattr(kda, "KimiK3KDAMetadata", None)
    with _KdaProbe(kda) as probe:
        for role, model in models:
            for name, layer in model.named_modules():
                if not isinstance(layer, mod):
                    continue
                if md_cls is None:  # the batch's metadata class moved: the lane says so on every KDA layer
                    yield (role, name, [f"not resolved: {mod.__module__} has no KimiK3KDAMetadata"] * len(works),
                           f"{mod.__module__}:{mod.__qualname__}")
                    continue
                tiers = []
                try:
                    slots = 2 + max(w.requests for w in works) + MIXED_DECODES
                    states = [_meta(slots, *shape, dtype=dt)
                              for shape, dt in zip(layer.get_state_shape(), layer.get_state_dtype())]
                except Exception as exc:
                    yield role, name, [f"not resolved: {_err(exc)}"] * len(works), f"{mod.__module__}:{mod.__qualname__}"
                    continue
                for w in works:
                    try:
                        text = probe.kernel(layer, _kda_metadata(md_cls, w), states)
                        if w.phase == "prefill":
                            mixed = probe.kernel(layer, _kda_metadata(md_cls, w, decodes=MIXED_DECODES), states)
                            text = (f"{text} (alone or with {MIXED_DECODES} decode requests in the batch)"
                                    if mixed == text else f"alone: {text}; with {MIXED_DECODES} decode requests: {mixed}")
                    except Exception as exc:
                        text = f"not resolved: {_err(exc)}"
                    tiers.append(text)
                yield role, name, tiers, f"{mod.__module__}:{mod.__qualname__}._forward"


LANES = (
    ("serving_path", lane_serving_path),
    ("specialized_decode", lane_specialized_decode),
    ("latent_tail", lane_latent_tail),
    ("shared_overlap", lane_shared_overlap),
    ("moe_experts", lane_moe_experts),
    ("router", lane_router),
    ("down_proj_overlap", lane_down_proj_overlap),
    ("mla", lane_mla),
    ("low_latency_gemm", lane_low_latency_gemm),
    ("lm_head", lane_lm_head),
    ("kda_projection_overlap", lane_kda_projection_overlap),
    ("kda_batch", lane_kda_batch),
)


def run(models, vllm_config, rec) -> None:
    """Resolve every lane at every workload for the built models; record, never raise."""
    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    lane_seconds: dict[str, float] = {}
    try:
        from vllm.config import set_current_vllm_config

        works = workloads(vllm_config)
        named = [(role, m) for role, m in models if m is not None]
        with set_current_vllm_config(vllm_config):
            for lane, fn in LANES:
                t_lane = time.perf_counter()
                try:
                    _emit(rec, lane, fn(named, vllm_config, works), works)
                except Exception as exc:  # one lane's failure hides nothing of the others
                    errors[lane] = _err(exc)
                lane_seconds[lane] = round(time.perf_counter() - t_lane, 3)
    except Exception as exc:
        errors["stage"] = _err(exc)
    rec.emit("dispatch-stage", seconds=round(time.perf_counter() - t0, 3), errors=errors, lane_seconds=lane_seconds,
             workloads=[w.as_dict() for w in works] if "works" in locals() else [])


def _emit(rec, lane: str, rows, works) -> None:
    groups: dict[tuple, dict] = {}
    for role, name, tiers, source in rows:
        tiers = [str(describe(t)) if not isinstance(t, str) else t for t in tiers]
        key = (role, _group_name(name), tuple(tiers), source)
        g = groups.setdefault(key, {"layers": [], "modules": 0})
        layer = _layer(name)
        if layer is not None and layer not in g["layers"]:
            g["layers"].append(layer)
        g["modules"] += 1
    for (role, group, tiers, source), g in groups.items():
        rec.emit("dispatch", lane=lane, role=role, group=group, layers=sorted(g["layers"]), level=LEVEL,
                 source=source, tiers=[{**w.as_dict(), "choice": c} for w, c in zip(works, tiers)])
