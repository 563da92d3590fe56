"""Resolve mode's post-load stage: vLLM's own weight post-processing, run per step on the meta model.

After construction, vLLM's model loader calls the model's ``load_weights`` with the checkpoint's
tensors (here: with none, so only what the model does besides copying runs, see ``_load_tails``) and
then ``model_executor.model_loader.utils:process_weights_after_loading``, which runs, in order:

1. every module's ``quant_method.process_weights_after_loading(module)`` (``named_modules`` order;
   only quant methods that are ``QuantizeMethodBase`` instances);
2. every deferred attention layer's ``process_weights_after_loading(dtype)`` (0.27 also runs each
   ``HpcModule``'s ``process_weights_after_loading(model)`` after them);
3. the model's own ``process_weights_after_loading()`` (K3 before 0.33: MegaMoE weight finalization).

Then the worker builds its model state: a model's probes package adds those steps (``postload_steps``; K3 with
``decode_backend=latency_specialized`` builds its specialized decode there), and the readings of what its own
modules left behind (``runner_facts``, ``model_facts``).

vLLM stops at the first exception. Here each step runs on its own, so one step that cannot be
simulated does not hide the decisions of the others; every step's outcome is recorded:

* ``ok``: the step ran to its end on the meta device;
* ``refused``: vLLM's own code raised (an explicit ``raise`` in a vLLM source file, not an
  assertion, not caused by another exception): a check about the device or the configuration
  said no. The message and the raising function are vLLM's. A server stops loading there.
* ``limit``: the simulation could not go further (an op without a meta implementation, a stand-in,
  an assertion about real tensors, a compiled extension, a library outside vLLM). Never a verdict.

The loops' order and the names they use are taken from the pinned vLLM's loader module; when that
module no longer has them, the stage records drift and runs only what it can name.

Imported only inside the pinned environment, after the model was built.
"""
from __future__ import annotations

import linecache
import re
import time
import traceback

from probes import models as models_probes
from probes.core import fence
from probes.resolve import simulate
from probes.core.recorder import describe
from probes.core.stages import stop_rule

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
LOADER = "vllm.model_executor.model_loader.utils"
MOE_METHOD_MODULE = "vllm.model_executor.layers.fused_moe.fused_moe_method_base"


def _is_vllm_file(path: str) -> bool:
    return "/site-packages/vllm/" in path or "/dist-packages/vllm/" in path


def _frame_name(frame) -> str:
    code = frame.f_code
    return f"{frame.f_globals.get('__name__', '?')}:{getattr(code, 'co_qualname', code.co_name)}"


def _rel(path: str) -> str:
    return re.sub(r"^.*?/site-packages/", "", path)


def classify(exc: BaseException, *, fed_no_weights: bool = False) -> dict:
    """``refused`` or ``limit`` for an exception a post-load step raised, with why and where.
    ``fed_no_weights``: the step is a ``load_weights`` run on an empty stream, where a check about which
    tensors arrived is the simulation's doing (raised by the loading function itself, or naming the
    checkpoint or missing weights), never a refusal; what the loading calls besides (a finalize and its
    device check) is judged like any other step."""
    fence.check_origin("post-load step", exc)  # the harness's own code raised: a fault, whatever the rule says
    frames = list(traceback.walk_tb(exc.__traceback__))
    inner_frame, inner_line = frames[-1] if frames else (None, 0)
    vllm_frames = [(f, n) for f, n in frames if _is_vllm_file(f.f_code.co_filename)]
    out = {"type": f"{type(exc).__module__}:{type(exc).__qualname__}", "message": str(exc)[:2000]}
    if vllm_frames:
        f, n = vllm_frames[-1]
        out["vllm_function"] = _frame_name(f)
        out["vllm_where"] = f"{_rel(f.f_code.co_filename)}:{n}"
    if inner_frame is not None:
        out["raised_in"] = _frame_name(inner_frame)
        out["raised_where"] = f"{_rel(inner_frame.f_code.co_filename)}:{inner_line}"
    for f, _ in reversed(frames):  # the innermost layer module on the way (the MoE experts of layer N)
        owner = f.f_locals.get("self")
        prefix = attempt(lambda: getattr(owner, "prefix", None) or getattr(owner, "layer_name", None), default="")
        if isinstance(prefix, str) and _LAYER_RE.search(prefix):
            out["in_module"] = prefix
            out["in_layer"] = _layer(prefix)
            break
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    line = linecache.getline(inner_frame.f_code.co_filename, inner_line).strip() if inner_frame else ""
    facts = {"raise_line": line.startswith("raise"), "cause": type(cause).__name__ if cause is not None else None}
    outcome, rule = stop_rule(in_vllm=inner_frame is not None and _is_vllm_file(inner_frame.f_code.co_filename),
                              assertion=isinstance(exc, AssertionError), message=str(exc),
                              fed_no_weights=fed_no_weights,
                              raised_in=inner_frame.f_code.co_name if inner_frame is not None else "",
                              type_name=out["type"], **facts)
    # what the rule read is recorded too, so the host applies the same rule to the record (audit.routing)
    out.update(outcome=outcome, rule=rule, **facts)
    return out


