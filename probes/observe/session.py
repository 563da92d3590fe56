"""Observe mode inside a serving process: count which kernel entry points run, per layer and phase,
and which run inside captured CUDA graphs.

What is wrapped (targets as data, researched for vLLM 0.33 in docs/notes/observe-0.33.md):

* **kernel entries** (:data:`KERNELS`, and a model's own from its probes package): one wrapper per
  implementation of a lane, e.g. each MLA impl's ``forward_mqa``, each MoE experts class's ``apply``, a
  model's own attention kernels. A wrapper only counts (probes.observe.counting).
* **layer scopes** (:data:`SCOPES`, and a model's own): the per-layer functions that call them
  (``MoERunner._forward_impl``, a model's attention ``_forward``) set the current layer; a scope with
  ``phase_from="metadata"`` also sets the step's phase from its attention metadata (prefills / plain
  decodes / speculative decodes). A scope that is an *eager break* of vLLM's breakable CUDA graphs runs
  again at every replay, so it is installed *inside* the decorator and fires on replays too.
* **graphs**: ``torch.cuda.CUDAGraph.capture_begin/capture_end`` mark calls as captured (membership
  of that graph, not executions), ``replay`` counts replays per graph; ``BreakableCUDAGraphCapture.
  add_eager`` runs its eager segment for real during capture, so calls there are executions; the V2
  graph manager's ``run_fullgraph(desc)`` and the breakable wrapper name graphs by their batch
  descriptor.

Standard library only until installed into a process that imports vLLM.
"""
from __future__ import annotations

import functools
import os
import sys
import threading

from probes.core.targets import Kernel, Scope
from probes.observe.counting import Counters
from probes.core.patching import SENTINEL, PostImportHooks, rebind, resolve

MLA_BK = "vllm.v1.attention.backends.mla."
EXPERTS = "vllm.model_executor.layers.fused_moe."


KERNELS: tuple[Kernel, ...] = (
    # MLA decode (and verify): the impl's forward_mqa
    *(Kernel("mla.decode", name, MLA_BK + spec, backend=backend) for name, spec, backend in (
        ("FlashMLA", "flashmla:FlashMLAImpl.forward_mqa", "FlashMLABackend"),
        ("FlashInfer MLA", "flashinfer_mla:FlashInferMLAImpl.forward_mqa", "FlashInferMLABackend"),
        ("CUTLASS MLA", "cutlass_mla:CutlassMLAImpl.forward_mqa", "CutlassMLABackend"),
        ("Triton MLA", "triton_mla:TritonMLAImpl.forward_mqa", "TritonMLABackend"),
        ("FlashAttn MLA", "flashattn_mla:FlashAttnMLAImpl.forward_mqa", "FlashAttnMLABackend"),
        ("Tokenspeed MLA", "tokenspeed_mla:TokenspeedMLAImpl.forward_mqa", "TokenspeedMLABackend"),
    )),
    # MLA prefill: the prefill backend's new-token kernel
    *(Kernel("mla.prefill", name, MLA_BK + "prefill." + spec, backend=spec.split(":")[1].split(".")[0])
      for name, spec in (
        ("FlashAttn prefill", "flash_attn:FlashAttnPrefillBackend.run_prefill_new_tokens"),
        ("FlashInfer prefill", "flashinfer:FlashInferPrefillBackend.run_prefill_new_tokens"),
        ("TRT-LLM ragged prefill", "trtllm_ragged:TrtllmRaggedPrefillBackend.run_prefill_new_tokens"),
        ("Tokenspeed prefill", "tokenspeed_mla:TokenspeedMLAPrefillBackend.run_prefill_new_tokens"),
    )),
    # MoE experts shared by quantization schemes (a scheme's own: probes/schemes, merged into the model's entries)
    *(Kernel("moe", name, EXPERTS + "experts." + spec) for name, spec in (
        ("Marlin", "marlin_moe:MarlinExperts.apply"),
        ("Marlin (batched)", "marlin_moe:BatchedMarlinExperts.apply"),
        ("Humming (indexed)", "fused_humming_moe:HummingIndexedExperts.apply"),
        ("Humming (grouped)", "fused_humming_moe:HummingGroupedExperts.apply"),
        ("Humming (batched grouped)", "fused_humming_moe:BatchedHummingGroupedExperts.apply"),
        ("FlashInfer CUTLASS", "flashinfer_cutlass_moe:FlashInferExperts.apply"),
        ("DeepGEMM (batched)", "batched_deep_gemm_moe:BatchedDeepGemmExperts.apply"),
        ("Triton or DeepGEMM / CUTLASS fallback", "fallback:FallbackExperts.apply"),
        ("Triton", "triton_moe:TritonExperts.apply"),
    )),
)

