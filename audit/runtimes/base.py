"""The runtime interface and the run directory every runtime fills the same way."""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from audit.evidence.sources import probe_sources
from audit.fsutil import cache_root, read_regular
from audit.pins.lock import Pin
from audit.profiles import Profile
from audit.systems import Layout, System

#: progress(event, **fields): "stage" (text), "cell-done" (system, layout, ok)
Progress = Callable[..., None]


@dataclass
class RunRequest:
    pin: Pin
    profile: Profile
    cells: list[tuple[System, Layout]]
    run_dir: Path
    parallel: int = 2
    timeout_s: float | None = None
    #: False runs the same simulation without probes (the baseline that transparency is checked against)
    probes: bool = True
    #: extra probe targets as data: [{"id", "kind", "specs": [...], "title"}]
    extra_targets: list = field(default_factory=list)
    #: "config" stops every cell after building its VllmConfig (the benchmark's floor)
    stop_after: str = ""
    #: "resolve" (simulated platform, no GPU) or "observe" (real GPUs; decides what a job requests)
    mode: str = "resolve"
    #: ``vllm serve`` arguments added to every cell's layout arguments
    serve_args: tuple[str, ...] = ("--load-format", "dummy")
    #: a profile slice (observe mode serves fewer layers); "" serves the published config
    slice: str = ""
    #: after construction, install observe mode's targets and record their status (a test of drift)
    observe_install: bool = False
    #: observe mode: corroborate the probes with vLLM's torch profiler (one trace per worker and phase)
    profiler: bool = True
    #: post-load runs vLLM's MoE conversion on every layer instead of carrying a representative's result
    #: (probes/resolve/carry.py); the same routing either way, the straightforward path is slower
    postload_every_layer: bool = False
    #: a fenced piece of the harness in which the agent raises a planted fault (probes.core.fence; tests of the
    #: fence itself): "" plants nothing
    plant_fault: str = ""
    #: planted raises are caught by each piece's own fence and recorded, then the piece does its work
    plant_survey: bool = False
    #: False (``--no-cache``): the memo of pure computations below vLLM serves no stored answer (computes
    #: every one and refreshes its entries)
    trust_memo: bool = True
    #: time.monotonic() by which the whole audit must end (``--timeout`` counted from the audit's start, so it
    #: covers building the environment too); None: from when the run starts, or no limit without timeout_s
    deadline: float | None = None
    #: called with every stand-in's fit to the release ({stand-in: fit}, probes/resolve/fitcheck.py) before any
    #: cell runs, by a runtime that can check it first; it raises to stop the audit (audit/core.py decides)
    preflight: Callable[[dict], None] | None = None

    def remaining(self) -> float | None:
        """Seconds left before the deadline (never negative), or None without a timeout."""
        if self.deadline is None and self.timeout_s:
            self.deadline = time.monotonic() + self.timeout_s
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    @property
    def evidence_dir(self) -> Path:
        return self.run_dir / "evidence"


@dataclass
class RunResult:
    evidence_dir: Path
    #: (system, layout) -> {"reason": ..., "log": ...} for cells without evidence; "log" names the cell's process
    #: log relative to the run directory (its tail carries pids and timings, so it stays out of the routing)
    missing: dict[tuple[str, str], dict] = field(default_factory=dict)
    #: runtime facts for the provenance block (runtime, python, mode, date, ...)
    info: dict = field(default_factory=dict)


@runtime_checkable
class Runtime(Protocol):
    """Every attribute ``audit/core.py`` uses of a runtime, declared: core calls them, never ``hasattr``. A runtime
    without a capability says so through :class:`RuntimeDefaults` (no evidence cache, the default run root)."""

    name: str
    #: the cache root this runtime's caches (environments, the evidence cache) live under
    root: Path
    #: where run directories go (None: ``<cache>/runs``; Slurm: the cluster's shared directory)
    run_root: Path | None
    #: whether the environment check may skip re-hashing files whose stat is unchanged (``--no-cache`` sets False)
    stat_memo: bool

    def check(self, pin: Pin) -> None:
        """Raise RuntimeUnsupportedError when this runtime cannot audit the pin."""

    def bind(self, request: RunRequest) -> None:
        """The run about to be prepared (its deadline bounds the work done before ``run``, e.g. an env build)."""

    def cache_identity(self, pin: Pin, progress: Progress) -> dict | None:
        """What identifies this runtime's environment for the evidence cache, or None: it keeps no cache."""

    def run(self, request: RunRequest, progress: Progress) -> RunResult:
        ...


