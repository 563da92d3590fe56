"""One SGLang cell in resolve mode: the stages SGLang's own code runs for a (system, layout), and what SGLang
decided, read from SGLang.

Stages (each recorded with its outcome; a failing one is evidence, not a crash):

* ``config``: ``prepare_server_args`` on the layout's ``sglang serve`` arguments, then ``publish`` (which runs
  SGLang's whole resolution pipeline, ``resolve_once``). Every kernel-choosing field's resolved value is read
  with SGLang's ``resolution_result``, and who declared it with SGLang's declaration stash
  (``_resolved_overrides``): the values declared before the last one are the defaults SGLang replaced.
* ``distributed``: this process as rank 0 of the layout's world on torch's fake process group; SGLang's own
  ``init_distributed_environment``, ``initialize_model_parallel`` and DP-attention setup.
* ``construct``: SGLang's model loader's ``_initialize_model`` on the meta device (every layer's ``__init__``
  ran, the MoE runner included: SGLang builds it in the MoE layer's constructor).
* ``construct-draft`` (layouts with a speculative draft model): the draft's model config as SGLang's draft worker
  builds it (``ModelConfig.from_server_args`` with the draft's path, ``is_draft_model``), and the draft model on the
  meta device by the same loader inside SGLang's ``draft_model_build_scope``.
* ``inspect``: each built block's class, and what the experts' quantization method and runner hold; for a draft, the
  attention backends its runner serves it with, from SGLang's own ``resolve_attention_backend_strs`` on the draft
  runner's two fields (``is_draft_worker`` and ``draft_attention_backend``, the latter from SGLang's
  ``resolve_draft_attention_backend`` with what the algorithm's worker hands it).

Nothing here picks a backend: the records are SGLang's answers. What SGLang reads of the device is the simulated
GPU's (``probes.engines.sglang.platform``).
"""
from __future__ import annotations

import importlib


from probes.core import fence
from probes.core.recorder import describe
from probes.core.stages import Stage, StageFailed
from probes.engines.sglang import platform
from probes.resolve import simulate

#: how the evidence names the command a layout's arguments follow (``argv[2]`` is the model directory)
LAUNCH = ("sglang.launch_server", "--model-path")

#: the resolved server arguments that choose a kernel or a lane's shape, read from SGLang's resolution
DECISIONS = (
    "attention_backend", "prefill_attention_backend", "decode_attention_backend", "speculative_attention_mode",
    "speculative_algorithm", "speculative_draft_attention_backend", "speculative_moe_runner_backend",
    "linear_attn_backend", "linear_attn_decode_backend", "linear_attn_prefill_backend", "linear_attn_verify_backend",
    "mamba_backend", "moe_runner_backend", "moe_a2a_backend", "ep_size", "tp_size", "dp_size",
    "enable_dp_attention", "attn_dp_size", "kv_cache_dtype", "page_size", "flashinfer_mxfp4_moe_precision",
    "enable_w4a4_mxfp4_megamoe", "device", "disable_cuda_graph", "cuda_graph_max_bs", "chunked_prefill_size",
    "disable_shared_experts_fusion", "boundary_reduction",
)

#: attributes of the experts' quantization method that say which kernel family its ``apply`` takes
QUANT_METHOD_FACTS = ("use_flashinfer", "use_marlin", "use_deep_gemm", "use_triton_kernels", "use_mega_moe",
                      "_fi_kernel", "_use_sm90_humming", "flashinfer_mxfp4_moe_precision")


def serve_argv(plan: dict, cell: dict) -> list[str]:
    """``sglang.launch_server --model-path MODEL <layout args>``: ``<model>`` in an argument is the model
    directory."""
    model = cell["model_dir"]
    args = [str(a).replace("<model>", model) for a in cell["layout"]["serve_args"]]
    return [*LAUNCH, model, *args, *plan.get("serve_args", [])]


def run_cell(plan: dict, cell: dict, rec, error) -> None:
    system, layout = cell["system"], cell["layout"]
    argv = serve_argv(plan, cell)
    rec.update_header(argv=argv)
    rec.emit("job", system=system, layout=layout, argv=argv)
    if error is not None:
        raise StageFailed("imports")
    simulate.set_simulated(system, layout["world_size"])
    try:
        _stages(plan, cell, rec, argv)
    finally:
        rec.emit("availability", **_availability())
        rec.emit("simulated", items=dict(sorted(simulate.SIMULATED.items())),
                 device={"name": system["device_name"], "capability": list(system["capability"]),
                         "total_memory_gib": system["total_memory_gib"], "sm_count": system["sm_count"],
                         "device_count": layout["world_size"]})
        for piece in platform.FIT_TARGETS:  # every stand-in's and reader's fit, whether or not this cell reached it
            try:
                platform.check_fit(piece)
            except ImportError as exc:
                fence.FIT[piece] = f"does not fit: {platform.FIT_TARGETS[piece][0]} does not import ({exc})"
        rec.emit("standin_fit", items=dict(sorted(fence.FIT.items())))


