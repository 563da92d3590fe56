"""Serving engines as declared contracts: what the shared host code needs to know of an engine, in one record.

An engine names its package, how its releases are pinned (the keys of images.lock that carry its version and
commit), the Python its environments run, where its reports live, the probe modules that run inside its process,
the models it is audited for (one profile each, in the engine's own flags and vocabulary), the packages whose
shared objects carry its device code, and the perf database's name for it. The shared code (``audit/``) asks
the contract and never names an engine; this registry and each engine's own module are the only places that do.

vLLM is the first engine: every pin without an ``engine`` key is vLLM's, and its reports keep their places
(``reports/<pin>/``, ``reports/<model>/<pin>/``); another engine's live under ``reports/<engine>/``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from audit.errors import SelectionError


@dataclass(frozen=True)
class Engine:
    #: images.lock's ``engine`` value and the CLI's spelling
    name: str
    #: how the ledger names it
    title: str
    #: its distribution on PyPI (the pinned wheel's name)
    package: str
    #: images.lock's keys for the release version and the build's commit; the same keys in a routing's ``pin``
    version_key: str
    commit_key: str
    #: the Python its official images run (a pin may say otherwise)
    python: str
    #: the folder under reports/ of its reports ("" for the first engine: reports/ itself)
    reports_folder: str
    #: the probe modules run inside its environment (``python -m``): resolve mode's agent, and the stand-in fit
    resolve_agent: str
    fit_agent: str
    #: the module that runs beside its serving process in observe mode ("" where observe mode is not built)
    observe_agent: str
    #: the packages (import names) whose shared objects carry the engine's device code, scanned for the ledger
    device_code_packages: tuple[str, ...]
    #: the perf database's name for it (its ``framework`` column)
    framework: str
    #: how the ledger writes the command a layout's arguments follow: before the arguments (no model named), and
    #: with the model (``<model>``) named
    serve: str = ""
    serve_model: str = ""
    #: the serving command's name (``vllm serve``), as prose names a configuration of it
    command: str = ""
    #: what the ledger says the engine reads of the declared host facts (``audit/pins/hosts.py``)
    host_reads: str = ""
    #: its release pins declare their official image's host facts (images.lock ``[pin.host]``), read from the
    #: release's image recipe; False where no recipe ships to read them from (verify-pins does not ask for them)
    declares_host: bool = True
    #: how far its resolve agent runs the engine's code (the evidence levels its rows can have)
    levels: tuple[str, ...] = ("construction", "post-load", "dispatch")
    #: what each construction stage of its resolve agent ran (the ledger's stage table); empty: the shared wording
    #: (``audit.report.routing.STAGE_MEANING``, the first engine's)
    stage_meaning: dict = field(default_factory=dict, compare=False, hash=False)
    #: the import check run in a freshly built environment: prints JSON with the engine's version as ``engine``
    env_probe: str = ""
    #: the inventory keys whose value is the engine's own version and commit (the agent reads them in-process)
    inventory_keys: tuple[str, str] = ("", "")
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def version_of(self, pin_doc: dict) -> str:
        """The release version a routing's or diff's ``pin`` record states (its key is the engine's)."""
        return str(pin_doc.get(self.version_key) or "")

    def commit_of(self, pin_doc: dict) -> str:
        return str(pin_doc.get(self.commit_key) or "")


def _probe(package: str) -> str:
    return ("import json, platform, torch, importlib.metadata as m; print(json.dumps({'torch': torch.__version__, "
            f"'cuda': torch.version.cuda, 'engine': m.version({package!r}), 'python': platform.python_version()}}))")


VLLM = Engine(
    name="vllm", title="vLLM", package="vllm", version_key="vllm_version", commit_key="vllm_commit", python="3.12",
    reports_folder="", resolve_agent="probes.resolve.agent", fit_agent="probes.resolve.fitcheck",
    observe_agent="probes.observe.agent", device_code_packages=("vllm",), framework="vllm",
    serve="vllm serve", serve_model="vllm serve <model>", command="vllm serve",
    host_reads="vLLM's own availability checks read these (FlashInfer's, DeepGEMM's, TRT-LLM attention's)",
    env_probe=_probe("vllm"), inventory_keys=("vllm", "vllm_commit"),
)

SGLANG = Engine(
    name="sglang", title="SGLang", package="sglang", version_key="sglang_version", commit_key="sglang_commit",
    python="3.11", reports_folder="sglang", resolve_agent="probes.engines.sglang.agent",
    fit_agent="probes.engines.sglang.fitcheck",
    observe_agent="", device_code_packages=("sgl_kernel",), framework="sglang",
    serve="sglang serve --model-path <model>", serve_model="sglang serve --model-path <model>", command="sglang serve",
    host_reads=("which of these SGLang's own checks read is not declared yet; they are stated as the environment held "
                "them"),
    levels=("construction",), declares_host=False,
    stage_meaning={
        "imports": "SGLang's server arguments and runtime context imported under the simulated platform",
        "config": "ServerArgs parsed from the `sglang serve` arguments and resolved by SGLang's own pipeline "
                  "(publish, resolve_once)",
        "distributed": "SGLang's parallel runtime initialised (fake process group, rank 0)",
        "construct": "model constructed on the meta device by SGLang's model loader (every layer's __init__ ran)",
        "construct-draft": "speculative draft model (DSpark, EAGLE3) constructed the same way, its model config as "
                           "SGLang's draft worker builds it (layouts with a draft only)",
        "inspect": "constructed modules inspected; a draft's attention backend read from SGLang's draft runner "
                   "resolution",
    },
    env_probe=_probe("sglang"), inventory_keys=("sglang", "sglang_commit"),
)

ENGINES: dict[str, Engine] = {e.name: e for e in (VLLM, SGLANG)}
#: the engine of a pin, routing or diff that names none (everything written before engines were declared)
DEFAULT = VLLM.name


def get(name: str | None) -> Engine:
    """The engine named *name* (None or "" is the default engine); an unknown name is bad input naming the known."""
    if not name:
        return ENGINES[DEFAULT]
    if name not in ENGINES:
        raise SelectionError("engine", str(name), known=list(ENGINES))
    return ENGINES[name]


def of_doc(doc: dict) -> Engine:
    """The engine a stored document (a routing, a diff side, a run's pin record) is of: its ``engine`` key, the
    default engine where it has none (documents of the first engine never carried one)."""
    name = doc.get("engine") if isinstance(doc, dict) else None
    return get(name)


def version_keys() -> set[str]:
    """Every engine's images.lock keys (the lock parser accepts each engine's own, and only on its pins)."""
    return {k for e in ENGINES.values() for k in (e.version_key, e.commit_key)}