class RuntimeDefaults:
    """The declared capabilities a runtime does without: runs under ``<cache>/runs``, no stat memo to turn off,
    nothing to bind, no evidence cache."""

    run_root: Path | None = None
    stat_memo: bool = True

    def bind(self, request: RunRequest) -> None:
        return None

    def cache_identity(self, pin: Pin, progress: Progress) -> dict | None:
        return None


def new_run_dir(pin: Pin, *, root: Path | None = None, prefix: str | None = None) -> Path:
    """``<cache>/runs/<prefix>-<UTC time>-<pid>``; the prefix is the pin's name, or for a model other than the
    default ``<model>--<pin>`` (:func:`audit.models.run_prefix`)."""
    root = (root or cache_root()) / "runs"
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = root / f"{prefix or pin.name}-{stamp}-{os.getpid()}"
    path.mkdir()
    return path


#: run directories younger than this are never pruned
RECENT_S = 3600


def runs_of(pin: Pin, root: Path | None = None, prefix: str | None = None) -> list[Path]:
    """This pin's run directories (of the model whose run prefix is *prefix*), oldest first (never another
    pin's or model's: "v0.33.0" must not match "v0.33.0-image-..." nor "gpt-oss-120b--v0.33.0-...")."""
    import re

    prefix = prefix or pin.name
    own = re.compile(re.escape(prefix) + r"-\d{8}T\d{6}Z-\d+$")
    return sorted(p for p in (root or cache_root()).joinpath("runs").glob(f"{prefix}-*") if own.match(p.name))


def prune_runs(pin: Pin, *, layouts: dict, keep: int = 5, root: Path | None = None,
               prefix: str | None = None) -> None:
    """Keep the newest *keep* run directories of this pin (:func:`runs_of`), and always its newest run of every
    cell (:func:`newest_full_run`: what ``make reports FROM_RUNS=1`` renders from), however many subset audits
    came after it."""
    runs = runs_of(pin, root, prefix)
    recent = time.time() - RECENT_S
    full = newest_full_run(pin, root, prefix=prefix, layouts=layouts)
    for old in runs[:-keep]:
        if old == full:
            continue
        try:
            if old.stat().st_mtime > recent:
                continue  # possibly another audit's, still running or just rendered: never pulled from under it
        except OSError:
            continue
        shutil.rmtree(old, ignore_errors=True)


def stage_probes(run_dir: Path) -> Path:
    """Copy the probes package into the run directory: the exact probes a run used stay with it."""
    dest = run_dir / "probes"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for rel, data in probe_sources():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    # the metadata that makes vLLM load probes.observe.plugin in every process it starts (observe mode)
    from probes.observe.plugin import dist_info_files

    from audit import __version__

    for rel, text in dist_info_files(__version__).items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text, encoding="utf-8")
    return run_dir


def _model_patch(request: RunRequest, layout: Layout) -> tuple:
    sl = request.profile.slices[request.slice].patch if request.slice else ()
    return tuple(sl) + tuple(layout.config_patch)


def model_dir_name(request: RunRequest, layout: Layout) -> str:
    return "model-" + layout.name if _model_patch(request, layout) or layout.draft_config else "model"


def write_model_dirs(request: RunRequest) -> str:
    """The published config, plus one derived copy per layout that declares a config patch (and, for a
    sliced run, the slice's patch applied to every copy)."""
    base = request.profile.write_model_dir(request.run_dir / "model")
    for layout in {l.name: l for _, l in request.cells}.values():
        patch = _model_patch(request, layout)
        if patch or layout.draft_config:
            request.profile.write_model_dir(request.run_dir / model_dir_name(request, layout), patch,
                                            draft=layout.draft_config)
    return str(base)


