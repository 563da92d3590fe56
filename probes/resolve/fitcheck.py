"""Every stand-in's fit to the installed release, before any cell runs::

    python -m probes.resolve.fitcheck PLAN.json OUT.json

The probes, stand-ins and simulated platform are installed exactly as an SM process installs them (under the
plan's first cell's SKU); then every module a post-import hook waits for is imported, so each stand-in meets the
release it will run against and says whether it fits (``probes.core.fence.FIT``). Nothing is constructed and no
cell runs. OUT.json gets ``{"fit": {stand-in: fit}, "unimported": {module: why}}``: which misfits stop the audit
is the host's decision (audit/standinfit.py), not this process's. A module that does not import here (an
optional package the environment lacks) is named, not judged: its stand-ins are checked again in the cells that
import it.
"""
from __future__ import annotations

import importlib
import os
import sys

from probes.core.plan import fit_main

USAGE = "python -m probes.resolve.fitcheck PLAN.json OUT.json"

#: rounds of imports: importing a watched module can register hooks on further modules
_ROUNDS = 4


def _pending() -> list[str]:
    from probes.core.patching import PostImportHooks

    names: set[str] = set()
    for finder in sys.meta_path:
        if isinstance(finder, PostImportHooks):
            names.update(finder.pending())
    return sorted(names)


def check(plan: dict) -> dict:
    """Install as an SM process does, import every watched module, return the fence's account of the fits."""
    from probes.core import fence
    from probes.core.recorder import Recorder
    from probes.core.stages import Stage
    from probes.resolve import cell as resolve
    from probes.resolve import simulate

    simulate.load_stub_libcuda(plan["stub_libcuda"])
    first = plan["cells"][0]
    simulate.set_simulated(first["system"], first["layout"]["world_size"])
    rec = Recorder(None, role="resolve-agent", meta={"mode": "resolve", "pin": plan.get("pin", ""),
                                                     "model": plan.get("model") or None,
                                                     "wheel_sha256": plan.get("wheel_sha256", "")})
    unimported: dict[str, str] = {}
    with Stage(rec, "platform"):
        resolve._install_platform(plan, rec)
    for _ in range(_ROUNDS):
        todo = [m for m in _pending() if m not in unimported and m not in sys.modules]
        if not todo:
            break
        for name in todo:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - named, never judged here
                if isinstance(exc, KeyboardInterrupt):
                    raise
                unimported[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {"fit": dict(sorted(fence.FIT.items())), "unimported": dict(sorted(unimported.items()))}


def main(argv: list[str] | None = None) -> int:
    # as the agent: humming's background JIT pre-builds only cost time here (no kernel is launched)
    return fit_main(sys.argv[1:] if argv is None else argv, USAGE, check,
                    before=lambda: os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1"))


if __name__ == "__main__":
    sys.exit(main())