def _layer(name: str) -> int | None:
    m = _LAYER_RE.search(name or "")
    return int(m.group(1)) if m else None


def _loader_names():
    """What vLLM's post-load loop uses, from the pinned loader module (drift when missing)."""
    import importlib

    mod = importlib.import_module(LOADER)
    names = {}
    for attr in ("process_weights_after_loading", "QuantizeMethodBase", "is_deferred_attention_layer"):
        names[attr] = getattr(mod, attr, None)
    if names["is_deferred_attention_layer"] is None:
        # before the helper existed (0.27) the loop tested these classes inline, the same way
        bases = tuple(b for b in (getattr(mod, "AttentionLayerBase", None), getattr(mod, "MMEncoderAttention", None))
                      if isinstance(b, type))
        if bases:
            names["is_deferred_attention_layer"] = \
                lambda m: isinstance(m, bases) and hasattr(m, "process_weights_after_loading")
    names["HpcModule"] = getattr(mod, "HpcModule", None)  # 0.27: a loop of its own before the model hook
    return names


def _load_tails(model, weights: tuple[str, ...] = ()) -> list[tuple]:
    """The model's own ``load_weights``, and its language model's when that is another module, fed what the
    loader would stream besides the checkpoint's tensors: nothing, or (``weights``, a speculative draft) one
    meta tensor per named checkpoint weight, so a check on which weights arrived sees them.

    A model may finish its loading there (K3 in 0.27-0.29 finalizes its MegaMoE experts, and so runs
    their device check, at the end of ``KimiLinearForCausalLM.load_weights``). With real weights the
    top-level loader reaches the language model's ``load_weights`` through its children; with none it
    does not, so both are called, top-level first, as the loader nests them."""
    lm = _language_model(model)
    owners = [("", model)]
    if lm is not model:
        owners.append((next((n for n, m in model.named_children() if m is lm), "language_model"), lm))
    stream = _named_stream(model, weights) if weights else []
    return [("model-load", name, m, lambda m=m, s=(stream if name == "" else []): m.load_weights(iter(list(s))),
             f"{type(m).__module__}:{type(m).__qualname__}.load_weights")
            for name, m in owners if callable(getattr(m, "load_weights", None))]


def _named_stream(model, weights: tuple[str, ...]) -> list[tuple]:
    """(checkpoint name, meta tensor) for each pattern and each of the model's layers: the tensor has the shape
    and dtype of the model's parameter with the same layer and suffix (``model.layers.{layer}.enorm.weight`` ->
    a parameter ``...layers.93...enorm.weight``). A name with no such parameter is left out."""
    import torch

    params = list(model.named_parameters())
    layers = sorted({_layer(n) for n, _ in params} - {None})
    out = []
    for pattern in weights:
        suffix = pattern.split("{layer}", 1)[-1].lstrip(".")
        for layer in layers:
            target = next((p for n, p in params if _layer(n) == layer and n.endswith("." + suffix)), None)
            if target is not None:
                out.append((pattern.format(layer=layer), torch.empty_like(target, device="meta")))
    simulate.SIMULATED["post-load: checkpoint weight names"] = (
        "the draft's load_weights is fed " + ", ".join(n for n, _ in out) + " (meta tensors of the parameters' "
        "shapes) so its check that the checkpoint holds its layers passes; a real checkpoint must carry them")
    return out