def _stages(plan: dict, cell: dict, rec, argv: list[str]) -> None:
    with Stage(rec, "config"):
        from sglang.srt.server_args import prepare_server_args

        sa = prepare_server_args(list(argv[1:]))
        _publish(sa)
        mc = _record_decisions(sa, rec)
    with Stage(rec, "distributed"), platform.cuda_allocations_to_meta():
        _init_distributed(sa, mc, rec)
    with Stage(rec, "construct"):
        model = _construct(sa, rec)
    draft = None
    if _draft_path(sa):
        with Stage(rec, "construct-draft"), rec.about("draft"):
            draft, draft_mc = _construct_draft(sa, mc, rec)
    with Stage(rec, "inspect"):
        _inspect(model, sa, mc, rec)
        if draft is not None:
            with rec.about("draft"):
                _inspect(draft, sa, draft_mc, rec)
                _describe_draft(draft, model, sa, rec)


def _publish(sa) -> None:
    """SGLang's ``publish`` as its scheduler process calls it for rank 0 (its resolution pipeline runs here)."""
    import inspect

    from sglang.srt import runtime_context as rc

    if "ranks" in inspect.signature(rc.publish).parameters:
        rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0))
    else:
        rc.publish(sa, role="scheduler")


def _record_decisions(sa, rec):
    """SGLang's resolved value of each deciding field (``resolution_result``), what the user passed
    (``_raw_input``), and every declaration of the field in order (source, value): the stash is SGLang's own."""
    from sglang.srt.arg_groups.overrides import resolution_result

    stash = list(getattr(sa, "_resolved_overrides", None) or ())
    raw = dict(getattr(sa, "_raw_input", None) or {})
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig.from_server_args(sa)
    rec.emit("config", architecture=list(getattr(mc.hf_config, "architectures", []) or []),
             quantization=str(mc.quantization), dtype=str(mc.dtype), attention_arch=str(mc.attention_arch),
             tp_size=int(resolution_result(sa, "tp_size") or 1), dp_size=int(resolution_result(sa, "dp_size") or 1),
             ep_size=int(resolution_result(sa, "ep_size") or 1))
    for field in DECISIONS:
        if not hasattr(sa, field):
            continue
        declared = [[str(source), describe(fields[field])] for source, fields in stash if field in fields]
        rec.emit("select", target=f"server_args.{field}", scope="", result=describe(resolution_result(sa, field)),
                 raw=describe(raw.get(field, getattr(sa, field, None))), declared=declared)
    return mc


