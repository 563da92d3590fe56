"""The models the harness audits: one profile each (``audit/models/<model>.py``), registered here.

This registry is the only place that lists models. The CLI's ``--model`` (``MODEL=``) picks one by name
(:data:`DEFAULT` when it is not given) and hands the profile down: routing, verdicts, labels, diffs and rendering
take it as an argument and check that the documents they read are that model's. A stored document is read as
the model it names (:func:`named_in`), never as a default one. The default model's reports and runs keep their historical places (``reports/<pin>/``); every other
model's live under ``reports/<model>/<pin>/`` and are named ``<model>--<pin>-...`` among the runs.
"""
from __future__ import annotations

from pathlib import Path

from audit import engines
from audit.errors import SelectionError
from audit.models.deepseek_v3 import DEEPSEEK_V3
from audit.models.gpt_oss import GPT_OSS_120B
from audit.models.kimi_k3 import KIMI_K3
from audit.models.sglang import PROFILES as SGLANG_PROFILES
from audit.profiles import Profile

#: the first engine's profiles (every document that names no engine is of one of these)
PROFILES: dict[str, Profile] = {p.name: p for p in (KIMI_K3, GPT_OSS_120B, DEEPSEEK_V3)}
#: engine -> its profiles by model name (a model is audited on an engine only where a profile declares it)
BY_ENGINE: dict[str, dict[str, Profile]] = {engines.DEFAULT: PROFILES, **SGLANG_PROFILES}
DEFAULT = KIMI_K3.name


def get(name: str, engine: str = engines.DEFAULT) -> Profile:
    """The profile of model *name* on *engine*; an unknown or missing name is bad input naming the known ones. There
    is no fallback: a caller that has no model name asks the user (the CLI's ``--model`` defaults to :data:`DEFAULT`)."""
    known = BY_ENGINE.get(engine)
    if known is None:
        raise SelectionError("engine", str(engine), known=list(BY_ENGINE))
    if not name or name not in known:
        raise SelectionError("model" if engine == engines.DEFAULT else f"model on {engines.get(engine).title}",
                             str(name or ""), known=list(known))
    return known[name]


def for_pin(name: str, pin) -> Profile:
    """The profile of model *name* on the engine *pin* is a release of."""
    return get(name, pin.engine)


def named_in(doc: dict, *, what: str, path: str | None = None, key: str = "model") -> Profile:
    """The profile a stored document names (a routing's or a diff's ``model``, a run's ``profile``). A document
    that names none, or a model this harness does not have, is refused: it is never read as the default model's."""
    from audit.errors import EvidenceError

    name = doc.get(key) if isinstance(doc, dict) else None
    engine = engines.of_doc(doc)
    profiles = BY_ENGINE.get(engine.name, {})
    if not name:
        raise EvidenceError(f"{what} names no model (no {key!r} key)", path=path,
                            hint="it was not written by this harness's audit; audit the pin again "
                                 "(serving-truth audit PIN --model MODEL)")
    if name not in profiles:
        raise EvidenceError(f"{what} is of the model {name!r}, which this harness does not have on {engine.title}",
                            path=path, hint="known models: " + ", ".join(profiles))
    return profiles[name]


def reports_root(reports_dir: str | Path, profile: Profile) -> Path:
    """Where *profile*'s reports live: ``reports/`` itself for the default model, ``reports/<model>/`` else; under
    the engine's own folder (``reports/<engine>/``) for every engine but the first."""
    base = Path(reports_dir) / engines.get(profile.engine).reports_folder
    return base if profile.name == DEFAULT else base / profile.name


def run_prefix(profile: Profile, pin_name: str) -> str:
    """The prefix of *profile*'s run directories for a pin (the default model's keep the bare pin name)."""
    return pin_name if profile.name == DEFAULT else f"{profile.name}--{pin_name}"
