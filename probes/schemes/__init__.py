"""Quantization schemes: what is specific to how a model's experts are quantized, one module per scheme
(``probes/schemes/<name>.py``), selected by a model's profile (``Profile.schemes``) and sent in the plan.

The shared probes and the host's shared vocabulary name no scheme; each scheme module holds, as data (standard
library only, read by both modes and by the host):

``TARGETS``           what resolve and observe wrap for the scheme: vLLM's quant method class for its experts, the
                      backend oracle it calls, the candidates that oracle tries (:class:`probes.core.targets.Target`);
``KERNELS``           observe mode's experts entries of the scheme's backends;
``KERNEL_NAMES``      the GPU kernels those entries launch (:class:`probes.observe.kernel_names.KernelName`);
``DEVICE_EXPERTS``    experts classes whose per-call variant the device picks (class name -> why);
``EXPERTS_MODULES``   experts classes that are modules of their own (no MoE runner around them);
``FAMILIES``          the scheme's backend enum member prefix -> backend family (first match wins);
``PRECISION_LANES``   the perf database's lanes for the scheme's experts, named by precision -> what each means;
``PRECISION_RULES``   (regular expression on ``<evidence source>:<backend member>``, precision lane), first match;
``EXPERTS_LABELS``    evidence source -> (label prefix, family, how): experts that are recorded by class rather than
                      through the oracle (the label is the prefix and the class name);
``EXPERTS_SOURCES``   such an experts class -> its evidence source (what an observed kernel entry of it is labelled as).
"""
from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass, field

#: a ``DEVICE_EXPERTS`` reason the shared dispatch stage reads as "autotuned" (it adds the autotuner's token bucket):
#: FlashInfer's TRT-LLM-Gen experts, whatever the scheme
TRTLLM_AUTOTUNED = "FlashInfer's AutoTuner picks the TRTLLM-Gen tactic"


@dataclass(frozen=True)
class Scheme:
    name: str
    title: str = ""
    targets: tuple = ()
    kernels: tuple = ()
    kernel_names: tuple = ()
    device_experts: dict = field(default_factory=dict)
    experts_modules: tuple = ()
    families: tuple = ()
    precision_lanes: dict = field(default_factory=dict)
    precision_rules: tuple = ()
    experts_labels: dict = field(default_factory=dict)
    experts_sources: dict = field(default_factory=dict)

    def family(self, backend: str) -> str | None:
        """The backend family of a member of this scheme's backend enum (None: not the scheme's)."""
        return next((fam for prefix, fam in self.families if backend.startswith(prefix)), None)

    def precision_lane(self, source: str, backend: str) -> str | None:
        """The precision lane of the experts a lane group's evidence names (None: the scheme has no rule for it)."""
        key = f"{source}:{backend}"
        return next((lane for pattern, lane in self.precision_rules if re.search(pattern, key)), None)


class UnknownScheme(ValueError):
    pass


#: what a scheme module may define (anything else public in upper case is refused: a typo never silently does nothing)
FIELDS = {"TITLE": "title", "TARGETS": "targets", "KERNELS": "kernels", "KERNEL_NAMES": "kernel_names",
          "DEVICE_EXPERTS": "device_experts", "EXPERTS_MODULES": "experts_modules", "FAMILIES": "families",
          "PRECISION_LANES": "precision_lanes", "PRECISION_RULES": "precision_rules",
          "EXPERTS_LABELS": "experts_labels", "EXPERTS_SOURCES": "experts_sources"}


@functools.lru_cache(maxsize=None)
def load(name: str) -> Scheme:
    """The scheme module *name* as a :class:`Scheme`; an unknown name or an undeclared field is an error. Loaded once
    per process (profiles ask for their schemes on every lane group they label)."""
    if not name.isidentifier():
        raise UnknownScheme(f"quantization scheme {name!r}: not a module name under probes/schemes")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise UnknownScheme(f"quantization scheme {name!r}: no module probes/schemes/{name}.py") from None
    unknown = sorted(a for a in vars(module) if a.isupper() and not a.startswith("_") and a not in FIELDS
                     and not isinstance(getattr(module, a), str))
    if unknown:
        raise UnknownScheme(f"quantization scheme {name!r}: {', '.join(unknown)} is no scheme field "
                            f"(fields: {', '.join(sorted(FIELDS))}); rename it or make it private")
    values = {attr: getattr(module, key) for key, attr in FIELDS.items() if hasattr(module, key)}
    return Scheme(name=name, **values)


def load_all(names) -> tuple[Scheme, ...]:
    return tuple(load(n) for n in names)