def agent_env(*, home: str, vllm_cache: str, triton_cache: str, xdg_cache: str) -> dict[str, str]:
    """What every runtime sets for the agent, whatever else it adds: offline, no telemetry, no user
    site-packages, no bytecode written, caches where the runtime says, and no vLLM plugin of the image
    (observe mode names its own)."""
    return {
        "HOME": home,
        "TZ": "UTC",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CACHE_ROOT": vllm_cache,
        "TRITON_CACHE_DIR": triton_cache,
        "XDG_CACHE_HOME": xdg_cache,
        "VLLM_PLUGINS": "",
    }


#: caches inside a container: its own tmpfs
CONTAINER_CACHES = {"home": "/tmp/home", "vllm_cache": "/tmp/vllm-cache", "triton_cache": "/tmp/triton",
                    "xdg_cache": "/tmp/xdg"}


def observe_env(out_dir: str, cell: str, profile) -> dict[str, str]:
    """Observe mode: the probes' plugin in every vLLM process, writing into this cell's evidence directory, with the
    served model's probes package and quantization schemes (its *profile*'s ``probes`` and ``schemes``) and its name
    (every evidence file names its model)."""
    return {"SERVING_TRUTH_OUT": out_dir, "SERVING_TRUTH_MODE": "observe", "SERVING_TRUTH_CELL": cell,
            "SERVING_TRUTH_MODEL_PROBES": profile.probes, "SERVING_TRUTH_SCHEMES": ",".join(profile.schemes),
            "SERVING_TRUTH_MODEL": profile.name, "VLLM_PLUGINS": "serving_truth"}


LEARNED_IMPORTS = "learned-imports.json"


