"""Cost of observe mode's counting wrapper per kernel-entry call, measured in one run.

    python benchmarks/bench_counting.py [--calls N]

Times a trivial function called bare and through Counters.counting_wrapper (current-scope layer,
and per-call layer attribution), prints ns per call, the added cost, and what that adds to one
Kimi-K3 decode step (92 MoE + 70 KDA + 23 MLA layer calls per step) on this machine's CPU.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probes.observe.counting import Counters  # noqa: E402

CALLS_PER_STEP = 92 + 70 + 23


def kernel(x, y=None):
    return x


def per_call_ns(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1_000_000)
    n = ap.parse_args().calls
    c = Counters()
    c.set_layer(7)
    c.set_phase("decode")
    scoped = c.counting_wrapper(kernel, "scoped")
    attributed = c.counting_wrapper(kernel, "attributed", layer_of=lambda args: 7)
    bare = per_call_ns(kernel, n)
    loop = per_call_ns(lambda i: None, n)
    s = per_call_ns(scoped, n)
    a = per_call_ns(attributed, n)
    print(f"calls per measurement: {n}, best of 5, Python {sys.version.split()[0]}")
    print(f"bare call:                      {bare:7.1f} ns (loop alone {loop:.1f} ns)")
    print(f"counting wrapper (scope layer): {s:7.1f} ns  -> +{s - bare:.1f} ns per call, ratio {s / bare:.2f}")
    print(f"counting wrapper (per-call layer): {a:4.1f} ns  -> +{a - bare:.1f} ns per call, ratio {a / bare:.2f}")
    step_us = (max(s, a) - bare) * CALLS_PER_STEP / 1000
    print(f"added per K3 decode step ({CALLS_PER_STEP} kernel-entry calls): {step_us:.1f} us on this CPU; "
          f"under 1% of any step longer than {step_us * 100 / 1000:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
