"""What the probes wrap, as data.

Each target names a role (``id``) and the places vLLM implements it, as ``module:qualname`` specs
tried in order; a spec may carry a version range (``"0.30<=v"``, ``"v<0.30"``) that is checked
against the installed vLLM. The first spec that resolves is patched. When none resolves in a
module that was imported, the target is reported as *probe drift* (the ledger says so); a target
whose module vLLM never imported is *not reached*.

Kinds:

``scope``      push the call's ``prefix`` argument (a model-layer name) while the call runs, so
               selections made inside are attributed to that layer.
``select``     record the chosen arguments and the result of a selector.
``candidates`` the call returns experts classes to try (``backend_to_kernel_cls``): wrap their
               ``is_supported_config`` where defined, and note the backend being tried.
``check``      (installed by ``candidates``) record ``(supported, reason)`` per class tried.
``construct``  record that an object of a class was constructed inside the current scope, with
               named arguments (e.g. an experts class that is a module of its own).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    id: str
    kind: str
    specs: tuple[str, ...]
    #: argument names (from inspect.signature binding) to record
    args: tuple[str, ...] = ()
    #: the layer phase this selection governs, when it governs one
    phase: str = ""
    #: what the ledger calls it
    title: str = ""
    #: False for targets that only exist in some releases and whose absence is expected
    required: bool = True
    #: scope targets: also record what the object chose at construction (enums, classes, flags)
    construct: bool = False


VLLM = "vllm."
MOE = VLLM + "model_executor.layers.fused_moe."

#: the targets every model gets: vLLM's shared routed-experts layer and its attention backend selection. What a
#: quantization scheme brings (its quant method, its backend oracle and candidates) comes from the scheme's module
#: (probes/schemes), a model's own (its layer scopes, its selectors) from its probes package (probes/models); one
#: with the id of a shared target takes that target's place (to add the places older releases implemented it).
TARGETS: tuple[Target, ...] = (
    # --- scopes: which layer is being built (and what it chose) ------------------------------
    Target("scope.routed_experts", "scope", (MOE + "routed_experts:RoutedExperts.__init__",),
           args=("layer_name",), construct=True, title="routed experts", required=False),
    # --- attention -------------------------------------------------------------------------------
    Target("mla.attn_backend", "select", (VLLM + "platforms.cuda:CudaPlatformBase.get_attn_backend_cls",),
           args=("selected_backend",), phase="decode", title="attention backend"),
    Target("mla.attn_candidates", "select", (VLLM + "platforms.cuda:CudaPlatformBase.get_valid_backends",),
           phase="decode", title="attention backend candidates", required=False),
    Target("mla.prefill", "select", (VLLM + "v1.attention.backends.mla.prefill.selector:get_mla_prefill_backend",),
           phase="prefill", title="MLA prefill backend"),
)


def with_model(targets: tuple[Target, ...], model: tuple[Target, ...]) -> tuple[Target, ...]:
    """*targets* with a model's own: one with a shared target's id takes its place, the others follow."""
    own = {t.id: t for t in model}
    return tuple(own.pop(t.id, t) for t in targets) + tuple(own.values())


@dataclass(frozen=True)
class Kernel:
    """Observe mode: one kernel entry of a lane, counted each time it runs."""
    lane: str
    path: str
    spec: str
    #: attribute of the bound object naming its layer (for entries that know it), else the scope's
    layer_attr: str = ""
    #: the value resolve mode reports for this choice (a backend string, an attention backend class),
    #: so observed paths get the same perf-database labels
    backend: str = ""


@dataclass(frozen=True)
class Scope:
    """Observe mode: a per-layer function that calls kernel entries; it sets the current layer while it runs."""
    spec: str
    layer_attr: str
    #: "metadata": derive the step's phase from attn_metadata[self.prefix] (its request counts)
    phase_from: str = ""
    #: the function is decorated with vLLM's eager_break_during_capture: wrap inside the decorator
    eager_break: bool = False


def parse_version(text: str) -> tuple[int, ...] | None:
    pieces = text.split("+")[0].split(".")
    if not all(p.isdigit() for p in pieces):
        return None  # dev/rc builds: no range applies, every spec is tried
    parts = tuple(int(p) for p in pieces)
    return parts if len(parts) >= 2 else None


def spec_applies(spec_range: str, version: str) -> bool:
    """``"0.30<=v"``, ``"v<0.30"``, ``"0.27<=v<0.30"`` against an installed version; unknown -> True."""
    v = parse_version(version)
    if not spec_range or v is None:
        return True
    lo, _, rest = spec_range.partition("v")
    if lo.endswith("<="):
        lo_v = parse_version(lo[:-2])
        if lo_v and v < lo_v:
            return False
    if rest.startswith("<"):
        hi_v = parse_version(rest[1:])
        if hi_v and v >= hi_v:
            return False
    return True


def split_spec(spec: str) -> tuple[str, str, str]:
    """``"pkg.mod:Qual.name@0.30<=v"`` -> (module, qualname, version range)."""
    spec, _, vrange = spec.partition("@")
    module, _, qualname = spec.partition(":")
    return module, qualname, vrange
