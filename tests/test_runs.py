"""Run directories: pruning keeps each pin's newest runs and never touches another pin's."""
import os
import time

from audit.lock import Pin
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
    prune_runs(Pin(name="v0.33.0", vllm_version="0.33.0"), keep=5, root=tmp_path)
    left = sorted(p.name for p in runs.iterdir())
    assert left == sorted([mine[0]] + mine[2:] + other)
