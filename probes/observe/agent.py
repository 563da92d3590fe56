"""Observe-mode agent: serve one cell's model slice with ``vllm serve`` on real GPUs.

    python -m probes.observe.agent PLAN.json CELL_INDEX

Runs inside the pinned environment or image, with the probes' plugin visible to vLLM
(``VLLM_PLUGINS=serving_truth``, the staged dist-info on ``PYTHONPATH``) and ``SERVING_TRUTH_OUT``
naming this cell's evidence directory, so every process vLLM starts (API server, engine core, each
worker) records its own counts. This process starts the server through :mod:`probes.observe.workload`, sends
the phases' requests and records what each did (its own evidence file has no counts).

Corroboration (unless the plan says ``"profile": false``): before serving, the kernel-name map is
looked up in this build (``kernel-map``); the server runs with vLLM's torch profiler writing into
``<evidence dir>/traces``; afterwards the traces' kernel launch counts are recorded
(``profiler-traces``) for the host to compare with the probes' counts.
"""
from __future__ import annotations

import os
import sys
import traceback

#: where vLLM's workers write their torch.profiler traces, inside the cell's evidence directory
TRACE_DIR = "traces"


def main(argv: list[str] | None = None) -> int:
    from probes.core.plan import read_plan

    argv = sys.argv[1:] if argv is None else argv
    plan = read_plan(argv, "python -m probes.observe.agent PLAN.json CELL_INDEX", nargs=2)
    if plan is None:
        return 2
    from probes.core.lifecycle import watch_parent

    watch_parent()
    cell = plan["cells"][int(argv[1])]
    os.environ["SERVING_TRUTH_MODE"] = "observe"
    os.environ["SERVING_TRUTH_CELL"] = f"{cell['system']['name']}--{cell['layout']['name']}"
    os.environ.setdefault("VLLM_PLUGINS", "serving_truth")
    from probes.observe import plugin

    os.environ.setdefault(plugin.ENV_MODEL, plan.get("model_probes", ""))
    os.environ.setdefault(plugin.ENV_SCHEMES, ",".join(plan.get("schemes", ())))
    from probes.observe import workload

    plugin.register()
    rec = plugin.recorder()
    out_dir = os.environ.get("SERVING_TRUTH_OUT", ".")
    profile = bool(plan.get("profile", True))
    trace_dir = os.path.join(os.path.abspath(out_dir), TRACE_DIR) if profile else None
    if profile:
        record_kernel_map(rec)
    args = workload.serve_argv(cell["model_dir"], cell["layout"]["serve_args"], trace_dir=trace_dir)
    rec.emit("job", system=cell["system"], layout=cell["layout"], argv=["vllm", "serve", *args],
             slice=plan.get("slice", ""))
    code = 0
    try:
        outcome = workload.run(args, on_phase=lambda name: rec.emit("phase-start", phase=name),
                               log_path=os.path.join(out_dir, "vllm-serve.log"), profile=profile)
        rec.emit("workload", ok=True, phases=outcome)
    except Exception as exc:
        code = 1
        rec.emit("workload", ok=False, error={"type": f"{type(exc).__module__}:{type(exc).__qualname__}",
                                              "message": str(exc)[:4000],
                                              "traceback": traceback.format_exc()[-4000:]})
    finally:
        if trace_dir:
            record_traces(rec, trace_dir)
        session = plugin.observe_session()
        if session is not None:
            session.flush()
        rec.flush(final=True)
    return code


def record_kernel_map(rec) -> None:
    """The kernel-name map this run reads traces with, and what of it this build contains."""
    from probes import models as models_probes
    from probes.observe.kernel_names import check_build
    from probes.observe.session import entries

    lane_of = {k.path: k.lane for k in entries(models_probes.current())[0]}
    try:
        found = check_build()
    except Exception as exc:  # corroboration is optional: never fatal
        rec.emit("kernel-map", entries=[], error=f"{type(exc).__name__}: {exc}")
        return
    rec.emit("kernel-map", entries=[{**e, "lane": lane_of.get(e["path"], "?")} for e in found])


def record_traces(rec, trace_dir: str) -> None:
    """Kernel launch counts of every trace vLLM's workers wrote (none if the profiler did not run)."""
    from probes.observe.traces import summarize

    try:
        rec.emit("profiler-traces", dir=TRACE_DIR, traces=summarize(trace_dir))
    except Exception as exc:
        rec.emit("profiler-traces", dir=TRACE_DIR, traces=[], error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
