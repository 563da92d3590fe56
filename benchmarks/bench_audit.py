"""Benchmark: the cost of a full resolve-mode audit against its floor, measured in one run.

    python benchmarks/bench_audit.py [--pin v0.33.0] [--smoke]

``--smoke`` measures the floor and one audit of one cell only (b200_sxm/tp8), a check that the benchmark still runs
(``make test`` runs it); the ratios it prints are of that cell, not of a full audit.

Floor: one process of the pinned environment that loads the stub driver, installs the simulated
platform, imports vLLM and builds one Kimi-K3 VllmConfig from `vllm serve` arguments (b200_sxm,
TP8) -- the least any resolve audit must pay per process that imports vLLM. Audit: the full audit of
the pin (every system x layout pair), exactly what `make audit` runs, rendered into a scratch directory.
All of it reuses the cached environment (building it is a one-time cost and is not timed here).

Audits, in this order:
1. first audit on a machine: the evidence cache and the memo of pure computations below vLLM
   (probes/resolve/memo.py: Humming's kernel heuristics) both empty;
2. full audit: the evidence cache empty again, the memo as audit 1 left it (what every later audit of a
   pin whose evidence must be made again meets: a new pin, new probes);
3. repeated audit: unchanged inputs, every cell from the evidence cache.
From audit 2's stage records it projects the wall time at more cores (the agent's own grouping: one vLLM
import per SM process, a capability's cells split over processes when cores allow), and it reports the
peak resident memory of the whole process tree and of the largest single process, to size a CI runner.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from audit.pins import lock  # noqa: E402
from audit.core import AuditOptions, run_audit  # noqa: E402
from audit.models.kimi_k3 import KIMI_K3  # noqa: E402
from audit.runtimes import RunRequest  # noqa: E402
from audit.runtimes.local import LocalRuntime  # noqa: E402
from audit.systems import SYSTEMS, cells_of, select  # noqa: E402
from audit.models.kimi_k3 import LAYOUTS  # noqa: E402


class PeakRSS(threading.Thread):
    """Samples the summed resident memory of this process and all its descendants every 0.2 s."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak = 0
        self.peak_process = 0  # the largest resident set of any one process of the tree
        self._stop_event = threading.Event()

    def _tree_rss(self) -> int:
        parent, rss = {}, {}
        page = os.sysconf("SC_PAGE_SIZE")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                parent[int(pid)] = int(stat[1])
                rss[int(pid)] = int(stat[21]) * page
            except (OSError, IndexError, ValueError):
                continue
        mine, total = {os.getpid()}, 0
        changed = True
        while changed:
            changed = False
            for pid, ppid in parent.items():
                if ppid in mine and pid not in mine:
                    mine.add(pid)
                    changed = True
        self.peak_process = max([self.peak_process] + [rss.get(p, 0) for p in mine if p != os.getpid()])
        return sum(rss.get(p, 0) for p in mine)

    def run(self):
        while not self._stop_event.is_set():
            self.peak = max(self.peak, self._tree_rss())
            self._stop_event.wait(0.2)

    def stop(self):
        self._stop_event.set()
        self.join()


#: stages an SM process runs once before forking its cells (every cell's evidence inherits the record)
GROUP_STAGES = ("platform", "imports")


def _parent(f) -> dict | None:
    """The agent parent's record when it installed the platform and imported the shared modules itself (then
    the ``platform`` stage in every cell's evidence is the parent's, run once for all SM processes)."""
    records = f.of_kind("shared_parent")
    return records[0] if records else None


def stage_seconds(evidence_dir: Path) -> dict[str, float]:
    """Seconds each stage took, summed over a run: cell stages over every cell, the SM process's own stages
    (platform, imports) once per SM capability, the agent parent's (platform, shared imports) once (from the
    cells' own stage records)."""
    from audit.evidence.files import read_dir

    out: dict[str, float] = {}
    seen_groups: set[tuple] = set()
    for f in read_dir(evidence_dir):
        capability = tuple(SYSTEMS[f.cell[0]].capability) if f.cell and f.cell[0] in SYSTEMS else ()
        parent = _parent(f)
        if parent is not None and "shared-imports" not in seen_groups:
            seen_groups.add("shared-imports")
            out["shared-imports"] = out.get("shared-imports", 0.0) + float(parent.get("seconds") or 0)
        for r in f.of_kind("stage"):
            if r["stage"] in GROUP_STAGES:
                key = (r["stage"], "parent" if parent is not None and r["stage"] == "platform" else capability)
                if key in seen_groups:
                    continue
                seen_groups.add(key)
            out[r["stage"]] = out.get(r["stage"], 0.0) + float(r.get("seconds") or 0)
        for r in f.of_kind("dispatch-stage"):
            out["dispatch"] = out.get("dispatch", 0.0) + float(r.get("seconds") or 0)
    return out