def learned_imports(cache_dir: Path) -> list[str]:
    """Modules earlier runs of this environment imported lazily while building configs and models;
    each SM process imports them once before forking its cells (a pure speed-up)."""
    try:
        return list(json.loads((cache_dir / LEARNED_IMPORTS).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return []


def learn_imports(cache_dir: Path, evidence_dir: Path) -> None:
    seen: dict[str, None] = dict.fromkeys(learned_imports(cache_dir))
    for path in sorted(evidence_dir.glob("*/imported-modules.json")):
        try:
            seen.update(dict.fromkeys(json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    from audit.fsutil import write_atomic

    try:  # a uniquely named temp file: concurrent audits of one environment never collide
        write_atomic(cache_dir / LEARNED_IMPORTS, json.dumps(list(seen)))
    except OSError:
        pass  # a pure speed-up: a full or read-only cache must not fail the audit


SHARED_IMPORTS = "shared-imports.json"
#: where the agent's SM processes leave what they imported and which imports read the device (the agent's
#: ``probes.resolve.agent.LEARN_DIR``, under the evidence directory)
SHARED_LEARN_DIR = ".shared-imports"


def shared_imports_file(cache_dir: Path) -> Path:
    """The environment's list (``SERVING_TRUTH_SHARED_IMPORTS`` names another file: tests, or a user who wants
    to start it over)."""
    override = os.environ.get("SERVING_TRUTH_SHARED_IMPORTS")
    return Path(override) if override else cache_dir / SHARED_IMPORTS


#: top-level names never imported ahead of vLLM: vLLM itself, the probes, the interpreter's entry points
_NEVER_AHEAD = ("vllm", "probes", "__main__", "__mp_main__")


def _shared_list(cache_dir: Path, key: str) -> list[str]:
    """One list of the environment's shared-imports file (empty when the file or the list is unreadable)."""
    try:
        data = json.loads(read_regular(shared_imports_file(cache_dir)))  # a FIFO there is no list: never waited on
        return [m for m in data[key] if isinstance(m, str)]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def ahead_imports(cache_dir: Path) -> list[str]:
    """Top-level packages earlier runs saw imported only after the first module that reads the device: each SM
    process imports them before vLLM's own modules, so a later run can tell whether their imports read the
    device (a pure speed-up; a package that reads it is a reader from then on)."""
    return _shared_list(cache_dir, "ahead")


def shared_imports(cache_dir: Path) -> list[str]:
    """Modules earlier runs of this environment imported, in every SM process, before the first module whose
    import read the simulated device, in import order: the agent's parent imports them once, before any SKU is
    set, and every SM process forks with them. A pure speed-up: a module that reads the device there makes the
    agent start again without them."""
    return _shared_list(cache_dir, "shared")


def learn_shared_imports(cache_dir: Path, evidence_dir: Path) -> None:
    """From this run's SM processes (each one's import order and the modules whose import read the device, and
    the modules the agent's parent was importing when it saw a read before a SKU was set): the modules every SM
    process started importing before its first reader. Readers accumulate over runs of the environment."""
    readers = set(_shared_list(cache_dir, "readers"))
    learn = evidence_dir / SHARED_LEARN_DIR
    orders = []
    for path in sorted(learn.glob("sm*.json")):
        try:
            one = json.loads(path.read_text(encoding="utf-8"))
            orders.append([m for m in one["order"] if isinstance(m, str)])
            readers.update(m for m in one["readers"] if isinstance(m, str))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    try:
        for read in json.loads((learn / "tripped.json").read_text(encoding="utf-8")):
            readers.update(m for m in read.get("importing", ()) if isinstance(m, str))
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    if not orders:
        return
    prefixes, later = [], {}
    for order in orders:
        first = next((i for i, m in enumerate(order) if m in readers), len(order))
        prefixes.append(order[:first])
        later.update(dict.fromkeys(m.partition(".")[0] for m in order[first:]))
    common = set(prefixes[0]).intersection(*map(set, prefixes[1:]))
    shared = [m for m in prefixes[0] if m in common]
    # packages first imported after a reader, whose own import may well read nothing: the SM processes of the
    # next run import them before vLLM's own modules, so the run after that can share those that read nothing
    started = {m.partition(".")[0] for m in shared} | {m.partition(".")[0] for m in readers}
    ahead = [t for t in later if t not in started and t not in _NEVER_AHEAD]
    from audit.fsutil import write_atomic

    try:
        write_atomic(shared_imports_file(cache_dir), json.dumps({"shared": shared, "ahead": ahead,
                                                                "readers": sorted(readers)}))
    except OSError:
        pass  # a pure speed-up


def plan_targets(request: RunRequest) -> list[dict]:
    """Probe targets the plan sends besides the shared ones and the model's probe module's (tests plant drifted
    ones here)."""
    return [dict(t) for t in request.extra_targets]


def write_plan(request: RunRequest, *, model_dir: str, stub_libcuda: str, out_dir: str,
               learned: list[str] = (), shared: list[str] = (), ahead: list[str] = (), where: Callable[[Path | str], str] = str,
               harness_env: list[str] = (), redact_env: list[str] = (), name: str = "plan.json",
               memo_dir: str | None = None) -> Path:
    """``plan.json`` for ``probes.resolve.agent``. *where* maps a host path to the path the agent sees
    (identity for the local runtime, the mount point inside a container)."""
    plan = {
        "schema": 1,
        "pin": request.pin.name,
        "wheel_sha256": request.pin.wheel_sha256 or "",
        "model_dir": where(model_dir),
        "stub_libcuda": where(stub_libcuda),
        "out_dir": where(out_dir),
        "parallel": request.parallel,
        "probes": request.probes,
        "extra_targets": plan_targets(request),
        "model_probes": request.profile.probes,
        "schemes": list(request.profile.schemes),
        "model": request.profile.name,
        "stop_after": request.stop_after,
        "serve_args": list(request.serve_args),
        "slice": request.slice,
        "observe_install": request.observe_install,
        "postload_every_layer": request.postload_every_layer,
        "plant_fault": request.plant_fault,
        "plant_survey": request.plant_survey,
        # pure computations below vLLM kept across cells and audits (probes/resolve/memo.py); None: none kept
        "memo_dir": where(memo_dir) if memo_dir else None,
        "memo_trust": request.trust_memo,
        "draft_weights": list(request.profile.draft_weights),
        "profile": request.profiler,
        "warm_third_party": ["torch", "transformers", "triton"],
        "warm_imports": list(request.profile.warm_imports),
        "learned_imports": list(learned),
        "shared_imports": [m for m in shared if not m.startswith(("probes", "__main__", "__mp_main__"))],
        "ahead_imports": [m for m in ahead if m not in _NEVER_AHEAD],
        "harness_env": sorted(harness_env),
        "redact_env": sorted(redact_env),
        "cells": [{"system": s.as_job(), "layout": l.as_job(),
                   "model_dir": where(request.run_dir / model_dir_name(request, l))}
                  for s, l in request.cells],
    }
    path = request.run_dir / name
    path.write_text(json.dumps(plan, indent=1, sort_keys=True), encoding="utf-8")
    return path


def cell_dir_name(system: str, layout: str) -> str:
    return f"{system}--{layout}"


def timed_out(request: RunRequest, *, where: str, log_tail_text: str, missing: dict, runtime: str):
    """The RunTimedOut a runtime raises, carrying what the run had collected (for the INCOMPLETE ledger)."""
    from audit.errors import RunTimedOut

    exc = RunTimedOut(seconds=request.timeout_s, where=where, log_tail=log_tail_text)
    exc.partial = RunResult(evidence_dir=request.evidence_dir, missing=missing,
                            info={"runtime": runtime, "mode": request.mode})
    return exc


def report_finished(request: RunRequest, reported: set, progress: Progress) -> None:
    """Progress: a "cell-done" event for each cell whose evidence file has appeared since last time."""
    for system, layout in request.cells:
        key = (system.name, layout.name)
        if key not in reported and any((request.evidence_dir / cell_dir_name(*key)).glob("evidence-*.jsonl")):
            reported.add(key)
            progress("cell-done", system=key[0], layout=key[1])


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def run_relative(run_dir: Path, path: Path | None) -> str:
    """*path* relative to the run directory where it lies inside it and exists ("" otherwise): what an INCOMPLETE
    routing names for a log, the same in every run of the same cells."""
    if path is None or not path.exists():
        return ""
    try:
        return path.resolve().relative_to(run_dir.resolve()).as_posix()
    except ValueError:
        return ""


#: a cell directory's line on why its process ended (``probes.resolve.agent.ENDED_FILE``)
ENDED_FILE = "ended.txt"


def ended_line(cell_dir: Path) -> str:
    """Why a cell's process ended without evidence, as the agent that saw it end wrote it (one short line, no
    pid); "" where it wrote none or what it wrote is not such a line."""
    try:
        line = (cell_dir / ENDED_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return line if line and "\n" not in line and len(line) <= 200 and line.isprintable() else ""


def ended_reason(cell_dir: Path) -> str:
    why = ended_line(cell_dir)
    return "the cell's process ended without writing evidence" + (f" ({why})" if why else "")


def collect_missing(request: RunRequest, *, fallback_log: Path | None = None) -> dict[tuple[str, str], dict]:
    """Cells whose process left no evidence file, each with where its log is (relative to the run directory)."""
    missing = {}
    for system, layout in request.cells:
        d = request.evidence_dir / cell_dir_name(system.name, layout.name)
        if any(d.glob("evidence-*.jsonl")):
            continue
        log = d / "agent.log"
        missing[(system.name, layout.name)] = {
            "reason": ended_reason(d) if log.exists() else "the cell never started (the agent failed before it)",
            "log": run_relative(request.run_dir, log if log.exists() else fallback_log),
        }
    return missing


def newest_full_run(pin, root: Path | None = None, *, prefix: str | None = None, layouts: dict) -> Path | None:
    """The newest run directory of *pin* (of the model with this run *prefix*) that covered every (system,
    layout) cell of that model's *layouts* and left evidence for each, unaborted; None when there is none."""
    from audit.systems import SYSTEMS, cells_of

    every = sorted([s.name, l.name] for s, l in cells_of(list(SYSTEMS.values()), list(layouts.values())))
    for run in reversed(runs_of(pin, root, prefix)):
        try:
            meta = json.loads((run / "run.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if sorted(meta.get("cells", [])) == every and not meta.get("missing") and not meta["run"].get("aborted") \
                and meta["run"].get("mode", "resolve") == "resolve":
            return run
    return None
