"""The plan a host writes for an agent (``plan.json``), read and checked the same way by both agents."""
from __future__ import annotations

import json
import os
import sys

PLAN_SCHEMA = 1


def read_plan(argv: list[str], usage: str, *, nargs: int) -> dict | None:
    """The plan named by ``argv[0]`` (the harness's plan.json), or None after saying what is wrong."""
    if len(argv) != nargs:
        print(f"usage: {usage}", file=sys.stderr)
        return None
    with open(argv[0], encoding="utf-8") as fh:
        plan = json.load(fh)
    if plan.get("schema") != PLAN_SCHEMA:
        print(f"plan schema {plan.get('schema')!r}, this agent reads {PLAN_SCHEMA}", file=sys.stderr)
        return None
    return plan


def fit_main(argv: list[str], usage: str, check, *, before=None) -> int:
    """A stand-in fit check's entry (``python -m <engine's fitcheck> PLAN.json OUT.json``): read the plan, end with
    the harness, run ``before`` (the engine's process settings) and ``check(plan)``, and write what it returns to
    OUT.json atomically."""
    from probes.core.lifecycle import watch_parent

    if len(argv) != 2:
        print(f"usage: {usage}", file=sys.stderr)
        return 2
    plan = read_plan(argv[:1], usage, nargs=1)
    if plan is None:
        return 2
    watch_parent()
    if before is not None:
        before()
    out = check(plan)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(out, fh, sort_keys=True)
    os.replace(tmp, argv[1])
    return 0


def close_cell(rec) -> str | None:
    """A cell's last records, written by both engines' agents: the fence's account (every fenced piece and how often
    it ran) and every harness fault of the cell's process and of the processes it was forked from (the host ends a
    cell with a fault INCOMPLETE); then the evidence file, whose path the cell's log names."""
    from probes.core import fence

    rec.emit("fence", **fence.summary())
    for fault in fence.FAULTS:
        rec.emit("harness_fault", **fault)
    path = rec.flush(final=True)
    print(f"evidence: {path}", flush=True)
    return path


def start_agent(argv: list[str], usage: str) -> dict | None:
    """A resolve agent's first steps, both engines': its plan (None after saying what is wrong), a watch that ends it
    with the harness, and the fence's planted faults (a test of the fence) set before any piece is installed."""
    from probes.core import fence
    from probes.core.lifecycle import watch_parent

    plan = read_plan(argv, usage, nargs=1)
    if plan is None:
        return None
    watch_parent()
    fence.plant(plan.get("plant_fault") or "", survey=bool(plan.get("plant_survey")))
    return plan