SCOPES: tuple[Scope, ...] = (
    Scope(EXPERTS + "runner.moe_runner:MoERunner._forward_impl", "layer_id"),
)


def entries(model=None) -> tuple[tuple[Kernel, ...], tuple[Scope, ...]]:
    """The kernel entries and scopes observe mode wraps: *model*'s, then the shared ones
    (a ``probes.models.ModelProbes``; None: the shared ones only)."""
    if model is None:
        return KERNELS, SCOPES
    return tuple(model.kernels) + KERNELS, tuple(model.scopes) + SCOPES

GRAPH_HOOKS = (
    "torch.cuda.graphs:CUDAGraph.capture_begin",
    "torch.cuda.graphs:CUDAGraph.capture_end",
    "torch.cuda.graphs:CUDAGraph.replay",
    "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphCapture.add_eager",
    "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphWrapper._capture",
    "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.run_fullgraph",
)


def layer_index(value) -> int | None:
    """An int layer index, or the index in a ``...layers.N...`` name."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        parts = value.split(".")
        for a, b in zip(parts, parts[1:]):
            if a == "layers" and b.isdigit():
                return int(b)
    return None


def batch_phase(metadata) -> str | None:
    """The step's phase from a layer's attention metadata (prefill wins in a mixed batch)."""
    if metadata is None:
        return None
    if getattr(metadata, "num_prefills", 0):
        return "mixed" if (getattr(metadata, "num_decodes", 0) or getattr(metadata, "num_spec_decodes", 0)) \
            else "prefill"
    if getattr(metadata, "num_spec_decodes", 0):
        return "spec-verify"
    if getattr(metadata, "num_decodes", 0):
        return "decode"
    return None


class ObserveSession:
    """Counting wrappers, layer/phase scopes and graph hooks of one process."""

    def __init__(self, rec, *, counters: Counters | None = None, kernels=KERNELS, scopes=SCOPES):
        self.rec = rec
        self.counters = counters or Counters()
        self.kernels = kernels
        self.scopes = scopes
        self.hooks = PostImportHooks()
        self.status: dict[str, str] = {}
        self._graph_of: dict[int, int] = {}   # id(torch CUDAGraph) -> graph id
        self._key_hint = threading.local()
        self._lane_of = {k.path: k.lane for k in kernels}
        self._backend_of = {k.path: k.backend for k in kernels}

    # -- installation --------------------------------------------------------------------------
    def install(self) -> "ObserveSession":
        for k in self.kernels:
            self._on(k.spec, lambda mod, k=k: self._wrap_kernel(mod, k))
        for s in self.scopes:
            self._on(s.spec, lambda mod, s=s: self._wrap_scope(mod, s))
        for spec in GRAPH_HOOKS:
            self._on(spec, lambda mod, spec=spec: self._wrap_graph(mod, spec))
        return self

    def _on(self, spec: str, fn) -> None:
        module = spec.split(":", 1)[0]
        self.status.setdefault(spec, "not reached")
        self.hooks.register(module, fn)

    def _patch(self, spec: str, mod, make):
        qual = spec.split(":", 1)[1]
        try:
            owner, name, raw = resolve(mod, qual)
        except AttributeError as exc:
            self.status[spec] = f"missing: {exc}"
            return
        fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        if hasattr(fn, SENTINEL):
            return
        try:
            new = make(fn)
        except Exception as exc:  # never break the import we ride on
            self.status[spec] = f"error: {type(exc).__name__}: {exc}"
            return
        if isinstance(raw, staticmethod):
            new = staticmethod(new)
        elif isinstance(raw, classmethod):
            new = classmethod(new)
        setattr(owner, name, new)
        self.status[spec] = "patched"
        if owner is mod:  # `from x import f` copies elsewhere in vLLM keep the original: point them here
            rebind(fn, new, ("vllm.",), skip=mod)

    def _wrap_kernel(self, mod, k: Kernel) -> None:
        layer_of = None
        if k.layer_attr:
            attr = k.layer_attr
            layer_of = lambda args: layer_index(getattr(args[0], attr, None))  # noqa: E731
        self._patch(k.spec, mod, lambda fn: self.counters.counting_wrapper(fn, k.path, layer_of=layer_of))

    def _wrap_scope(self, mod, s: Scope) -> None:
        counters, attr = self.counters, s.layer_attr

        def make(fn):
            inner = getattr(fn, "__wrapped__", None) if s.eager_break else None
            target = inner or fn

            @functools.wraps(target)
            def scope(*args, **kwargs):
                try:
                    me = args[0]
                    counters.set_layer(layer_index(getattr(me, attr, None)))
                    if s.phase_from == "metadata":
                        phase = self.metadata_phase(me)
                        if phase:
                            counters.set_phase(phase)
                except Exception:
                    pass
                return target(*args, **kwargs)

            setattr(scope, SENTINEL, "scope:" + s.spec)
            if inner is not None:  # re-apply vLLM's decorator around the scope, so replays run it
                from vllm.compilation.breakable_cudagraph import eager_break_during_capture

                wrapped = eager_break_during_capture(scope)
                setattr(wrapped, SENTINEL, "scope:" + s.spec)
                return wrapped
            return scope

        self._patch(s.spec, mod, make)

    @staticmethod
    def metadata_phase(layer) -> str | None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return None
        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            md = md[0] if md else None
        if isinstance(md, dict):
            md = md.get(getattr(layer, "prefix", ""))
        return batch_phase(md)

    def _wrap_graph(self, mod, spec: str) -> None:
        c = self.counters
        name = spec.rsplit(".", 1)[1]

        def make(fn):
            if name == "capture_begin":
                def w(graph, *a, **kw):
                    hint = getattr(self._key_hint, "key", None) or "graph"
                    self._graph_of[id(graph)] = c.begin_capture(hint)
                    return fn(graph, *a, **kw)
            elif name == "capture_end":
                def w(graph, *a, **kw):
                    try:
                        return fn(graph, *a, **kw)
                    finally:
                        c.end_capture()
            elif name == "replay":
                def w(graph, *a, **kw):
                    out = fn(graph, *a, **kw)  # a replay that raised did not run the graph: not counted
                    gid = self._graph_of.get(id(graph))
                    if gid:
                        c.replayed(gid)
                    return out
            elif name == "add_eager":
                def w(capture, eager_fn, *a, **kw):
                    # the eager segment runs for real during capture: its calls are executions
                    saved = c.state[1]

                    def run_eager():
                        c.state[1] = 0
                        try:
                            return eager_fn()
                        finally:
                            c.state[1] = saved
                    return fn(capture, run_eager, *a, **kw)
            elif name == "_capture":
                def w(wrapper, *a, **kw):
                    self._key_hint.key = "piecewise " + _descriptor()
                    try:
                        return fn(wrapper, *a, **kw)
                    finally:
                        self._key_hint.key = None
            else:  # run_fullgraph(desc): name the FULL graph by its descriptor (cold after the first)
                def w(manager, desc, *a, **kw):
                    graph = getattr(manager, "graphs", {}).get(desc)
                    gid = self._graph_of.get(id(graph)) if graph is not None else None
                    if gid and c.graphs[gid]["key"] == "graph":
                        c.graphs[gid]["key"] = "full " + _short(desc)
                    return fn(manager, desc, *a, **kw)
            functools.update_wrapper(w, fn)
            setattr(w, SENTINEL, "graph:" + name)
            return w

        self._patch(spec, mod, make)

    # -- evidence ------------------------------------------------------------------------------
    def flush(self) -> None:
        snap = self.counters.snapshot()
        rec = self.rec
        rec.drop("exec", "graph", "observe-status")  # a flush is the state so far, not an increment
        rec.update_header(**_rank())
        rec.emit("observe-status", targets=dict(sorted(self.status.items())))
        for row in snap["eager"]:
            rec.emit("exec", lane=self._lane_of.get(row["path"], "?"), backend=self._backend_of.get(row["path"], ""),
                     **row)
        for g in snap["graphs"]:
            rec.emit("graph", key=g["key"], replays=g["replays"], gid=g["id"],
                     paths=[{**p, "lane": self._lane_of.get(p["path"], "?"),
                             "backend": self._backend_of.get(p["path"], "")} for p in g["paths"]])
        rec.flush()

    def start_timer(self, seconds: float = 30.0) -> None:
        def tick():
            try:
                self.flush()
            finally:
                t = threading.Timer(seconds, tick)
                t.daemon = True
                t.start()
        t = threading.Timer(seconds, tick)
        t.daemon = True
        t.start()


def _descriptor() -> str:
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if is_forward_context_available():
            return _short(get_forward_context().batch_descriptor)
    except Exception:
        pass
    return "?"


def _short(desc) -> str:
    fields = ("num_tokens", "num_reqs", "uniform", "cg_mode", "uniform_token_count")
    parts = [f"{f}={getattr(desc, f)}" for f in fields if getattr(desc, f, None) is not None]
    return ", ".join(parts) or type(desc).__name__


def _rank() -> dict:
    out = {}
    for env, key in (("RANK", "rank"), ("LOCAL_RANK", "local_rank"), ("VLLM_DP_RANK", "dp_rank")):
        if os.environ.get(env, "").isdigit():
            out[key] = int(os.environ[env])
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_initialized():
            out["rank"] = dist.get_rank()
            out["world_size"] = dist.get_world_size()
    except Exception:
        pass
    return out


__all__ = ["GRAPH_HOOKS", "KERNELS", "SCOPES", "Kernel", "ObserveSession", "Scope", "batch_phase", "entries", "layer_index"]