def _init_distributed(sa, mc, rec) -> None:
    """Rank 0 of the layout's world on torch's fake process group, then SGLang's own parallel runtime: the entry its
    scheduler calls (``bootstrap.init_parallel_runtime`` and ``init_layer_runtime``; 0.5.19's
    ``init_torch_distributed`` with the rank-0 ``ParallelState`` its scheduler builds)."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    world = int(parallel.tp_size) * int(parallel.pp_size)
    simulate.fake_world(world)
    orig_init = ps.GroupCoordinator.__init__
    platform.check_fit("sglang GroupCoordinator")

    @fence.guard("sglang GroupCoordinator")
    def coordinator_init(self, *args, **kwargs):
        import inspect

        bound = inspect.signature(orig_init).bind(self, *args, **kwargs)
        for name in list(bound.arguments):
            if name.startswith("use_"):  # every device communicator (NCCL, custom all-reduce, ...): none is built
                bound.arguments[name] = False
        fence.foreign(orig_init, *bound.args, **bound.kwargs)

    ps.GroupCoordinator.__init__ = coordinator_init
    simulate.SIMULATED["sglang GroupCoordinator"] = (
        "built without device communicators or broadcasters (every use_* argument False): the groups exist with "
        "their ranks; no collective is run in resolve mode")
    if hasattr(bootstrap, "init_parallel_runtime"):
        bootstrap.init_parallel_runtime(server_args=sa, device="cuda", dist_port=1)
        bootstrap.init_layer_runtime(model_config=mc)
    else:
        from sglang.srt.distributed.parallel_state_wrapper import ParallelState
        from sglang.srt.layers.dp_attention import compute_dp_attention_world_info

        attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size = compute_dp_attention_world_info(
            parallel.enable_dp_attention, 0, parallel.tp_size, parallel.dp_size, parallel.attn_cp_size)
        state = ParallelState(
            tp_rank=0, tp_size=parallel.tp_size, pp_rank=0, pp_size=parallel.pp_size,
            dp_rank=0 if parallel.dp_size > 1 else None, dp_size=parallel.dp_size, attn_tp_rank=attn_tp_rank,
            attn_tp_size=attn_tp_size, attn_cp_rank=0, attn_cp_size=parallel.attn_cp_size, attn_dcp_rank=0,
            attn_dcp_size=parallel.dcp_size, attn_dp_rank=attn_dp_rank, attn_dp_size=attn_dp_size, moe_ep_rank=0,
            moe_ep_size=parallel.ep_size, moe_dp_rank=0, moe_dp_size=parallel.moe_dp_size, gpu_id=0)
        bootstrap.init_torch_distributed(server_args=sa, model_config=mc, device="cuda", ps=state, dist_port=1,
                                         is_draft_worker=False, local_omp_cpuid=None)
    rec.emit("distributed", world_size=world)


def _construct(sa, rec):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    initialize_moe_config()
    for module, fn in (("sglang.srt.layers.quantization.fp8_utils", "initialize_fp8_gemm_config"),
                       ("sglang.srt.layers.quantization.fp4_utils", "initialize_fp4_gemm_config")):
        getattr(importlib.import_module(module), fn)()
    mc = ModelConfig.from_server_args(sa)
    lc = LoadConfig(load_format="dummy")
    qc = _get_quantization_config(mc, lc)
    simulate.stand_in_cuda_streams()
    with set_default_torch_dtype(mc.dtype), simulate.meta_device_mode():
        model = _initialize_model(mc, lc, qc)
    rec.emit("model", cls=f"{type(model).__module__}:{type(model).__qualname__}",
             quant_config=type(qc).__name__ if qc is not None else None)
    return model


def _draft_path(sa) -> str | None:
    """The draft model SGLang's speculative worker loads (``speculative_draft_model_path``, as resolved)."""
    from sglang.srt.arg_groups.overrides import resolution_result

    if not describe(resolution_result(sa, "speculative_algorithm")) or not hasattr(sa, "speculative_draft_model_path"):
        return None
    return resolution_result(sa, "speculative_draft_model_path") or None


def _construct_draft(sa, target_mc, rec):
    """The speculative draft as SGLang's draft worker builds it (``TpModelWorker._init_model_config`` with
    ``is_draft_worker``: the draft's path, ``is_draft_model=True``, the target's context length), constructed by the
    loader on the meta device inside ``draft_model_build_scope`` (the draft's construction-time MoE settings)."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.moe.utils import draft_model_build_scope
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    mc = ModelConfig.from_server_args(sa, model_path=_draft_path(sa), is_draft_model=True,
                                      context_length=target_mc.context_len)
    lc = LoadConfig(load_format="dummy")
    qc = _get_quantization_config(mc, lc)
    platform.check_fit("sglang draft model build")
    with draft_model_build_scope(), set_default_torch_dtype(mc.dtype), simulate.meta_device_mode():
        draft = _initialize_model(mc, lc, qc)
    rec.emit("model", role="draft", cls=f"{type(draft).__module__}:{type(draft).__qualname__}",
             architecture=list(getattr(mc.hf_config, "architectures", []) or []),
             quant_config=type(qc).__name__ if qc is not None else None,
             parameters_meta=all(p.is_meta for p in draft.parameters()))
    return draft, mc


#: SGLang's function that gives a draft worker its attention backend where the caller names none (the DSpark-family
#: workers call it through ``build_draft_tp_worker``), by release: 0.5.23 exports it, earlier releases keep it private
DRAFT_WORKER_BACKEND = ("resolve_draft_worker_attention_backend", "_resolve_draft_attention_backend_fallback")
#: the speculative algorithms whose worker builds its draft through ``build_draft_tp_worker`` (the others hand the
#: draft's ``TpModelWorker`` no attention backend): read from SGLang's workers, fenced by the fit check
DRAFT_TP_WORKER_ALGORITHMS = ("DSPARK", "DFLASH")


def _describe_draft(draft, target, sa, rec) -> None:
    """The draft beside its target: its class, the target modules it holds as its own (topmost only), and the
    attention backends its runner serves it with, from SGLang's functions (see the module's docstring)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.model_executor import model_runner as mr
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        resolve_attention_backend_strs)
    from sglang.srt.speculative import draft_worker_common as dwc

    for piece in ("sglang draft worker attention", "sglang draft ModelRunner (attention backend)",
                  "sglang draft runner's own backend"):
        platform.check_fit(piece)
    algorithm = str(describe(resolution_result(sa, "speculative_algorithm")))
    handed = None
    if algorithm.upper() in DRAFT_TP_WORKER_ALGORITHMS:
        pick = next(getattr(dwc, n) for n in DRAFT_WORKER_BACKEND if hasattr(dwc, n))
        handed = pick(algo_label=algorithm.upper())
    own = mr.resolve_draft_attention_backend(draft_attention_backend=handed, is_draft_worker=True)

    strs = resolve_attention_backend_strs(model_runner=_draft_runner(own))
    from probes.resolve.cell import shared_modules

    rec.emit("draft", cls=f"{type(draft).__module__}:{type(draft).__qualname__}", numbering={},
             shares=shared_modules(draft, target))
    for name, module in draft.named_modules():
        if name.rsplit(".", 1)[-1] == "self_attn" and _layer(name) is not None:
            rec.emit("construct", target="draft.attention", scope=name,
                     cls=f"{type(module).__module__}:{type(module).__qualname__}",
                     attrs={"prefill": describe(strs.prefill), "decode": describe(strs.decode),
                            "draft_override": bool(strs.is_draft_override), "worker_backend": describe(handed),
                            "speculative_algorithm": algorithm})


