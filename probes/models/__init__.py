"""What a model brings to the probes: one package per model (``probes/models/<name>/``), named by the host's
profile (``Profile.probes``) and sent in the plan (``"model_probes"``).

The shared probes (``probes/core``, ``probes/resolve``, ``probes/observe``) know no model by name: they wrap
vLLM's shared layers and selectors, run vLLM's post-load steps and its shared per-call dispatch functions. What
only one model has comes from its package, in two parts:

``probes/models/<name>/__init__.py`` (data; standard library only, read by both modes)
    ``TARGETS``   what resolve and observe wrap besides the shared targets (the model's layer scopes and
                  selectors), as :class:`probes.core.targets.Target`;
    ``KERNELS``, ``SCOPES``  observe mode's kernel entries and layer scopes besides the shared ones;
    ``KERNEL_NAMES``  the GPU kernels each of its kernel paths launches (read with profiler traces);
    ``STAND_INS``, ``META_DEVICE_ARGS``  resolve mode's stand-ins for the model's own classes and calls (the
                  formats of :data:`probes.resolve.simulate.STAND_INS` and :data:`probes.resolve.standins.META_DEVICE_ARGS`);
    ``DEVICE_EXPERTS``  experts classes of the model whose per-call variant the device picks (class name ->
                  why), and ``EXPERTS_MODULES`` those that are modules of their own (no MoE runner around them);
    ``SYMM_BUFFER_CACHES``  class attributes of such modules that cache a symmetric-memory buffer;
    ``FINGERPRINT_PACKAGES``, ``FINGERPRINT_MODULES``  the model's own kernel packages and modules whose presence
                  changes what vLLM selects for it (added to the evidence's environment fingerprint).

``probes/models/<name>/resolve.py`` (resolve mode only; imports vLLM inside its functions), any of:
    ``LANES``                 (lane id, function) dispatch lanes run after the shared ones
                              (the contract of :mod:`probes.resolve.dispatch`);
    ``STEP_PATH``             a :class:`StepPath`: a path of the model's own that serves some steps instead of
                              the stock forward (the serving-path lane asks it per step);
    ``postload_steps(lm)``    steps the worker runs once the weights are loaded, after vLLM's loader steps;
    ``runner_facts(runner)``  what the model's MoE runners left behind at post-load, merged into each runner's facts;
    ``block_facts(module)``   for a module of the model's own that holds its MoE (its MoE block): which MoE path it
                              built, read off vLLM's attributes (a ``moe-block`` record), else None;
    ``model_facts(lm)``       the model-level reading after post-load (a ``postload-model`` record), or None;
    ``check_phase(rec, session, model, vllm_config)``  observe mode's phase attribution checked on the built model.

:func:`load` reads both parts; a model without a package (an empty name) gets no additions.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class StepPath:
    """A path of the model's own that serves some steps in place of the stock forward.

    ``build(model, vllm_config)`` returns vLLM's planner for it (None where the layout does not ask for the path);
    ``takes(planner, cg_mode, padded_tokens, workload)`` is vLLM's own answer for one step; ``describe(planner)``
    says what the planner was built with (for the lane's source)."""
    name: str
    build: Callable
    takes: Callable
    describe: Callable


@dataclass(frozen=True)
class ModelProbes:
    name: str = ""
    targets: tuple = ()
    kernels: tuple = ()
    scopes: tuple = ()
    kernel_names: tuple = ()
    stand_ins: tuple = ()
    meta_device_args: tuple = ()
    device_experts: dict = field(default_factory=dict)
    experts_modules: tuple = ()
    #: class attributes of its experts modules that cache a symmetric-memory buffer (read at post-load)
    symm_buffer_caches: tuple = ()
    fingerprint_packages: tuple = ()
    fingerprint_modules: tuple = ()
    #: the quantization schemes whose additions are merged in (``probes/schemes``)
    schemes: tuple = ()
    #: the resolve-side module (None in observe mode, or when the model has none)
    resolve: object = None

    @property
    def lanes(self) -> tuple:
        return tuple(getattr(self.resolve, "LANES", ()))

    @property
    def step_path(self) -> StepPath | None:
        return getattr(self.resolve, "STEP_PATH", None)

    def hook(self, name: str):
        """The resolve module's function *name* (a declared hook: :data:`HOOKS`), or None where it has none."""
        if name not in HOOKS:
            raise KeyError(f"{name!r} is no declared model hook (hooks: {', '.join(sorted(HOOKS))})")
        return getattr(self.resolve, name, None)


class UnknownModel(ValueError):
    pass


#: the functions a model's resolve module may define, declared (as pytest declares its hookspecs): the shared probes
#: call only these names, and a resolve module defining a public function that is neither one of them nor a lane
#: listed in its ``LANES`` is refused when it loads (a typo never silently does nothing)
HOOKS = {
    "postload_steps": "steps the worker runs once the weights are loaded, after vLLM's loader steps",
    "runner_facts": "what the model's MoE runners left behind at post-load",
    "block_facts": "which MoE path the model's own MoE block built",
    "model_facts": "the model-level reading after post-load",
    "check_phase": "observe mode's phase attribution checked on the built model",
}


def check_resolve_module(name: str, module) -> None:
    """Refuse a resolve module whose public functions are not declared hooks or its listed lanes."""
    lanes = {getattr(fn, "__name__", "") for _lane, fn in getattr(module, "LANES", ())}
    for attr, obj in vars(module).items():
        if attr.startswith("_") or not callable(obj) or isinstance(obj, type):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # imported from elsewhere
        if attr not in HOOKS and attr not in lanes:
            raise UnknownModel(f"model probes {name!r}: {module.__name__} defines {attr}(), which is no hook and no "
                               f"lane in its LANES (hooks: {', '.join(sorted(HOOKS))}); rename it, list it in LANES, "
                               "or make it private (a leading underscore)")


def load(name: str, *, resolve: bool = False, schemes=()) -> ModelProbes:
    """The probes package of model *name* (``""``: none), with what the quantization *schemes* its profile selects
    bring (``probes/schemes``: their targets, kernel entries and experts classes come first, the model's own after
    them, so a model's target of a scheme target's id takes its place). ``resolve`` also imports its resolve-side
    module."""
    from probes import schemes as schemes_mod

    parts = schemes_mod.load_all(schemes)
    if not name:
        return _with_schemes(ModelProbes(), parts)
    if not name.isidentifier():
        raise UnknownModel(f"model probes {name!r}: not a package name under probes/models")
    try:
        data = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        raise UnknownModel(f"model probes {name!r}: no package probes/models/{name} ({exc})") from None
    side = None
    if resolve:
        try:
            side = importlib.import_module(f"{__name__}.{name}.resolve")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}.resolve":
                raise
        else:
            check_resolve_module(name, side)
    own = ModelProbes(name=name, targets=tuple(getattr(data, "TARGETS", ())),
                      kernels=tuple(getattr(data, "KERNELS", ())), scopes=tuple(getattr(data, "SCOPES", ())),
                      kernel_names=tuple(getattr(data, "KERNEL_NAMES", ())),
                      stand_ins=tuple(getattr(data, "STAND_INS", ())),
                      meta_device_args=tuple(getattr(data, "META_DEVICE_ARGS", ())),
                      device_experts=dict(getattr(data, "DEVICE_EXPERTS", {})),
                      experts_modules=tuple(getattr(data, "EXPERTS_MODULES", ())),
                      symm_buffer_caches=tuple(getattr(data, "SYMM_BUFFER_CACHES", ())),
                      fingerprint_packages=tuple(getattr(data, "FINGERPRINT_PACKAGES", ())),
                      fingerprint_modules=tuple(getattr(data, "FINGERPRINT_MODULES", ())), resolve=side)
    return _with_schemes(own, parts)


def _with_schemes(own: ModelProbes, parts) -> ModelProbes:
    """*own* with the schemes' additions (theirs first; a model target of a scheme target's id replaces it)."""
    if not parts:
        return own
    from probes.core.targets import with_model

    targets: tuple = ()
    for part in parts:
        targets = with_model(targets, part.targets)
    return dataclasses.replace(
        own, schemes=tuple(p.name for p in parts), targets=with_model(targets, own.targets),
        kernels=tuple(k for p in parts for k in p.kernels) + own.kernels,
        kernel_names=tuple(k for p in parts for k in p.kernel_names) + own.kernel_names,
        device_experts={**{k: v for p in parts for k, v in p.device_experts.items()}, **own.device_experts},
        experts_modules=tuple(dict.fromkeys(tuple(m for p in parts for m in p.experts_modules) + own.experts_modules)))


_CURRENT: list[ModelProbes] = [ModelProbes()]


def use(probes: ModelProbes) -> ModelProbes:
    """Make *probes* this process's model probes (a process audits one model)."""
    _CURRENT[0] = probes
    return probes


def current() -> ModelProbes:
    """This process's model probes (none until :func:`use`)."""
    return _CURRENT[0]
