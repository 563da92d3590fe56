"""Observe-mode agent: serve one cell's model slice with ``vllm serve`` on real GPUs.

    python -m probes.observe_agent PLAN.json CELL_INDEX

Runs inside the pinned environment or image, with the probes' plugin visible to vLLM
(``VLLM_PLUGINS=serving_truth``, the staged dist-info on ``PYTHONPATH``) and ``SERVING_TRUTH_OUT``
naming this cell's evidence directory, so every process vLLM starts (API server, engine core, each
worker) records its own counts. This process starts the server through :mod:`probes.workload`, sends
the phases' requests and records what each did (its own evidence file has no counts).
"""
from __future__ import annotations

import os
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    from .agent import read_plan

    argv = sys.argv[1:] if argv is None else argv
    plan = read_plan(argv, "python -m probes.observe_agent PLAN.json CELL_INDEX", nargs=2)
    if plan is None:
        return 2
    cell = plan["cells"][int(argv[1])]
    os.environ["SERVING_TRUTH_MODE"] = "observe"
    os.environ["SERVING_TRUTH_CELL"] = f"{cell['system']['name']}--{cell['layout']['name']}"
    os.environ.setdefault("VLLM_PLUGINS", "serving_truth")
    from . import plugin, workload

    plugin.register()
    rec = plugin.recorder()
    args = workload.serve_argv(cell["model_dir"], cell["layout"]["serve_args"])
    rec.emit("job", system=cell["system"], layout=cell["layout"], argv=["vllm", "serve", *args],
             slice=plan.get("slice", ""))
    code = 0
    try:
        outcome = workload.run(args, on_phase=lambda name: rec.emit("phase-start", phase=name),
                               log_path=os.path.join(os.environ.get("SERVING_TRUTH_OUT", "."), "vllm-serve.log"))
        rec.emit("workload", ok=True, phases=outcome)
    except Exception as exc:
        code = 1
        rec.emit("workload", ok=False, error={"type": f"{type(exc).__module__}:{type(exc).__qualname__}",
                                              "message": str(exc)[:4000],
                                              "traceback": traceback.format_exc()[-4000:]})
    finally:
        session = plugin.observe_session()
        if session is not None:
            session.flush()
        rec.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
