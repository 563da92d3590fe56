"""The stages of a resolve-mode run: platform, config, distributed, construct, inspect.

Imported only inside the pinned environment by :mod:`probes.resolve.agent`. It drives vLLM's own code paths
(the server's argument parser, ``create_engine_config``, the worker's distributed init, the model
loader's ``create_model``) and stands in only for device boundaries, each listed in SIMULATED.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import time

from probes.core import fence
from probes.resolve import simulate, standins
from probes.core.install import ProbeSet
from probes.core.patching import PostImportHooks
from probes import models as models_probes
from probes.core.targets import TARGETS, Target, with_model

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _first_attr(specs: list[str]):
    last = None
    for spec in specs:
        module, _, qual = spec.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in qual.split("."):
                obj = getattr(obj, part)
            return obj
        except (ImportError, AttributeError) as exc:
            last = exc
    raise ImportError(f"none of {specs} found: {last}")


def _vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ""


def serve_argv(plan: dict, cell: dict) -> list[str]:
    """The argv ``vllm serve`` would get for this cell (after the ``serve`` word); ``<model>`` inside a layout's
    argument is the cell's model directory (a speculative draft's config lives in ``<model>/draft``)."""
    model = cell.get("model_dir") or plan["model_dir"]
    return [model, *(a.replace("<model>", model) for a in cell["layout"]["serve_args"]), *plan.get("serve_args", [])]


def engine_args_from_serve_argv(argv: list[str]):
    """``vllm serve`` arguments (after the word ``serve``) -> AsyncEngineArgs, through vLLM's own
    server argument parser and validation, exactly as the CLI does it."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.from_cli_args(parse_serve_argv(argv))


