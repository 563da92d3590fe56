"""The models the harness audits: one profile each (``audit/models/<model>.py``), registered here.

This registry is the only place that lists models. The CLI's ``--model`` (``MODEL=``) picks one by name;
shared code (routing, verdicts, labels, rendering) finds a report's profile from the ``model`` its evidence
names. The default model's reports and runs keep their historical places (``reports/<pin>/``); every other
model's live under ``reports/<model>/<pin>/`` and are named ``<model>--<pin>-...`` among the runs.
"""
from __future__ import annotations

from pathlib import Path

from audit.errors import SelectionError
from audit.models.deepseek_v3 import DEEPSEEK_V3
from audit.models.gpt_oss import GPT_OSS_120B
from audit.models.kimi_k3 import KIMI_K3
from audit.profiles import Profile

PROFILES: dict[str, Profile] = {p.name: p for p in (KIMI_K3, GPT_OSS_120B, DEEPSEEK_V3)}
DEFAULT = KIMI_K3.name


def get(name: str | None) -> Profile:
    """The profile named *name* (None: the default model); an unknown name is bad input naming the known ones."""
    if name in (None, ""):
        return PROFILES[DEFAULT]
    if name not in PROFILES:
        raise SelectionError("model", str(name), known=list(PROFILES))
    return PROFILES[name]


def reports_root(reports_dir: str | Path, profile: Profile) -> Path:
    """Where *profile*'s reports live: ``reports/`` itself for the default model, ``reports/<model>/`` else."""
    return Path(reports_dir) if profile.name == DEFAULT else Path(reports_dir) / profile.name


def run_prefix(profile: Profile, pin_name: str) -> str:
    """The prefix of *profile*'s run directories for a pin (the default model's keep the bare pin name)."""
    return pin_name if profile.name == DEFAULT else f"{profile.name}--{pin_name}"