def cell_costs(evidence_dir: Path) -> tuple[dict[tuple, float], dict[tuple, list[float]], float]:
    """From a run's stage records: each SM process's own setup (platform + imports), each cell's seconds (its
    own stages and the dispatch stage), by capability, and the agent parent's serial part before any SM
    process starts (platform + shared imports, when it did them; else 0)."""
    from audit.evidence.files import read_dir

    setup: dict[tuple, float] = {}
    cells: dict[tuple, list[float]] = {}
    serial = 0.0
    for f in read_dir(evidence_dir):
        if not f.cell or f.cell[0] not in SYSTEMS:
            continue
        sm = tuple(SYSTEMS[f.cell[0]].capability)
        parent = _parent(f)
        mine = [r for r in f.of_kind("stage") if r["stage"] in GROUP_STAGES
                and not (parent is not None and r["stage"] == "platform")]
        if parent is not None:
            serial = max(serial, float(parent.get("seconds") or 0) + sum(
                float(r.get("seconds") or 0) for r in f.of_kind("stage") if r["stage"] == "platform"))
        own = sum(float(r.get("seconds") or 0) for r in f.of_kind("stage") if r["stage"] not in GROUP_STAGES)
        group = sum(float(r.get("seconds") or 0) for r in mine)
        setup[sm] = max(setup.get(sm, 0.0), group)
        own += sum(float(r.get("seconds") or 0) for r in f.of_kind("dispatch-stage"))
        cells.setdefault(sm, []).append(own)
    return setup, cells, serial


def projected_wall(setup: dict, cells: dict, slots: int, serial: float = 0.0) -> float:
    """The agent's schedule at ``slots`` processes: capabilities split as probes.resolve.agent.split_groups does
    (an extra vLLM import per split) and placed on slots as probes.resolve.agent.plan_slots does; each slot runs
    its SM processes one after another, each costing its measured import plus its cells."""
    from probes.resolve.agent import plan_slots, split_groups

    flat = [{"system": {"capability": list(sm)}, "cost": c} for sm, costs in sorted(cells.items()) for c in costs]
    loads = []
    for queue in plan_slots(split_groups(flat, slots), slots):
        loads.append(sum(setup.get(tuple(g[0]["system"]["capability"]), 0.0) + sum(c["cost"] for c in g)
                         for g in queue))
    return serial + max(loads)