def parse_serve_argv(argv: list[str]):
    """``vllm serve`` arguments -> the namespace vLLM's own server parser and validation produce."""
    parser_cls = _first_attr(["vllm.utils.argparse_utils:FlexibleArgumentParser",
                              "vllm.utils:FlexibleArgumentParser"])
    make_arg_parser = _first_attr(["vllm.entrypoints.common.cli_args:make_arg_parser",
                                   "vllm.entrypoints.launchers.cli_args:make_arg_parser",
                                   "vllm.entrypoints.openai.cli_args:make_arg_parser"])
    validate = _first_attr(["vllm.entrypoints.common.cli_args:validate_parsed_serve_args",
                            "vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
                            "vllm.entrypoints.openai.cli_args:validate_parsed_serve_args"])
    parser = make_arg_parser(parser_cls(description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    validate(args)
    return args


def _serving_facts(vllm_config) -> dict:
    """Config facts observe mode's workload relies on (layer count of a slice, capture sizes, ...)."""
    out = {}
    try:
        text = vllm_config.model_config.hf_text_config
        out["num_hidden_layers"] = getattr(text, "num_hidden_layers", None)
    except Exception:
        pass
    cc = getattr(vllm_config, "compilation_config", None)
    sizes = getattr(cc, "cudagraph_capture_sizes", None)
    if sizes is not None:
        out["cudagraph_capture_sizes"] = sorted(int(s) for s in sizes)
    out["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", ""))
    sc = vllm_config.scheduler_config
    out["chunked_prefill"] = bool(getattr(sc, "enable_chunked_prefill", False))
    out["load_format"] = str(getattr(vllm_config.load_config, "load_format", ""))
    return out


#: set by the agent before it starts itself again without shared imports (one of them read the device)
NO_SHARED_IMPORTS = "SERVING_TRUTH_NO_SHARED_IMPORTS"


def prepare_process(plan: dict, Stage) -> dict:
    """The agent's parent, shared by every fork: stub driver, platform-independent third-party imports, and,
    when the plan lists modules that earlier runs saw import without reading the device (``shared_imports``),
    the probes and simulated platform with no SKU set, then those modules.

    A device read while no SKU is set raises and is recorded (:class:`simulate.SkuNotSet`); ``retry`` then
    tells the agent to start again without shared imports, so a stale list costs time, never evidence."""
    from probes.core.environment import fingerprint
    from probes.core.recorder import Recorder

    simulate.load_stub_libcuda(plan["stub_libcuda"])
    for name in plan.get("warm_third_party", ()):
        try:
            importlib.import_module(name)
        except Exception:  # a warm-up import is an optimisation; the cell records real failures
            pass
    rec = Recorder(None, role="resolve-agent", meta={"mode": "resolve", "pin": plan.get("pin", ""),
                                                     "model": plan.get("model") or None,
                                                     "wheel_sha256": plan.get("wheel_sha256", "")})
    own = models_probes.load(plan.get("model_probes", ""), schemes=plan.get("schemes", ()))  # its data only
    rec.emit("fingerprint", **fingerprint(plan, packages=own.fingerprint_packages, modules=own.fingerprint_modules))
    shared = {"rec": rec, "error": None, "probes": None, "platform": False, "retry": None, "imported": []}
    modules = [] if os.environ.get(NO_SHARED_IMPORTS) else list(plan.get("shared_imports", ()))
    if not modules:
        return shared
    from probes.resolve.warmup import warm_up

    try:
        with Stage(rec, "platform"):
            shared["probes"] = _install_platform(plan, rec)
        shared["platform"] = True
        t0 = time.perf_counter()
        failures: list = []
        ok, failed = warm_up(modules, failures)  # one that fails here is imported (or fails) in each SM process
        shared["imported"] = [m for m in modules if m in sys.modules]
        # not a stage: whether modules were shared is speed only and must not change what a cell records
        rec.emit("shared_parent", listed=len(modules), ok=ok, failed=failed, failures=failures[:20],
                 seconds=round(time.perf_counter() - t0, 3))
    except Exception as exc:  # StageFailed: already recorded in the buffer every cell inherits
        shared["error"] = exc
    if simulate._State.reads_before_sku:
        shared["retry"] = list(simulate._State.reads_before_sku)
    return shared


def _target(t: dict) -> Target:
    """A probe target the plan sends (a model's own, or one a test plants), with every field Target has."""
    return Target(t["id"], t["kind"], tuple(t["specs"]), args=tuple(t.get("args", ())), phase=t.get("phase", ""),
                  title=t.get("title", ""), required=bool(t.get("required", True)),
                  construct=bool(t.get("construct", False)))


def _install_platform(plan: dict, rec):
    """Probes, stand-ins and the simulated platform: nothing here reads the SKU, so the shared parent can do it
    before any is set (each stand-in reads it when vLLM asks)."""
    simulate.simulate_torch()
    # the model's readings and dispatch lanes run in a bare run too (they patch nothing); its targets only when probed
    own = models_probes.use(models_probes.load(plan.get("model_probes", ""), resolve=True,
                                                     schemes=plan.get("schemes", ())))
    if plan.get("probes", True):
        targets = with_model(TARGETS, own.targets) + tuple(_target(t) for t in plan.get("extra_targets", ()))
        probes = ProbeSet(rec, targets=targets, vllm_version=_vllm_version()).install()
        hooks = probes.hooks
    else:  # a bare run, to compare against: same simulation, no probes
        probes, hooks = None, PostImportHooks()
    simulate.install_stand_ins(hooks, own.stand_ins)
    simulate.install_in_process_registry(hooks)
    simulate.install_node_topology(hooks)
    standins.install(hooks, own)
    from probes.resolve import memo

    memo.install(hooks, None if plan.get("postload_every_layer") else plan.get("memo_dir"), standins.humming_facts,
                 trust=plan.get("memo_trust", True))
    platform = simulate.install_platform()
    simulate.stand_in_cuda_streams()
    base = type(platform).__mro__[1]
    rec.emit("platform", cls=f"{base.__module__}:{base.__qualname__}")
    return probes


def prepare_group(plan: dict, first_cell: dict, shared: dict, Stage) -> dict:
    """One SM: its SKU, then (unless the shared parent did) probes and simulated platform, then vLLM's imports.
    Failures are recorded, then re-raised per cell. Imports here run with ``learning`` on: every module whose
    import reads the device is noted, so the host can tell which modules are safe to share."""
    rec = shared["rec"]
    warm: dict = {"error": shared["error"], "probes": shared["probes"], "rec": rec}
    if warm["error"] is not None:
        return warm
    simulate.set_simulated(first_cell["system"], first_cell["layout"]["world_size"])
    simulate.ImportOrder.start()
    try:
        if not shared["platform"]:
            with Stage(rec, "platform"):
                warm["probes"] = _install_platform(plan, rec)
        with Stage(rec, "imports"):
            from probes.resolve.warmup import warm_up

            # packages earlier runs saw imported only after a module that reads the device: imported first, so
            # the host can learn whether they read it themselves (and, if not, share them in later runs)
            warm_up(plan.get("ahead_imports", ()))
            for name in plan.get("warm_imports", ()):
                importlib.import_module(name)
            ok, failed = warm_up(plan.get("learned_imports", ()))
            rec.emit("warm_imports", listed=len(plan.get("warm_imports", ())), learned_ok=ok,
                     learned_failed=failed)
    except Exception as exc:  # StageFailed: already recorded in the buffer every cell inherits
        warm["error"] = exc
    return warm


def run_cell(plan: dict, cell: dict, rec, Stage, warm: dict) -> None:
    from probes.core.environment import availability
    from probes.core.stages import StageFailed

    system, layout = cell["system"], cell["layout"]
    probes = warm.get("probes")
    argv = ["vllm", "serve", *serve_argv(plan, cell)]
    rec.update_header(argv=argv)  # what the evidence is of: the host checks it against the run
    rec.emit("job", system=system, layout=layout, argv=argv)
    if warm.get("error") is not None:
        if probes is not None:
            probes.finalize()
        raise StageFailed("platform")
    if probes is None:
        rec.emit("probes", installed=False)
    simulate.set_simulated(system, layout["world_size"])
    try:
        _run_stages(plan, cell, rec, Stage)
    finally:
        answers = availability()
        rec.emit("availability_why", items=answers.pop("why_not", {}))
        rec.emit("availability", **answers)
        rec.emit("standin_fit", items=dict(sorted(fence.FIT.items())))
        rec.emit("simulated", items=dict(sorted(simulate.SIMULATED.items())),
                 stand_in_calls=simulate.STAND_IN_CALLS, kernel_calls=dict(sorted(standins.KERNEL_CALLS.items())),
                 memo=_memo_stats(),
                 device={"name": system["device_name"], "capability": list(system["capability"]),
                         "total_memory_gib": system["total_memory_gib"], "sm_count": system["sm_count"],
                         "device_count": layout["world_size"]})
        if probes is not None:
            probes.finalize()


def _memo_stats() -> dict:
    from probes.resolve import memo

    return {k: dict(v) for k, v in sorted(memo.STATS.items())}


def _run_stages(plan, cell, rec, Stage) -> None:
    with Stage(rec, "config"):
        from vllm.usage.usage_lib import UsageContext

        engine_args = engine_args_from_serve_argv(serve_argv(plan, cell))
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        rec.emit("config", architecture=list(getattr(mc.hf_config, "architectures", []) or []),
                 quantization=str(mc.quantization), dtype=str(mc.dtype),
                 tensor_parallel_size=pc.tensor_parallel_size, data_parallel_size=pc.data_parallel_size,
                 enable_expert_parallel=bool(pc.enable_expert_parallel),
                 moe_backend=str(getattr(getattr(vllm_config, "kernel_config", None), "moe_backend", "")),
                 max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                 speculative=str(getattr(vllm_config.speculative_config, "method", None)),
                 **_serving_facts(vllm_config))

    if plan.get("stop_after") == "config":  # the benchmark's floor: import vLLM + build one VllmConfig
        return
    from vllm.config import set_current_vllm_config

    with Stage(rec, "distributed"), set_current_vllm_config(vllm_config):
        _init_fake_distributed(vllm_config, rec)

    with Stage(rec, "construct"), set_current_vllm_config(vllm_config):
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.utils.torch_utils import set_default_torch_dtype

        loader = get_model_loader(vllm_config.load_config)
        # the loader's own construction step (weights are never loaded): create_model in 0.30+,
        # before that the initialize_model call load_model makes first
        if hasattr(loader, "create_model"):
            create = lambda: loader.create_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        else:
            from vllm.model_executor.model_loader.utils import initialize_model

            create = lambda: initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
        with set_default_torch_dtype(vllm_config.model_config.dtype), simulate.meta_device_mode():
            model = create()
        rec.emit("model", cls=f"{type(model).__module__}:{type(model).__qualname__}",
                 parameters_meta=all(p.is_meta for p in model.parameters()))

    draft = draft_config = None
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and getattr(spec, "draft_model_config", None) is not None:
        with Stage(rec, "construct-draft"), rec.about("draft"):  # every choice made building it is the draft's
            if getattr(spec, "method", None) != "mtp":  # EAGLE3, DSpark: the speculator's own loader builds it
                draft, draft_config = _draft_by_speculator(model, vllm_config, create_with=get_model_loader,
                                                           simulate=simulate)
            else:
                draft = _construct_draft(vllm_config, spec, create_with=get_model_loader, simulate=simulate)
            rec.emit("model", role="draft", cls=f"{type(draft).__module__}:{type(draft).__qualname__}",
                     parameters_meta=all(p.is_meta for p in draft.parameters()))

    with Stage(rec, "inspect"):
        inspect_model(model, rec)
        if draft is not None:
            with rec.about("draft"):
                inspect_model(draft, rec)
                describe_draft(draft, model, rec)

    if plan.get("postload", True):
        # after construction's evidence is recorded: post-load changes the modules it reads
        try:
            with Stage(rec, "post-load"):
                from probes.resolve import postload

                every = bool(plan.get("postload_every_layer"))
                postload.run(model, vllm_config, rec, every_layer=every)
                if draft is not None:  # vLLM's drafter loader post-processes the draft the same way
                    postload.run(draft, draft_config or _draft_config(vllm_config, spec), rec, role="draft",
                                 model_config=spec.draft_model_config, every_layer=every,
                                 weights=tuple(plan.get("draft_weights", ())))
        except _stage_failed():  # the driver itself failed: recorded; construction's evidence stands
            pass

    if plan.get("dispatch", True):  # per-call dispatch tiers (probes/resolve/dispatch.py); records, never raises
        from probes.resolve import dispatch

        dispatch.run([("target", model), ("draft", draft)], vllm_config, rec)

    if plan.get("observe_install"):
        try:
            session = check_observe_targets(rec)
        except Exception as exc:  # a check, not a stage: recorded, never fatal to the cell
            rec.emit("observe-status", targets={}, error=f"{type(exc).__name__}: {exc}")
        else:
            check_phase = models_probes.current().hook("check_phase")
            if check_phase is not None:  # the model's own layers' metadata, read the way the scope reads it
                check_phase(rec, session, model, vllm_config)
        if getattr(getattr(vllm_config, "profiler_config", None), "profiler", None):
            check_profiler(rec, serve_argv(plan, cell), vllm_config, prefix=f"check-{cell['system']['name']}")


def _stage_failed():
    from probes.core.stages import StageFailed

    return StageFailed


def check_profiler(rec, argv: list[str], vllm_config, *, prefix: str) -> None:
    """Observe mode's profiler settings against vLLM's real code, as far as a machine without a GPU
    goes: the worker's validation of the profiler config (under the simulated CUDA platform), the
    API server routes that config enables, and one real profiling session through the wrapper class
    vLLM's workers use, named as a worker names it (CPU activity only: no GPU here)."""
    out: dict = {}
    pc = vllm_config.profiler_config
    out["config"] = {"profiler": pc.profiler, "dir": pc.torch_profiler_dir,
                     "activities": list(pc.torch_profiler_activities or []), "with_stack": pc.torch_profiler_with_stack,
                     "ignore_frontend": pc.ignore_frontend}
    try:
        from vllm.profiler.wrapper import validate_worker_profiler_config

        validate_worker_profiler_config(pc)
        out["worker_validation"] = "ok"
    except Exception as exc:
        out["worker_validation"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        from fastapi import FastAPI
        from vllm.entrypoints.serve import register_vllm_serve_api_routers

        app = FastAPI()
        app.state.args = parse_serve_argv(argv)
        register_vllm_serve_api_routers(app)
        out["routes"] = sorted(p for p in (getattr(r, "path", "") for r in app.routes) if "profile" in p)
    except Exception as exc:
        out["routes_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        import torch
        from vllm.config.utils import replace
        from vllm.distributed.utils import get_worker_rank_suffix
        from vllm.profiler.wrapper import create_worker_profiler

        trace_dir = os.path.join(rec.out_dir, "traces-check")
        cpu = replace(pc, torch_profiler_activities=["CPU"], torch_profiler_dir=trace_dir)
        name = f"{prefix}_{get_worker_rank_suffix(global_rank=0)}"
        prof = create_worker_profiler(cpu, worker_name=name, local_rank=0)
        prof.start()
        a = torch.ones(64, 64)
        for _ in range(3):
            a = torch.mm(a, a) / 64
        prof.stop()
        out["trace_dir"] = "traces-check"
        out["worker_name"] = name
    except Exception as exc:
        out["session_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    rec.emit("observe-profiler-check", **out)


def check_observe_targets(rec) -> None:
    """Install observe mode's counting wrappers, scopes and graph hooks into this process (which has
    built the model), importing every module they name, and record what each target became:
    ``patched``, ``missing: ...`` (drift), or the import error of its module."""

    from probes.observe.session import GRAPH_HOOKS, ObserveSession, entries

    kernels, scopes = entries(models_probes.current())
    session = ObserveSession(rec, kernels=kernels, scopes=scopes).install()
    imports = {}
    for spec in [k.spec for k in kernels] + [s.spec for s in scopes] + list(GRAPH_HOOKS):
        module = spec.split(":", 1)[0]
        if module in imports:
            continue
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as exc:
            imports[module] = f"{type(exc).__name__}: {str(exc)[:300]}"
    status = {}
    for spec, st in session.status.items():
        module = spec.split(":", 1)[0]
        status[spec] = st if imports.get(module) == "ok" else f"import failed: {imports.get(module)}"
    rec.emit("observe-status", targets=dict(sorted(status.items())))
    return session


def _draft_config(vllm_config, spec):
    """The VllmConfig vLLM's drafter loader builds the draft under (the draft's overrides applied)."""
    return spec.apply_draft_overrides(vllm_config) if hasattr(spec, "apply_draft_overrides") else vllm_config


def _construct_draft(vllm_config, spec, *, create_with, simulate):
    """Build the speculative draft model the way vLLM's drafter loader does (draft overrides, the
    draft's model config, the "eagle_head" model tag), stopping before weights are loaded."""
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    draft_cfg = _draft_config(vllm_config, spec)
    try:
        from vllm.compilation.backends import set_model_tag
    except ImportError:  # older releases
        set_model_tag = None
    loader = create_with(draft_cfg.load_config)
    tag = set_model_tag("eagle_head") if set_model_tag else _nullcontext()
    with set_current_vllm_config(draft_cfg), tag, set_default_torch_dtype(spec.draft_model_config.dtype), \
            simulate.meta_device_mode():
        if hasattr(loader, "create_model"):
            return loader.create_model(vllm_config=draft_cfg, model_config=spec.draft_model_config)
        from vllm.model_executor.model_loader.utils import initialize_model

        return initialize_model(vllm_config=draft_cfg, model_config=spec.draft_model_config)


#: the fenced piece that stands in for vLLM's ``get_model`` inside a speculator's draft loader
DRAFT_LOADER = "draft loader's get_model (construction only, no weights)"


def _draft_by_speculator(model, vllm_config, *, create_with, simulate):
    """A speculative draft (EAGLE3, DSpark, ...), built by the speculator vLLM's runner builds (``init_speculator``,
    on meta) and its own ``load_draft_model(target, ...)``: that loader derives the draft's VllmConfig itself (the
    draft's tensor parallel size, non-causal attention, cache dtype, quant config) and its model tag. Its call of
    vLLM's ``get_model`` is stood in by construction alone (no weights, meta device), like the target's."""
    import vllm.model_executor.model_loader as loaders
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from probes.resolve.dispatch import draft_speculator

    speculator = draft_speculator(vllm_config)  # the one the dispatch lanes read the draft's passes from
    original, built = loaders.get_model, []

    @fence.guard(DRAFT_LOADER)
    def construct_only(*, vllm_config, model_config=None, **_):
        built.append(vllm_config)  # the draft's own config, as the loader derived it (post-load runs under it)
        model_config = model_config or vllm_config.model_config
        loader = fence.foreign(create_with, vllm_config.load_config)
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), \
                simulate.meta_device_mode():
            if hasattr(loader, "create_model"):
                return fence.foreign(loader.create_model, vllm_config=vllm_config, model_config=model_config)
            from vllm.model_executor.model_loader.utils import initialize_model

            return fence.foreign(initialize_model, vllm_config=vllm_config, model_config=model_config)

    simulate.SIMULATED[DRAFT_LOADER] = (
        "the speculator's draft loader (the speculator's load_draft_model) runs as vLLM's; its get_model builds "
        "the draft on the meta device under the config the loader derived and loads no weights")
    # the loaders call get_model by the name their module imported (eagle) or import it when called (DSpark)
    holders = [loaders] + [m for name, m in list(sys.modules.items())
                           if name.startswith("vllm.v1.worker.gpu.spec_decode") and m is not None
                           and getattr(m, "get_model", None) is original]
    for holder in holders:
        holder.get_model = construct_only
    try:
        draft = speculator.load_draft_model(model, set())
    finally:
        for holder in holders:
            holder.get_model = original
    return draft, built[-1] if built else None


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def _init_fake_distributed(vllm_config, rec) -> None:
    """Make this process rank 0 of the layout's world with torch's fake process group."""
    from vllm.distributed import parallel_state as ps

    pc = vllm_config.parallel_config
    world = pc.world_size_across_dp if pc.data_parallel_size > 1 else pc.world_size
    simulate.fake_world(world)
    orig_init = ps.GroupCoordinator.__init__

    @fence.guard("vllm GroupCoordinator")
    def coordinator_init(self, *args, **kwargs):
        import inspect

        bound = inspect.signature(orig_init).bind(self, *args, **kwargs)
        if not bound.arguments.get("use_all2all"):
            bound.arguments["use_device_communicator"] = False
        if "use_message_queue_broadcaster" in bound.arguments:
            bound.arguments["use_message_queue_broadcaster"] = False
        fence.foreign(orig_init, *bound.args, **bound.kwargs)

    ps.GroupCoordinator.__init__ = coordinator_init
    simulate.SIMULATED["vllm GroupCoordinator"] = (
        "built without shm broadcaster; only the expert-parallel group (the one vLLM asks for all2all) gets its "
        "device communicator, so vLLM builds and picks its all2all manager itself; no other group has one")
    standins.no_nccl()
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    init_worker_distributed_environment(vllm_config, rank=0, distributed_init_method="tcp://127.0.0.1:1",
                                        local_rank=0, backend="fake")
    try:  # what vLLM's GPU worker sets up next, before its model runner: the workspace manager (0.27 on)
        from vllm.v1.worker.workspace import init_workspace_manager
    except ImportError:
        pass
    else:
        import torch

        init_workspace_manager(torch.device("meta"))
        simulate.SIMULATED["vllm workspace manager"] = (
            "vLLM's own init_workspace_manager, on the meta device (the GPU worker calls it before it builds the "
            "model runner): scratch buffers get their shapes, nothing is allocated")
    rec.emit("distributed", world_size=world)


def describe_draft(draft, target, rec) -> None:
    """What a speculative draft is beside its target, as vLLM built it: its class; how vLLM numbers its layers
    (a draft's modules count from 0, while vLLM names its attention layers after the target's, e.g. EAGLE3's
    ``model.layers.0`` serves as ``model.layers.93``: read from each attention module's ``layer_name``, the name
    vLLM registers it under); and the target modules it holds as its own (the very objects, topmost only)."""
    numbering: dict[str, int] = {}
    for name, module in draft.named_modules():
        own = _LAYER_RE.search(name)
        registered = getattr(module, "layer_name", None)
        served = _LAYER_RE.search(registered) if own and isinstance(registered, str) else None
        if served:
            numbering.setdefault(own.group(1), int(served.group(1)))
    rec.emit("draft", cls=f"{type(draft).__module__}:{type(draft).__qualname__}", numbering=numbering,
             shares=shared_modules(draft, target))


def shared_modules(draft, target) -> list[list[str]]:
    """The target's modules a speculative draft holds as its own (the very objects, topmost only), as
    [draft module, target module] name pairs: both engines' draft records."""
    target_names = {id(m): name for name, m in target.named_modules()}
    shares: list[list[str]] = []
    for name, module in draft.named_modules():
        if id(module) in target_names and not any(name.startswith(d + ".") for d, _ in shares):
            shares.append([name, target_names[id(module)]])
    return shares


def inspect_model(model, rec) -> None:
    """Read per-layer choices off the constructed modules (the objects serving would use).

    This runs after the whole model is built, so it also sees choices made after a layer's own
    constructor (e.g. linear methods swapped at the end of model construction).
    """
    from probes.core.install import _interesting_attrs
    from probes.core.recorder import describe

    for name, module in model.named_modules():
        m = _LAYER_RE.search(name)
        if not m:
            continue
        facts = _interesting_attrs(module)
        qm = getattr(module, "quant_method", None)
        if qm is not None and not isinstance(qm, type):
            facts["quant_method"] = describe(type(qm))
            for attr, value in _interesting_attrs(qm).items():
                facts[f"quant_method.{attr}"] = value
        if facts:
            rec.emit("module", name=name, layer=int(m.group(1)),
                     cls=f"{type(module).__module__}:{type(module).__qualname__}", facts=facts)