def steps(model, model_config, weights: tuple[str, ...] = ()) -> tuple[list[tuple], list[str]]:
    """(kind, module name, module, callable) in the loader's order, and the names it could not find."""
    names = _loader_names()
    missing = [k for k, v in names.items() if v is None and k != "HpcModule"]
    out = _load_tails(model, weights)
    qbase, deferred = names["QuantizeMethodBase"], names["is_deferred_attention_layer"]
    if qbase is not None:
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if isinstance(qm, qbase):
                out.append(("quant_method", name, module, lambda qm=qm, module=module: qm.process_weights_after_loading(module),
                            f"{type(qm).__module__}:{type(qm).__qualname__}.process_weights_after_loading"))
    if deferred is not None:
        for name, module in model.named_modules():
            if deferred(module):
                out.append(("attention", name, module,
                            lambda module=module: module.process_weights_after_loading(model_config.dtype),
                            f"{type(module).__module__}:{type(module).__qualname__}.process_weights_after_loading"))
    hpc = names["HpcModule"]
    if isinstance(hpc, type):
        for name, module in model.named_modules():
            if isinstance(module, hpc):
                out.append(("hpc", name, module, lambda module=module: module.process_weights_after_loading(model),
                            f"{type(module).__module__}:{type(module).__qualname__}.process_weights_after_loading"))
    if hasattr(model, "process_weights_after_loading"):
        out.append(("model", "", model, model.process_weights_after_loading,
                    f"{type(model).__module__}:{type(model).__qualname__}.process_weights_after_loading"))
    return out, missing


def _language_model(model):
    return model.get_language_model() if hasattr(model, "get_language_model") else model


def _moe_conversion_step(base):
    """Steps the fast path (probes/resolve/carry.py) takes part in: vLLM's MoE quant methods, which convert
    every expert's weights for the chosen kernel (the per-layer work that is identical across layers)."""
    return lambda kind, module: (kind == "quant_method" and base is not None
                                 and isinstance(getattr(module, "quant_method", None), base))


