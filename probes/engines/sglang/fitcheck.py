"""Every SGLang stand-in's and reader's fit to the installed release, before any cell runs::

    python -m probes.engines.sglang.fitcheck PLAN.json OUT.json

Under the plan's first cell's SKU, each target of ``platform.FIT_TARGETS`` is imported and checked; OUT.json gets
``{"fit": {piece: fit}, "unimported": {module: why}}``. Which misfits stop the audit is the host's decision
(audit/standinfit.py).
"""
from __future__ import annotations

import sys

from probes.core.plan import fit_main

USAGE = "python -m probes.engines.sglang.fitcheck PLAN.json OUT.json"


def check(plan: dict) -> dict:
    from probes.core import fence
    from probes.engines.sglang import platform
    from probes.resolve import simulate

    platform.prepare_environment()
    simulate.load_stub_libcuda(plan["stub_libcuda"])
    platform.install()
    first = plan["cells"][0]
    simulate.set_simulated(first["system"], first["layout"]["world_size"])
    unimported: dict[str, str] = {}
    for piece, (module, _attrs) in sorted(platform.FIT_TARGETS.items()):
        try:
            platform.check_fit(piece)
        except ImportError as exc:  # the module itself is gone from the release: a misfit, named
            fence.FIT[piece] = f"does not fit: {module} does not import ({type(exc).__name__}: {str(exc)[:160]})"
            unimported[module] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {"fit": dict(sorted(fence.FIT.items())), "unimported": dict(sorted(unimported.items()))}


def main(argv: list[str] | None = None) -> int:
    return fit_main(sys.argv[1:] if argv is None else argv, USAGE, check)


if __name__ == "__main__":
    sys.exit(main())