class _DraftRunner:
    """The two fields of a draft ``ModelRunner`` that SGLang's ``resolve_attention_backend_strs`` reads."""

    is_draft_worker = True

    def __init__(self, backend):
        self.draft_attention_backend = backend

    def __getattr__(self, name):  # SGLang read a field this stand-in does not carry: it no longer fits
        raise fence.ContractBroken(f"sglang draft ModelRunner (attention backend): SGLang read {name!r}, which the "
                                   "stand-in does not carry")


@fence.guard("sglang draft ModelRunner (attention backend)", contract=fence.returns(_DraftRunner))
def _draft_runner(backend) -> _DraftRunner:
    simulate.SIMULATED["sglang draft ModelRunner (attention backend)"] = (
        "an object carrying only is_draft_worker and draft_attention_backend (SGLang's own "
        "resolve_draft_attention_backend answer), handed to SGLang's resolve_attention_backend_strs")
    return _DraftRunner(backend)


def _inspect(model, sa, mc, rec) -> None:
    """The decoder layers' blocks as SGLang built them (``scope`` records: layer kinds come from these classes),
    and per layer what SGLang chose for it: the experts' quantization method and MoE runner as built, and the
    attention backends of the runner that serves each attention layer, from SGLang's own functions
    (``runtime_context.attention_backends``, ``resolve_linear_attn_backends``)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.layers.moe import utils as moe_utils

    backends: dict = {}  # read once, where the model has a layer of the kind (a draft may have none)

    def mla() -> dict:
        if "mla" not in backends:
            backends["mla"] = _mla_backends(sa)
        return backends["mla"]

    def kda() -> dict | None:
        if "kda" not in backends:
            backends["kda"] = _kda_backends(mc)
        return backends["kda"]

    moe_globals = {"moe_runner_backend": describe(moe_utils.get_moe_runner_backend()),
                   "moe_a2a_backend": describe(moe_utils.get_moe_a2a_backend())}
    spec = describe(resolution_result(sa, "speculative_algorithm"))
    for name, module in model.named_modules():
        layer = _layer(name)
        if layer is None or name.startswith(("vision_tower.", "mm_projector.")):
            continue
        leaf = name.rsplit(".", 1)[-1]
        cls = type(module)
        qual = f"{cls.__module__}:{cls.__qualname__}"
        if leaf in ("self_attn", "mlp") and name.endswith(f"layers.{layer}.{leaf}"):
            rec.emit("scope", target="scope.block", prefix=name, cls=qual)
        if leaf == "mlp" and hasattr(module, "_use_mega_moe"):
            # the MoE block's own decision whether its forward routes the experts through MegaMoE
            # (``_forward_mega_experts``) instead of its experts module
            mega = bool(getattr(module, "_use_mega_moe"))
            rec.emit("construct", target="moe.block", scope=name, cls=qual, attrs={
                "use_mega_moe": mega,
                "mega_experts": f"{cls.__name__}._forward_mega_experts" if mega else None,
                "ep_a2a": describe(getattr(module, "_ep_a2a", None)),
                "defer_moe_finalize": describe(getattr(module, "_defer_moe_finalize", None))})
        if leaf == "self_attn":
            kind = cls.__name__
            if "MLA" in kind:
                rec.emit("construct", target="mla.backends", scope=name, cls=qual,
                         attrs={**mla(), "speculative_algorithm": spec})
            elif "DeltaAttention" in kind and kda() is not None:
                rec.emit("construct", target="kda.backends", scope=name, cls=qual,
                         attrs={**kda(), "speculative_algorithm": spec})
        if name.endswith(".mlp.experts"):
            qm = getattr(module, "quant_method", None)
            runner = getattr(qm, "runner", None)
            attrs = {k: describe(getattr(qm, k)) for k in QUANT_METHOD_FACTS if hasattr(qm, k)}
            attrs["runner_backend"] = describe(getattr(runner, "runner_backend", None)) if runner is not None else None
            attrs["quant_method"] = type(qm).__name__ if qm is not None else None
            attrs["experts_cls"] = cls.__name__
            attrs.update(moe_globals)
            # what the experts run with: the runner their quantization method built, or, where it built none (its
            # apply calls the kernel itself), the resolved global runner backend
            attrs["runner"] = attrs["runner_backend"] or attrs["moe_runner_backend"]
            rec.emit("construct", target="moe.experts", scope=name, cls=qual, attrs=attrs)
            if attrs.get("_fi_kernel"):  # the FlashInfer entry its quantization method picked for this GPU
                rec.emit("construct", target="moe.flashinfer", scope=name, cls=qual,
                         attrs={"fi_kernel": attrs["_fi_kernel"], "runner": attrs["runner"]})
        if leaf in ("gate_up_proj", "down_proj") and ".mlp." in name and ".experts" not in name:
            qm = getattr(module, "quant_method", None)
            rec.emit("module", name=name, layer=layer, facts={"quant_method": type(qm).__name__ if qm else None,
                                                              "cls": cls.__name__})


def _mla_backends(sa) -> dict:
    """The (prefill, decode) pair SGLang's runner serves MLA with (``runtime_context.attention_backends``), and the
    backend speculative verification runs on (``speculative_attention_mode`` names which of the two)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.runtime_context import attention_backends

    prefill, decode = attention_backends()
    mode = resolution_result(sa, "speculative_attention_mode")
    return {"prefill": describe(prefill), "decode": describe(decode), "verify_mode": describe(mode),
            "verify": describe(decode if mode == "decode" else prefill)}


