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
                    choice = f"no per-call variant known to this stage for {cname}"
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


def lane_low_latency_gemm(models, vllm_config, works):
    """K3's shape-selected decode GEMMs: the per-M plan KimiK3LowLatencyLinearMethod consults on each call
    (built by vLLM from its measured table for this SM), then the runtime gates it checks on the host."""
    cls = _optional("vllm.models.kimi_k3.nvidia.low_latency_gemm:KimiK3LowLatencyLinearMethod")
    if cls is None:
        return
    skinny = _optional("vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm:shape_dynamic_skinny_gemm")
    try:
        skinny_ok = bool(skinny.is_available()) if skinny is not None else False
    except Exception:
        skinny_ok = False
    import torch

    dsv3_ok = hasattr(torch.ops._C, "dsv3_fused_a_gemm")
    for role, model in models:
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if type(qm) is not cls:
                continue
            plan = getattr(qm, "_plan", {}) or {}
            gemm = getattr(getattr(qm, "_gemm_impl", None), "__name__", "base GEMM")
            fallback = f"base linear ({gemm})"
            tiers = []
            for w in works:
                entry = plan.get(w.tokens)
                if entry is None:
                    tiers.append(fallback)
                elif entry[0] == "cute":
                    tiers.append(f"CuTe skinny GEMM ({_config_text(entry[1])})" if skinny_ok else
                                 f"{fallback}: the plan's CuTe skinny GEMM is not available here")
                else:
                    tiers.append(str(entry[0]) if dsv3_ok else f"{fallback}: the plan's {entry[0]} op is not compiled in")
            yield role, name, tiers, f"{cls.__module__}:{cls.__qualname__}._plan"


LANES = (
    ("latent_tail", lane_latent_tail),
    ("shared_overlap", lane_shared_overlap),
    ("moe_experts", lane_moe_experts),
    ("mla", lane_mla),
    ("low_latency_gemm", lane_low_latency_gemm),
)


def run(models, vllm_config, rec) -> None:
    """Resolve every lane at every workload for the built models; record, never raise."""
    t0 = time.perf_counter()
    errors: dict[str, str] = {}
    try:
        from vllm.config import set_current_vllm_config

        works = workloads(vllm_config)
        named = [(role, m) for role, m in models if m is not None]
        with set_current_vllm_config(vllm_config):
            for lane, fn in LANES:
                try:
                    _emit(rec, lane, fn(named, vllm_config, works), works)
                except Exception as exc:  # one lane's failure hides nothing of the others
                    errors[lane] = _err(exc)
    except Exception as exc:
        errors["stage"] = _err(exc)
    rec.emit("dispatch-stage", seconds=round(time.perf_counter() - t0, 3), errors=errors,
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