def smoke(args, floor: float, tmp: Path) -> int:
    """One cell, audited with an empty evidence cache, against the floor: the benchmark's code path in little."""
    os.environ["SERVING_TRUTH_EVIDENCE_CACHE"] = str(tmp / "evidence-cache-smoke")
    t0 = time.perf_counter()
    outcome = run_audit(args.pin, AuditOptions(KIMI_K3, lock_path=args.lock, reports_dir=tmp / "smoke",
                                               systems=["b200_sxm"], layouts=["tp8"], parallel=1))
    seconds = time.perf_counter() - t0
    stages = stage_seconds(outcome.run_dir / "evidence")
    print(f"pin                         {args.pin}  (smoke: one cell, b200_sxm/tp8)")
    print(f"floor: import vLLM + 1 VllmConfig      {floor:7.1f} s  (one process)")
    print(f"one-cell audit                          {seconds:7.1f} s  ({outcome.incomplete} incomplete)")
    print(f"one-cell audit / floor                 {seconds / floor:7.2f} x")
    print("stages                                 " + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(stages.items())))
    return 0 if outcome.cells == 1 and not outcome.incomplete else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pin", default="v0.33.0")
    ap.add_argument("--lock", default="images.lock")
    ap.add_argument("--parallel", type=int, default=None, help="default: the audit's own default (cores, memory)")
    ap.add_argument("--smoke", action="store_true", help="the floor and one one-cell audit only (a run check)")
    args = ap.parse_args()
    from audit.core import default_parallel

    parallel = args.parallel or default_parallel()
    pin = lock.load(args.lock).get(args.pin)
    rt = LocalRuntime()
    env = rt.ensure_env(pin, lambda *a, **k: None)
    rt.ensure_stub(env)
    with tempfile.TemporaryDirectory() as tmp:
        req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS["b200_sxm"], LAYOUTS["tp8"])],
                         run_dir=Path(tmp) / "floor", stop_after="config", parallel=1)
        req.run_dir.mkdir()
        t0 = time.perf_counter()
        rt.run(req, lambda *a, **k: None)
        floor = time.perf_counter() - t0
        if args.smoke:
            return smoke(args, floor, Path(tmp))

        default = select("layout", None, LAYOUTS)  # what `make audit` covers: the deployment options are opt-in
        cells = len(cells_of(list(SYSTEMS.values()), default))
        options = [l for l in LAYOUTS.values() if l not in default]
        sms = len({s.capability for s in SYSTEMS.values()})
        os.environ["SERVING_TRUTH_MEMO"] = str(Path(tmp) / "memo")  # empty: nothing computed before
        # nor the stand-ins' fit check (the first audit of an environment runs it; later audits read its answer)
        shutil.rmtree(rt.fit_cache(env), ignore_errors=True)

        def audit(name: str):
            os.environ["SERVING_TRUTH_EVIDENCE_CACHE"] = str(Path(tmp) / f"evidence-cache-{name}")  # cold
            watch = PeakRSS()
            watch.start()
            t0 = time.perf_counter()
            outcome = run_audit(args.pin, AuditOptions(KIMI_K3, lock_path=args.lock, reports_dir=Path(tmp) / name,
                                                        parallel=parallel))
            seconds = time.perf_counter() - t0
            watch.stop()
            return outcome, seconds, watch

        first, first_s, _ = audit("first")
        outcome, full_s, watch = audit("full")
        # the same full audit in an environment that has learned no shared imports yet (its first run): the SM
        # processes import everything themselves (and learn what to share next time, into a throwaway list)
        os.environ["SERVING_TRUTH_SHARED_IMPORTS"] = str(Path(tmp) / "shared-imports.json")
        _, unshared_s, _ = audit("unshared")
        del os.environ["SERVING_TRUTH_SHARED_IMPORTS"]
        stages = stage_seconds(outcome.run_dir / "evidence")
        setup, costs, serial = cell_costs(outcome.run_dir / "evidence")
        t0 = time.perf_counter()  # the same inputs again: every cell's evidence comes from the cache
        again = run_audit(args.pin, AuditOptions(KIMI_K3, lock_path=args.lock, reports_dir=Path(tmp) / "full-again",
                                                 parallel=parallel))
        cached = time.perf_counter() - t0
        hits = len(json.loads((again.routing_path).read_text())["run"].get("cache", {}).get("hits", []))
        limits = sum(1 for c in json.loads(outcome.routing_path.read_text())["cells"]
                     if (c.get("postload") or {}).get("limits"))
        # the deployment options alone (LAYOUTS=<them>; `LAYOUTS=all` adds them to the full audit), cache cold
        os.environ["SERVING_TRUTH_EVIDENCE_CACHE"] = str(Path(tmp) / "evidence-cache-options")
        t0 = time.perf_counter()
        run_audit(args.pin, AuditOptions(KIMI_K3, lock_path=args.lock, reports_dir=Path(tmp) / "options",
                                         parallel=parallel, layouts=[l.name for l in options]))
        options_s = time.perf_counter() - t0
        option_cells = len(cells_of(list(SYSTEMS.values()), options))
    cores = os.cpu_count()
    print(f"pin                         {args.pin}  ({cores} cores, parallel={parallel})")
    print(f"floor: import vLLM + 1 VllmConfig      {floor:7.1f} s  (one process)")
    print(f"first audit on a machine (memo empty)  {first_s:7.1f} s  ({first.incomplete} incomplete)")
    print(f"full audit: {cells} cells ({len(SYSTEMS)} systems x {len(default)} layouts)  {full_s:7.1f} s"
          f"  (evidence cache empty, memo from the first audit; {outcome.incomplete} incomplete, "
          f"{outcome.partial} stopped by vLLM, {limits} with a post-load simulation limit)")
    print(f"deployment options: {option_cells} cells ({', '.join(l.name for l in options)}; LAYOUTS=all adds them)  "
          f"{options_s:7.1f} s  (evidence cache empty)")
    print(f"processes that import vLLM             {sms}  (one per SM capability; cells fork from them)")
    print(f"full audit / floor                     {full_s / floor:7.2f} x   (goal <= 5 and <= 120 s: "
          f"{'met' if full_s <= 5 * floor and full_s <= 120 else 'not met'})")
    print(f"first audit / floor                    {first_s / floor:7.2f} x")
    print(f"full audit, no shared imports learned   {unshared_s:7.1f} s  ({unshared_s / floor:.2f} x the floor: an "
          f"environment's first run; the full audit above shares what earlier runs learned)")
    cell_total = sum(stages.values())
    serving = stages.get("post-load", 0.0) + stages.get("dispatch", 0.0)
    print(f"stages, summed (SM processes' once)     " + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(stages.items())))
    print(f"serving-time stages (post-load+dispatch) {serving:6.1f} s of {cell_total:.1f} s of stage work: "
          f"{cell_total / max(cell_total - serving, 1e-9):.2f} x the work without them")
    print("projected full audit (stage seconds only, no process start-up or host work): " + ", ".join(
        f"{n} cores {projected_wall(setup, costs, n, serial):.0f} s" for n in (parallel, 8, 16, 32))
        + f"  [measured at {parallel}: {full_s:.0f} s]")
    print(f"peak RSS of the audit (all processes)  {watch.peak / 2**30:7.2f} GiB; largest single process "
          f"{watch.peak_process / 2**30:.2f} GiB")
    print(f"repeated audit, unchanged inputs       {cached:7.1f} s  ({hits}/{cells} cells from the cache; goal <= 5 s: "
          f"{'met' if cached <= 5 else 'not met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