def _execute(kind: str, call, vllm_config, mc) -> dict:
    """Run one post-load step the way vLLM's loader runs it; its outcome fields."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    try:
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(mc.dtype), simulate.meta_device_mode():
            call()
    except Exception as exc:  # the outcome is the evidence
        return classify(exc, fed_no_weights=kind == "model-load")
    return {"outcome": "ok"}


def run(model, vllm_config, rec, *, role: str = "target", model_config=None, every_layer: bool = False,
        weights: tuple[str, ...] = ()) -> dict:
    """Run every post-load step of ``model`` and record each outcome; then record what it built.
    ``model_config`` is the one the loader passes (the draft's own for a speculative draft); ``every_layer``
    runs vLLM's step on every layer instead of carrying a representative's result (probes/resolve/carry.py)."""
    import importlib

    from probes.resolve import carry

    mc = model_config or vllm_config.model_config
    simulate.SIMULATED["post-load"] = ("vLLM's post-load steps run one by one on the meta model (weights never "
                                       "loaded; new tensors on the meta device); a step that raised does not stop "
                                       "the next")
    todo, missing = steps(model, mc, weights)
    if missing:
        rec.emit("postload-drift", role=role, loader=LOADER, missing=missing)
    lm = _language_model(model)
    own_steps = models_probes.current().hook("postload_steps")
    if own_steps is not None:  # what the model's worker does once the weights are loaded (K3: its model state)
        todo.extend(own_steps(lm))
    try:
        moe_base = getattr(importlib.import_module(MOE_METHOD_MODULE), "FusedMoEMethodBase", None)
    except ImportError:
        moe_base = None
    carrier = carry.Carrier(model, todo, _moe_conversion_step(moe_base), every_layer=every_layer)
    records: list[dict] = []
    for i, (kind, name, module, call, fn) in enumerate(todo):
        t0 = time.perf_counter()
        record = {"role": role, "step": kind, "module": name, "layer": _layer(name),
                  "cls": f"{type(module).__module__}:{type(module).__qualname__}", "fn": fn}
        record.update(carrier.run(i, lambda kind=kind, call=call: _execute(kind, call, vllm_config, mc)))
        record["seconds"] = round(time.perf_counter() - t0, 4)
        records.append(record)
    for i in carrier.redo():  # a failed check withdrew these layers' carried results: vLLM's step runs
        kind, _name, _module, call, _fn = todo[i]
        t0 = time.perf_counter()
        records[i] = {**{k: v for k, v in records[i].items() if k in ("role", "step", "module", "layer", "cls", "fn")},
                      **_execute(kind, call, vllm_config, mc), "carry": "ran",
                      "seconds": round(time.perf_counter() - t0, 4)}
    counts = {"ok": 0, "refused": 0, "limit": 0}
    for record in records:
        counts[record["outcome"]] += 1
        rec.emit("postload-step", **record)
    for group in carrier.summary():
        rec.emit("postload-carry", role=role, **group)
    rec.emit("postload", role=role, steps=len(todo), **counts)
    inspect(model, vllm_config, rec, role=role)
    return counts


# -- what post-load decided ------------------------------------------------------------------------

def attempt(fn, default=None):
    try:
        return fn()
    except Exception as exc:
        return f"<{type(exc).__name__}: {str(exc)[:200]}>" if default is None else default


def failing_condition(method, obj) -> str | None:
    """For a vLLM method whose body is ``return <a> and <b> and ...``, the source text of the first operand that
    is false for ``obj``: the check that decided. Each operand is vLLM's own expression, evaluated as written
    with ``self`` bound to ``obj``; None when the method has another shape or every operand holds."""
    import ast
    import inspect as _inspect
    import textwrap

    fn = _unwrap(getattr(method, "__func__", method))
    try:
        tree = ast.parse(textwrap.dedent(_inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = [n for n in tree.body[0].body if not isinstance(n, ast.Expr)] if tree.body else []
    if len(body) != 1 or not isinstance(body[0], ast.Return) or not isinstance(body[0].value, ast.BoolOp) \
            or not isinstance(body[0].value.op, ast.And):
        return None
    scope = {**fn.__globals__, "self": obj}
    for operand in body[0].value.values:
        text = ast.unparse(operand)
        try:
            value = eval(compile(ast.Expression(operand), "<vllm condition>", "eval"), scope)
        except Exception as exc:
            return f"{text} (could not be evaluated: {type(exc).__name__})"
        if not value:
            return text
    return None


def _unwrap(fn):
    import inspect as _inspect

    return _inspect.unwrap(fn)


def _cls(obj):
    return None if obj is None else describe(type(obj))


def _moe_config_facts(cfg) -> dict:
    if cfg is None:
        return {}
    requested = getattr(cfg, "_defer_moe_finalize", None)
    if requested is None and isinstance(getattr(cfg, "defer_moe_finalize", None), bool):
        requested = cfg.defer_moe_finalize  # before 0.33 a field, since then a method
    prop = getattr(type(cfg), "use_deferred_moe_finalize", None)
    effective = attempt(lambda: bool(cfg.use_deferred_moe_finalize)) if prop is not None else None
    out = {"defer_requested": requested, "defer_effective": effective,
           "defer_max_tokens": getattr(cfg, "defer_moe_finalize_max_num_tokens", None),
           "activation": describe(getattr(cfg, "activation", None))}
    if requested and effective is False and isinstance(prop, property):  # the check in vLLM's condition that decided
        out["defer_fails"] = attempt(lambda: failing_condition(prop.fget, cfg))
    return out


def _all2all_manager():
    """The all2all manager of the expert-parallel group's device communicator, if vLLM built one."""
    try:
        from vllm.distributed.parallel_state import get_ep_group

        comm = get_ep_group().device_communicator
    except Exception:  # no EP group in this layout (or it moved): nothing to read
        return None
    return getattr(comm, "all2all_manager", None) if comm is not None else None


def inspect(model, vllm_config, rec, *, role: str = "target") -> None:
    """Read per layer what the post-load path left behind: the MoE kernel objects (with the all2all manager
    their prepare/finalize dispatches through under expert parallelism), deferred finalize, the activation each
    experts kernel is given; and what the model's probes package reads of its own modules (K3: the latent tail
    fusion, whose fused path vLLM re-evaluates once the MoE kernel exists, and the specialized decode)."""
    manager = _all2all_manager()
    own = models_probes.current()
    own_runner_facts = own.hook("runner_facts")
    own_block_facts = own.hook("block_facts")
    pc = getattr(vllm_config, "parallel_config", None)
    experts_modules = own.experts_modules  # its schemes' and its own
    for name, module in model.named_modules():
        layer = _layer(name)
        if layer is None:
            continue
        facts: dict = {}
        block = own_block_facts(module) if own_block_facts is not None else None
        if block is not None:  # the model's own MoE block: which MoE path it built, read off vLLM's attributes
            rec.emit("postload-module", role=role, name=name, layer=layer, what="moe-block", facts=block)
            continue
        if hasattr(module, "routed_experts") and hasattr(module, "moe_config"):  # an MoE runner
            facts["runner"] = _cls(module)
            if own_runner_facts is not None:  # what the model's own runner left behind (K3: its latent tail fusion)
                facts.update(own_runner_facts(module))
            facts.update(_moe_config_facts(module.moe_config))
            experts = module.routed_experts
            qm = getattr(experts, "quant_method", None)
            kernel = getattr(qm, "moe_kernel", None)
            facts["quant_method"] = _cls(qm)
            facts["experts_cls"] = describe(getattr(qm, "experts_cls", None))
            facts["moe_kernel"] = _cls(kernel)
            if kernel is not None:
                fused = getattr(kernel, "fused_experts", None)
                facts["fused_experts"] = _cls(fused)
                facts["prepare_finalize"] = _cls(getattr(kernel, "prepare_finalize", None))
                if manager is not None:
                    facts["all2all_manager"] = _cls(manager)
                if callable(getattr(kernel, "output_is_reduced", None)):
                    facts["output_is_reduced"] = attempt(lambda: bool(kernel.output_is_reduced()))
            act = getattr(experts, "activation", None)
            facts["layer_activation"] = describe(act)
            kernel_cls = type(getattr(kernel, "fused_experts", None)) if kernel is not None else \
                getattr(qm, "experts_cls", None)
            check = getattr(kernel_cls, "_supports_activation", None) if isinstance(kernel_cls, type) else None
            if act is not None and callable(check):
                # the harness's own question, asked of the unwrapped function: not recorded as vLLM's
                plain = _unwrap(check)
                facts["kernel_supports_activation"] = attempt(lambda: bool(plain(act)))
            rec.emit("postload-module", role=role, name=name, layer=layer, what="moe-runner", facts=facts)
        elif type(module).__name__ in experts_modules:
            act = getattr(module, "activation", None)
            facts["experts"] = _cls(module)
            facts["activation"] = getattr(act, "name", act) if act is not None else None
            fmt = getattr(module, "weight_format", None)
            if fmt is not None and getattr(fmt, "activations", None) is not None:
                facts["format_activations"] = sorted(fmt.activations)
            if hasattr(module, "_transformed_l1_weights"):  # classes that transform their weights after load
                facts["transformed"] = getattr(module, "_transformed_l1_weights", None) is not None
            # how these experts dispatch and combine: the DeepGEMM kernel their weight format names, whether they hold
            # a prepare/finalize or an MoE config (the shared path's objects), the symmetric-memory buffer cache their
            # class keeps (filled at the first forward), and the EP group's all2all manager beside them
            kernel_name = getattr(fmt, "kernel", None) if fmt is not None else None
            facts["kernel"] = kernel_name if isinstance(kernel_name, str) else None
            facts["prepare_finalize"] = _cls(getattr(module, "prepare_finalize", None))
            facts["has_moe_config"] = hasattr(module, "moe_config")
            facts["symm_buffer_cache"] = next((n for n in ("_symm_buffers", *own.symm_buffer_caches)
                                               if hasattr(type(module), n)), None)
            facts["all2all_manager"] = _cls(manager)
            facts["all2all_backend"] = getattr(pc, "all2all_backend", None)
            rec.emit("postload-module", role=role, name=name, layer=layer, what="mega-moe", facts=facts)
    rec.emit("postload-comm", role=role, all2all_backend=getattr(pc, "all2all_backend", None),
             all2all_manager=_cls(manager))
    own_model_facts = own.hook("model_facts")
    facts = own_model_facts(_language_model(model)) if own_model_facts is not None else None
    if facts is not None:
        rec.emit("postload-model", role=role, **facts)
