"""The plan a host writes for an agent (``plan.json``), read and checked the same way by both agents."""
from __future__ import annotations

import json
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
