"""Resolve mode's dispatch stage: vLLM's own per-call choices at representative token counts.

Some lanes pick a sub-kernel on every call from the number of tokens in the batch (and from shapes,
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
that could not be called (moved, or it needed more than shapes) is recorded as ``not resolved: ...``
(both written by :mod:`probes.core.tiers`, which the host reads them with).

Each lane emits one ``dispatch`` record per (lane, role, group) and set of layers with the same tier
table; a ``dispatch-stage`` record says how long the stage took and which lanes failed. Nothing
here raises into the cell: construction's evidence always stands.

Which functions are called, and why, is in docs/notes/dispatch-0.33.md.
Imported only inside the pinned environment, after the model was built.
"""
from __future__ import annotations

import contextlib

from probes.core import fence
import dataclasses
import importlib
import re
import time

from probes import models as models_probes
from probes.core.recorder import describe
from probes.core.tiers import needs_gpu, not_resolved, step_path, stock_path
from probes.schemes import TRTLLM_AUTOTUNED

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


def optional(spec: str):
    try:
        return _attr(spec)
    except (ImportError, AttributeError):
        return None


def err(exc: BaseException) -> str:
    """An exception that leaves a tier unresolved, in a line; one the harness's own code raised is a fault too."""
    fence.check_origin("dispatch", exc)
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


def meta(*shape, dtype=None):
    import torch

    return torch.empty(*shape, dtype=dtype or torch.bfloat16, device="meta")


class Stop(Exception):
    """Raised by a capture to stop vLLM's function at the first kernel it would launch (it passes the fence: a
    deliberate stop, not a harness fault)."""

    __serving_truth_passes__ = True


#: the fenced piece of every capture (probes.core.fence)
CAPTURE = "dispatch capture (a kernel entry that records its arguments and stops the call)"


