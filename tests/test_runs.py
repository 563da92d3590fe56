"""Run directories: pruning keeps each pin's newest runs and never touches another pin's."""
import os
import time

from audit.models.kimi_k3 import KIMI_K3
from audit.pins.lock import Pin
from audit.runtimes.base import prune_runs


def test_prune_keeps_newest_and_ignores_pins_sharing_a_prefix(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    mine = [f"v0.33.0-20261129T1900{i:02d}Z-{100 + i}" for i in range(7)]
    other = [f"v0.33.0-image-20261129T1930{i:02d}Z-{200 + i}" for i in range(6)]
    for name in mine + other:
        (runs / name).mkdir()
        old = time.time() - 2 * 3600
        os.utime(runs / name, (old, old))
    os.utime(runs / mine[0], None)  # touched just now: maybe another audit's, kept whatever its name says
    prune_runs(Pin(name="v0.33.0", version="0.33.0"), keep=5, root=tmp_path, layouts=KIMI_K3.layouts)
    left = sorted(p.name for p in runs.iterdir())
    assert left == sorted([mine[0]] + mine[2:] + other)


def test_from_runs_takes_the_newest_run_of_every_cell_and_nothing_less(tmp_path):
    """`regenerate --from-runs` renders a pin from its newest run that covered every cell, finished them all
    and was not aborted: never from a subset audit, an INCOMPLETE run, an observe run or another pin's run."""
    import json

    from audit.runtimes.base import newest_full_run
    from audit.systems import SYSTEMS, cells_of

    from audit.models.kimi_k3 import LAYOUTS

    every = [[s.name, l.name] for s, l in cells_of(list(SYSTEMS.values()), list(LAYOUTS.values()))]

    def run(name, cells=every, missing=(), **info):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"pin": name.rsplit("-", 2)[0], "cells": cells, "missing": list(missing),
                                                "run": {"mode": "resolve", **info}}))
        return d

    pin = Pin(name="v0.33.0", version="0.33.0")
    assert newest_full_run(pin, root=tmp_path, layouts=KIMI_K3.layouts) is None
    full = run("v0.33.0-20261201T100000Z-1")
    run("v0.33.0-20261202T100000Z-2", cells=every[:3])                        # a subset audit
    run("v0.33.0-20261202T110000Z-3", missing=[["l40s", "tp8", {"reason": "killed"}]])
    run("v0.33.0-20261202T120000Z-4", aborted={"kind": "timeout"})
    run("v0.33.0-20261202T130000Z-5", mode="observe")
    run("v0.33.0-image-20261202T140000Z-6")                                 # another pin sharing the prefix
    assert newest_full_run(pin, root=tmp_path, layouts=KIMI_K3.layouts) == full
    newer = run("v0.33.0-20261202T150000Z-7")
    assert newest_full_run(pin, root=tmp_path, layouts=KIMI_K3.layouts) == newer


def test_prune_never_removes_the_newest_run_of_every_cell(tmp_path):
    """Subset audits after a full one (the test suite's, a user's) do not take away what `make reports
    FROM_RUNS=1` renders from."""
    import json

    from audit.runtimes.base import newest_full_run
    from audit.systems import SYSTEMS, cells_of

    from audit.models.kimi_k3 import LAYOUTS

    every = [[s.name, l.name] for s, l in cells_of(list(SYSTEMS.values()), list(LAYOUTS.values()))]
    runs = tmp_path / "runs"
    names = [f"v0.33.0-20261129T1900{i:02d}Z-{100 + i}" for i in range(8)]
    old = time.time() - 2 * 3600
    for i, name in enumerate(names):
        (runs / name).mkdir(parents=True)
        cells = every if i == 1 else every[:2]
        (runs / name / "run.json").write_text(json.dumps({"pin": "v0.33.0", "cells": cells, "missing": [],
                                                           "run": {"mode": "resolve"}}))
        os.utime(runs / name, (old, old))
    pin = Pin(name="v0.33.0", version="0.33.0")
    prune_runs(pin, keep=3, root=tmp_path, layouts=KIMI_K3.layouts)
    assert sorted(p.name for p in runs.iterdir()) == sorted([names[1]] + names[-3:])
    assert newest_full_run(pin, root=tmp_path, layouts=KIMI_K3.layouts) == runs / names[1]