def _kda_backends(mc) -> dict | None:
    """The linear-attention runner's per-phase kernels, from SGLang's ``resolve_linear_attn_backends`` with the
    prefill default its attention registry gives a KDA runner (``flashinfer_kda_prefill_default``, where the release
    has one; it reads only the runner's model config, so the runner stand-in carries just that)."""
    try:
        from sglang.srt.layers.attention.linear.utils import resolve_linear_attn_backends
    except ImportError:
        return None
    prefill_default = None
    try:
        from sglang.srt.layers.attention.linear.kda_backend import flashinfer_kda_prefill_default
    except ImportError:
        flashinfer_kda_prefill_default = None
    if flashinfer_kda_prefill_default is not None:
        class _Runner:  # an object SGLang's function reads one attribute of
            model_config = mc

        prefill_default = flashinfer_kda_prefill_default(_Runner())
        simulate.SIMULATED["sglang ModelRunner (KDA prefill default)"] = (
            "an object carrying only the model config, handed to SGLang's flashinfer_kda_prefill_default")
    b = resolve_linear_attn_backends(prefill_default=prefill_default)
    return {"prefill": describe(b.prefill.value), "decode": describe(b.decode.value),
            "verify": describe(b.verify.value), "prefill_default": describe(prefill_default)}


def _layer(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _availability() -> dict:
    """SGLang's own answers on the optional packages it reads, asked after the cell ran: ``get_platform()``'s
    ``has_flashinfer`` (what is installed at all is the fingerprint's)."""
    out = {}
    try:
        from sglang.srt.runtime_context import get_platform

        out["flashinfer"] = bool(get_platform().has_flashinfer)
    except Exception as exc:
        out["flashinfer"] = f"unknown ({type(exc).__name__})"
    return out


__all__ = ["DECISIONS", "LAUNCH", "run_cell", "serve_argv"]