@contextlib.contextmanager
def capture(module, name: str):
    """Replace ``module.name`` (a kernel entry a dispatch function calls once it has chosen) for the
    duration of one call: it records its arguments and stops the call. Restored on exit."""
    seen: dict = {}
    original = getattr(module, name)

    @fence.guard(CAPTURE)
    def grab(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise Stop

    setattr(module, name, grab)
    try:
        yield seen
    finally:
        setattr(module, name, original)


# --- lanes ------------------------------------------------------------------------------------------
# Each lane: (models, vllm_config, works) -> iterable of (role, module name, tiers, source), where
# tiers is [{"phase", "tokens", "requests", "choice"}] in workload order.

def _runner_base():
    return optional("vllm.model_executor.layers.fused_moe.runner.moe_runner_interface:MoERunnerInterface") or ()


def runners(model):
    base = _runner_base()
    for name, module in model.named_modules():
        if base and isinstance(module, base):
            yield name, module


def lane_shared_overlap(models, vllm_config, works):
    """Whether the shared experts run on the auxiliary stream: SharedExperts._determine_shared_experts_order."""
    for role, model in models:
        for name, runner in runners(model):
            shared = getattr(runner, "shared_experts", None)
            decide = getattr(shared, "_determine_shared_experts_order", None)
            if decide is None:
                continue
            hidden = runner.moe_config.hidden_dim
            tiers = []
            for w in works:
                try:
                    order = decide(meta(w.tokens, hidden))
                    tiers.append(getattr(order, "name", str(order)))
                except Exception as exc:  # e.g. the MoE kernel is built at post-load and was not reached
                    tiers.append(not_resolved(err(exc)))
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
    with set_forward_context(None, vllm_config), capture(mod, "moe_align_block_size") as seen:
        try:
            experts.prepare_humming_moe_kwargs(topk_ids, None, None)
        except Stop:
            pass
    if "kwargs" not in seen:
        return not_resolved("prepare_humming_moe_kwargs did not reach moe_align_block_size")
    block = seen["kwargs"].get("block_size", seen["args"][1] if len(seen["args"]) > 1 else "?")
    return f"block_size_m={block} (humming tuning config)"


def _marlin_block(runner, experts, tokens: int, vllm_config) -> str:
    mod = importlib.import_module("vllm.model_executor.layers.fused_moe.experts.marlin_moe")
    import torch

    layer = getattr(runner, "routed_experts", runner)  # the module holding the experts' weights
    w1, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if w1 is None or w2 is None:
        return not_resolved("the layer has no w13_weight/w2_weight")
    topk = runner.moe_config.experts_per_token
    hidden = runner.moe_config.hidden_dim  # the experts' activation width (the latent size for latent MoE)
    with capture(mod, "moe_align_block_size") as seen:
        try:
            mod.fused_marlin_moe(
                meta(tokens, hidden), w1, w2, None, None, experts.w1_scale, experts.w2_scale,
                torch.empty(tokens, topk, dtype=torch.float32, device="meta"),
                torch.empty(tokens, topk, dtype=torch.int32, device="meta"),
                quant_type_id=experts.quant_type_id,
                global_num_experts=runner.moe_config.num_experts,
                input_dtype=getattr(experts, "input_dtype", None))
        except Stop:
            pass
    if "args" not in seen:
        return not_resolved("fused_marlin_moe did not reach moe_align_block_size")
    return f"block_size_m={seen['args'][1]}"


#: experts classes whose per-call kernel variant a GPU decides, of no one quantization scheme (a scheme's own are
#: its ``DEVICE_EXPERTS``)
_GPU_EXPERTS = {
    "HummingGroupedExperts": "Humming's kernel launcher picks the config from the tuning table built at load by "
                             "the rows routed to this rank (M) on each call; it depends on M",
}


def _device_experts() -> dict[str, str]:
    """Experts classes whose per-call variant the device picks: vLLM's shared ones, its quantization schemes' and the
    model's own."""
    return {**_GPU_EXPERTS, **models_probes.current().device_experts}
#: experts classes whose per-call variant this stage resolves
_RESOLVERS = {
    "HummingIndexedExperts": _humming_block,
    "MarlinExperts": _marlin_block,
}


def lane_moe_experts(models, vllm_config, works):
    """The routed experts' per-call kernel variant (tile / block size by M), or what decides it."""
    device = _device_experts()
    modules = models_probes.current().experts_modules
    for role, model in models:
        for name, runner in runners(model):
            qm, experts, cls = _experts_of(runner)
            if cls is None:
                continue
            cname = cls.__name__
            tiers = []
            source = f"{cls.__module__}:{cls.__qualname__}"
            for w in works:
                if cname in device:
                    kind = "autotuned" if device[cname] == TRTLLM_AUTOTUNED else "chosen on the device"
                    choice = needs_gpu(f"{kind} ({device[cname]}")
                    bucket = optional("vllm.model_executor.layers.fused_moe.utils:fi_moe_largest_bucket")
                    if bucket is not None and device[cname] == TRTLLM_AUTOTUNED:
                        with contextlib.suppress(Exception):
                            choice += f", tuned to {bucket(runner.moe_config)} tokens"
                    choice += ")"
                    defer = getattr(runner.moe_config, "should_defer_moe_finalize", None)
                    if defer is not None and defer(w.tokens):
                        choice += "; top-k finalize deferred"
                elif cname in _RESOLVERS:
                    if experts is None:
                        choice = not_resolved("the experts kernel (and the block-size table it carries) is built at "
                                              "post-load, which stopped before building it here")
                    else:
                        try:
                            choice = _RESOLVERS[cname](runner, experts, w.tokens, vllm_config)
                        except Exception as exc:
                            choice = not_resolved(err(exc))
                else:
                    choice = not_resolved(f"this stage has no resolver for {cname}'s per-call choice "
                                          "(it may depend on the token count)")
                tiers.append(choice)
            yield role, name, tiers, source
        for name, module in model.named_modules():
            cls = type(module)
            if cls.__name__ in modules and not (_runner_base() and isinstance(module, _runner_base())):
                why = device[cls.__name__]
                yield role, name, [needs_gpu(f"chosen on the device ({why})")] * len(works), \
                    f"{cls.__module__}:{cls.__qualname__}"


def _mla_layers(model):
    """Attention layers built on an MLA backend (vLLM's MLAAttention, or a model's own MLA layer class)."""
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
        return needs_gpu("autotuned (FlashInfer MLA decode backend=auto: its AutoTuner picks trtllm-gen "
                         f"or cute-dsl){ragged}")
    if name == "TritonMLAImpl":
        return "Triton decode_attention (split-KV count from max_seq_len and SM count, not token count)"
    if name == "FlashAttnMLAImpl":
        return needs_gpu("FA3 MLA decode (splits chosen by the FA scheduler on the device)")
    return f"{name} decode"


def mla_split(builder, w: Workload) -> tuple:
    """vLLM's decode/prefill split of a batch of ``w`` as an MLA metadata builder makes it
    (``split_decodes_and_prefills`` with the builder's threshold and query-length support): (decode requests,
    prefill requests, decode tokens, prefill tokens)."""
    split = _attr("vllm.v1.attention.backends.utils:split_decodes_and_prefills")
    qls = optional("vllm.v1.attention.backend:QueryLenSupport")
    support = getattr(builder, "query_len_support", None)
    return split(_attn_metadata(w), decode_threshold=builder.reorder_batch_threshold,
                 require_uniform=(qls is not None and support != qls.VARLEN),
                 treat_short_extends_as_decodes=not getattr(builder, "use_pcp", False))


def lane_mla(models, vllm_config, works):
    """Which path a batch takes through MLA: the metadata builder's decode/prefill split
    (split_decodes_and_prefills with the builder's threshold), then the decode kernel or the prefill backend."""
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
                    tiers.append(not_resolved(f"the metadata builder could not be built ({err(builder)})"))
                    continue
                n_dec, n_pre, _, _ = mla_split(builder, w)
                if n_pre == 0:
                    tiers.append(f"decode path: {_mla_decode_kernel(impl, w)}")
                elif n_dec == 0:
                    tiers.append(f"prefill path: {type(prefill).__name__ if prefill is not None else 'none'}")
                else:
                    tiers.append(f"split: {n_dec} decode / {n_pre} prefill requests")
            yield role, name, tiers, ("vllm.v1.attention.backends.utils:split_decodes_and_prefills "
                                      f"(threshold {getattr(builder, 'reorder_batch_threshold', '?')})")


# --- the path a batch takes: its CUDA-graph mode, and a path of the model's own ---------------------------------

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
        if optional("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase") else \
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

    cls = optional("vllm.v1.worker.gpu.cudagraph_utils:ModelCudaGraphManager") or \
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
    uniform_of = optional("vllm.v1.worker.utils:get_uniform_decode_token_count")
    prefill = w.phase == "prefill"
    uniform = None
    if uniform_of is not None:
        import inspect

        params = inspect.signature(uniform_of).parameters
        if "decode_graph_eligible" in params:  # vLLM 0.31+
            uniform = uniform_of(w.requests, w.tokens, w.per_request, decode_graph_eligible=not prefill)
        elif "has_prefill" in params:  # vLLM 0.28-0.30: the same question, asked the other way round
            uniform = uniform_of(w.requests, w.tokens, w.per_request, has_prefill=prefill)
        else:
            raise TypeError(f"get_uniform_decode_token_count{inspect.signature(uniform_of)} takes neither "
                            "decode_graph_eligible nor has_prefill: the harness does not fit this vLLM")
    desc = _bind(manager.dispatch, num_reqs=w.requests, num_tokens=w.tokens, uniform_token_count=uniform,
                 num_active_loras=0, max_query_len=None if prefill else w.per_request)
    return getattr(desc.cg_mode, "name", str(desc.cg_mode)), int(desc.num_tokens), uniform


#: set by lane_serving_path for the lanes after it: per role, per workload index, (mode, padded, own path taken?)
SERVING_PATHS: dict = {}


def lane_serving_path(models, vllm_config, works):
    """Which path serves each workload: the CUDA-graph mode vLLM's GPU model runner dispatches the step to (FULL
    graphs replay with no Python; PIECEWISE graphs are vLLM's breakable graphs, whose attention runs eagerly on
    every replay), and, where the model has a path of its own that serves some steps (its probes package's
    ``STEP_PATH``) and the layout asks for it, whether that path takes the step (vLLM's own answer), else the stock
    forward runs."""
    SERVING_PATHS.clear()
    path = models_probes.current().step_path
    for role, model in models:
        if role != "target":
            continue
        try:
            manager, mode, q = _graph_manager(model, vllm_config)
            manager._graphs_captured = True  # the state after vLLM captures its graphs at startup
        except Exception as exc:
            yield role, "", [not_resolved(f"vLLM's CUDA-graph manager could not be built ({err(exc)})")] * len(works), \
                "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.dispatch"
            return
        try:
            planner = path.build(model, vllm_config) if path is not None else None
        except Exception as exc:
            planner = exc
        tiers = []
        for i, w in enumerate(works):
            try:
                cg, padded, uniform = _graph_step(manager, w)
            except Exception as exc:
                tiers.append(not_resolved(err(exc)))
                continue
            text = {"FULL": "FULL graph", "PIECEWISE": "PIECEWISE graph (breakable: attention eager)",
                    "NONE": "eager"}.get(cg, cg) + f", {padded} tokens"
            takes = None
            if isinstance(planner, Exception):
                text += f"; {path.name} not resolved ({err(planner)})"
            elif planner is not None:
                try:
                    takes = path.takes(planner, cg, padded, w)
                    text = step_path(text, path.name) if takes else stock_path(text, path.name)
                except Exception as exc:
                    text += f"; {path.name} not resolved ({err(exc)})"
            SERVING_PATHS[(role, i)] = (cg, padded, takes)
            tiers.append(text)
        source = f"{type(manager).__module__}:{type(manager).__qualname__}.dispatch (mode {getattr(mode, 'name', mode)})"
        if planner is not None and not isinstance(planner, Exception):
            source += "; " + path.describe(planner)
        yield role, "", tiers, source


# --- more per-call lanes ---------------------------------------------------------------------------------------

def lane_router(models, vllm_config, works):
    """The MoE router GEMM's tier: GateLinear.forward, run on a meta batch, stopped at the kernel it picks."""
    gate_cls = optional("vllm.model_executor.layers.fused_moe.router.gate_linear:GateLinear")
    ll = optional("vllm.model_executor.kernels.linear.cute_dsl.ll_bf16:ll_bf16_gemm")
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
                    with (capture(ll_mod, "ll_bf16_gemm") if ll_mod else contextlib.nullcontext({})) as seen, \
                            _Calls() as calls:
                        gate.forward(x)
                except Stop:
                    pass
                except Exception as exc:
                    tiers.append(not_resolved(err(exc)))
                    continue
                if "args" in seen:
                    key = ll_mod.ll_bf16_gemm_kernel.dispatch(M=w.tokens, K=k, N=gate.weight.shape[0])
                    variant = f"{key.backend} bs={key.bs}" if key.backend == "dotprod" else \
                        f"{key.backend} split_k={key.split_k} stages={key.num_stages}"
                    tiers.append(f"CuTe ll_bf16_gemm ({variant})")
                else:
                    tiers.append(calls.first_gemm() or not_resolved("no GEMM was reached"))
            yield role, name, tiers, f"{gate_cls.__module__}:{gate_cls.__qualname__}.forward"


def _routing_text(runner) -> str:
    """How a MoE runner routes a token to its experts, from vLLM's own objects: the router class and the routing
    method it declares (``routing_method_type``, what a monolithic kernel is told to run), its scoring and top-k, and
    whether the experts' quant method is monolithic (the kernel routes from the router logits itself) or the router
    selects experts first (``select_experts``) for a modular kernel."""
    router = runner.router
    cls = type(router).__qualname__
    method = getattr(router, "kernel_routing_method_type", None) or getattr(router, "routing_method_type", None)
    method = getattr(method, "name", None) or (str(method) if method is not None else "none declared")
    parts = [f"{getattr(router, 'top_k', '?')} of {getattr(router, 'global_num_experts', '?')} experts"]
    scoring = getattr(router, "scoring_func", None)
    if scoring:
        parts.append(f"{scoring} scores" + (" + correction bias"
                                            if getattr(router, "e_score_correction_bias", None) is not None else ""))
    groups = getattr(router, "num_expert_group", None)
    if groups:
        parts.append(f"{getattr(router, 'topk_group', '?')} of {groups} expert groups")
    experts = getattr(runner, "routed_experts", None)
    quant = getattr(experts, "quant_method", None) or getattr(runner, "quant_method", None)
    monolithic = getattr(quant, "is_monolithic", None)
    what = f"{cls} ({method} routing: {', '.join(parts)})"
    if monolithic is None:
        return not_resolved(f"{what}; the experts' quant method states no is_monolithic")
    if monolithic:
        return f"inside the experts kernel (monolithic {type(quant).__qualname__}): {what}"
    return f"separate router ({cls}.select_experts), then the experts kernel: {what}"


def lane_moe_parallel(models, vllm_config, works):
    """How a MoE layer is split over the ranks, as vLLM built it: its runner's ``moe_parallel_config`` (the MoE's
    own tp / ep / dp sizes, which differ from the attention's under expert parallel, and the all2all backend) and
    vLLM's ``ParallelConfig.use_sequence_parallel_moe`` (DP > 1 and TP > 1 with expert parallel over an
    allgather/reduce-scatter style all2all: each TP rank then runs the MoE on its slice of the tokens). Fixed at
    construction, the same for every batch."""
    pc = vllm_config.parallel_config
    sequence = getattr(pc, "use_sequence_parallel_moe", None)
    for role, model in models:
        for name, runner in runners(model):
            mpc = getattr(getattr(runner, "moe_config", None), "moe_parallel_config", None)
            if mpc is None:
                continue
            sizes = [f"{k} {getattr(mpc, k)}" for k in ("tp_size", "ep_size", "dp_size", "sp_size") if hasattr(mpc, k)]
            text = (f"MoE {', '.join(sizes)}; expert parallel {'on' if getattr(mpc, 'use_ep', False) else 'off'}, "
                    f"all2all {getattr(mpc, 'all2all_backend', '?')}; sequence-parallel MoE "
                    + ("unknown (no ParallelConfig.use_sequence_parallel_moe)" if sequence is None else
                       "on" if sequence else "off"))
            yield role, name, [text] * len(works), "vllm.config.parallel:ParallelConfig.use_sequence_parallel_moe"


def lane_moe_routing(models, vllm_config, works):
    """Where and how a MoE layer routes: its runner's router (class, routing method, scoring, top-k) and whether the
    experts kernel routes itself (a monolithic quant method takes the router logits) or the router selects the
    experts first. Decided at construction and load, the same for every batch."""
    for role, model in models:
        for name, runner in runners(model):
            if getattr(runner, "router", None) is None:
                continue
            try:
                text = _routing_text(runner)
            except Exception as exc:
                text = not_resolved(err(exc))
            yield role, name, [text] * len(works), (f"{type(runner.router).__module__}:"
                                                     f"{type(runner.router).__qualname__}.routing_method_type")


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


#: the shared lanes, in order; a model's own (its probes package's resolve module, ``LANES``) run after them
LANES = (
    ("serving_path", lane_serving_path),
    ("shared_overlap", lane_shared_overlap),
    ("moe_experts", lane_moe_experts),
    ("router", lane_router),
    ("moe_routing", lane_moe_routing),
    ("moe_parallel", lane_moe_parallel),
    ("mla", lane_mla),
)


#: lanes not asked again for later draft steps: their draft rows already say every step (lm_head), they have none,
#: or their answer hangs on the step's CUDA-graph mode, which the serving-path lane resolves for the target's steps
#: only (the overlaps)
_ONE_PASS = ("serving_path", "specialized_decode", "lm_head", "down_proj_overlap", "kda_projection_overlap")


_SPECULATOR: dict = {}


def draft_speculator(vllm_config):
    """The speculator vLLM's runner builds for this config (``init_speculator``), built on meta (its buffers only take
    shapes); one per cell's config."""
    held = _SPECULATOR.get(id(vllm_config))
    if held is None or held[0] is not vllm_config:  # held with its config: a freed config's id is not reused
        import torch

        init = _attr("vllm.v1.worker.gpu.spec_decode:init_speculator")
        _SPECULATOR.clear()
        built = _bind(init, vllm_config=vllm_config, device=torch.device("meta"), req_states=None)  # 0.27: no req_states
        _SPECULATOR[id(vllm_config)] = held = (vllm_config, built)
    return held[1]


def _draft_queries(vllm_config) -> int:
    """Query tokens per request of a parallel drafter's one pass: its speculator's ``num_query_per_req``."""
    return int(draft_speculator(vllm_config).num_query_per_req)


def _parallel_draft_rows(lane, fn, rows, drafts, vllm_config, works):
    """A parallel drafter (vLLM's ``parallel_drafting``: DFlash, DSpark) drafts every token in one pass of
    ``num_query_per_req`` query tokens per request, whatever the target step was: its rows are that pass's."""
    try:
        q = _draft_queries(vllm_config)
    except Exception as exc:
        why = not_resolved(f"the parallel drafter's pass: its speculator did not build ({err(exc)})")
        return [(role, name, [why] * len(works) if role == "draft" else tiers, source)
                for role, name, tiers, source in rows]
    passes = [Workload("verify", w.requests * q, w.requests, q) for w in works]
    again = {(role, name): tiers for role, name, tiers, _ in fn(drafts, vllm_config, passes)}
    out = []
    for role, name, tiers, source in rows:
        if role == "draft":
            tiers = [f"draft pass ({p.requests}x{q}): {b}" for b, p in zip(again.get((role, name), tiers), passes)]
        out.append((role, name, tiers, source))
    return out


def _with_draft_steps(lane: str, fn, named, vllm_config, works):
    """The lane's rows; a draft model's, where it drafts more than one token, for both kinds of draft pass vLLM's
    speculator runs: step 0 over the target step's tokens (what ``works`` gives), then steps 1..k-1 over one token
    per request (its decode passes, ``_generate_draft``/``propose``'s loop). Where the two differ the tier names
    both, e.g. ``step 0: A; steps 1–2 (M=8): B``."""
    rows = list(fn(named, vllm_config, works))
    spec = getattr(vllm_config, "speculative_config", None)
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
    drafts = [(role, m) for role, m in named if role == "draft"]
    if not drafts or lane in _ONE_PASS or not any(role == "draft" for role, *_ in rows):
        return rows
    if getattr(spec, "parallel_drafting", False):
        return _parallel_draft_rows(lane, fn, rows, drafts, vllm_config, works)
    if k < 2:
        return rows
    later = [Workload("decode", w.requests, w.requests, 1) for w in works]
    steps = "step 1" if k == 2 else f"steps 1–{k - 1}"
    again = {(role, name): tiers for role, name, tiers, _ in fn(drafts, vllm_config, later)}
    out = []
    for role, name, tiers, source in rows:
        other = again.get((role, name)) if role == "draft" else None
        if other is not None:
            tiers = [a if str(a) == str(b) else f"step 0: {a}; {steps} (M={w.requests}): {b}"
                     for a, b, w in zip(tiers, other, works)]
        out.append((role, name, tiers, source))
    return out


def run(models, vllm_config, rec) -> None:
    """Resolve every lane (the shared ones, then the model's) at every workload for the built models; record,
    never raise."""
    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    lane_seconds: dict[str, float] = {}
    try:
        from vllm.config import set_current_vllm_config

        works = workloads(vllm_config)
        named = [(role, m) for role, m in models if m is not None]
        with set_current_vllm_config(vllm_config):
            for lane, fn in LANES + models_probes.current().lanes:
                t_lane = time.perf_counter()
                try:
                    _emit(rec, lane, _with_draft_steps(lane, fn, named, vllm_config, works), works)
                except Exception as exc:  # one lane's failure hides nothing of the others
                    errors[lane] = err(exc)
                lane_seconds[lane] = round(time.perf_counter() - t_lane, 3)
    except Exception as exc:
        errors["stage"] = err(exc)
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
