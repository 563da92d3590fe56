"""The audit pipeline, without any UI: pin -> runtime -> evidence -> routing -> report files."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from audit.evidence import files as evidence
from audit.pins import lock as lockmod
from audit.pins import hosts
from audit.report import routing as routingmod
from audit.errors import AuditError, EvidenceError, HarnessFaultError, ReportWriteError, RunAborted, RunIncomplete, \
    JudgmentShrank, StandinMisfitError, UsageError
from audit import engines, models, standinfit
from audit.profiles import Profile
from audit.fsutil import DirLock, cache_root, read_regular, replace_dir, report_dir_for, write_atomic
from audit.report.render import report_files
from audit.runtimes import RunRequest, RunResult, RuntimeOptions, get_runtime, refresh_missing
from audit.runtimes.base import Progress, cell_dir_name, new_run_dir, prune_runs, newest_full_run
from audit.systems import SYSTEMS, cells_of, select


@dataclass
class AuditOutcome:
    pin: str
    report_dir: Path
    ledger: Path
    routing_path: Path
    run_dir: Path
    cells: int
    incomplete: int
    partial: int
    drift: int
    verdicts: dict | None = None
    #: submitted to a batch system and not rendered yet (slurm --no-wait)
    pending: bool = False
    #: required probe targets that drifted (the audit could not look where it must)
    required_drift: list = None
    #: whether claims were judged (False: --expectations none)
    judged: bool = True
    #: a subset audit written beside the run: the cell count of the fuller report it did not replace
    subset_of: int | None = None
    #: the pin-bump gate's answer (an explicit baseline): audit/report/gate.py
    gate: dict | None = None
    #: cells that stopped before vLLM constructed the model (nothing of theirs could be judged)
    unbuilt: list = None


def reproduce_command(pin: str, systems: list, layouts: list, runtime: str, host: str = hosts.DEFAULT,
                      lock: str = "images.lock", expectations: str = "auto", baseline: str = "",
                      *, profile: Profile) -> str:
    """The command that audits the same inputs again: ``make audit`` with its variables; defaults are left out
    (the host "undeclared" is what the default host is for a pin that declares none)."""
    lock = _display(Path(lock)) if lock != "images.lock" else lock
    options = [  # (make variable, CLI option, value, whether it differs from the default)
        ("MODEL", "--model", profile.name, profile.name != models.DEFAULT),
        ("HOST", "--host", host, host not in (hosts.DEFAULT, "undeclared")),
        ("RUNTIME", "--runtime", runtime, runtime != "local"),
        ("SYSTEMS", "--systems", ",".join(s.name for s in systems), len(systems) != len(SYSTEMS)),
        ("LAYOUTS", "--layouts", "all" if len(layouts) == len(profile.layouts) else ",".join(l.name for l in layouts),
         [l.name for l in layouts] != [l.name for l in select("layout", None, profile.layouts)]),
        ("LOCK", "--lock", lock, lock != "images.lock"),
        ("EXPECTATIONS", "--expectations", expectations, expectations != "auto"),
        ("BASELINE", "--baseline", baseline, bool(baseline)),
    ]
    given = [(var, opt, value) for var, opt, value, differs in options if differs]
    return " ".join([f"make audit PIN={pin}", *(f"{var}={v}" for var, _, v in given)])


#: resident memory one resolving process (an SM's vLLM import plus the cell it runs) needs at its peak, with
#: headroom: measured by `make bench` (README, "peak RSS per process")
PROCESS_GIB = 2.5


def default_parallel() -> int:
    """Processes resolving at once when --parallel is not given: one per core, as many as the available
    memory holds at PROCESS_GIB each, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            avail_kib = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
        by_memory = int(avail_kib / (PROCESS_GIB * 1024 * 1024))
    except (OSError, StopIteration, ValueError):
        by_memory = cores
    return max(1, min(cores, by_memory))


@dataclass(frozen=True)
class AuditOptions:
    """What an audit is asked to do, besides its pin (the CLI's ``audit`` options; every field has the CLI's default).

    ``systems``/``layouts``: comma lists or lists of names, "all", or None (every system; the model's layouts but
    its opt-in deployment options); ``profile``: the model (required: the CLI's ``--model`` picks it, there is no
    fallback); ``parallel``: agent processes (None: what the machine's cores and memory allow); ``timeout_s``: for
    the whole audit, environment included; ``baseline``: the pin to gate against ("auto": the previous pin with a
    report, "none": no gate); ``expectations``/``accepted``: files ("auto": the model's own); ``pass_env``,
    ``cluster``, ``wait``: the docker and slurm runtimes' options; ``mode``: resolve or observe, ``slice_name`` the
    model slice observe mode serves; ``replace``: replace the committed report even for a subset of cells;
    ``cache``: look evidence up in the evidence cache; ``postload_every_layer``: run post-load on every layer."""
    profile: Profile
    lock_path: str | Path = "images.lock"
    runtime: str = "local"
    systems: str | list | None = None
    layouts: str | list | None = None
    reports_dir: str | Path = "reports"
    parallel: int | None = None
    timeout_s: float | None = None
    cuda_toolkit: bool = True
    #: the host vLLM is audited as running on (audit/pins/hosts.py): "image" (the pin's official image, as
    #: images.lock declares it) or "pip" (a pip install with no CUDA toolkit; ``cuda_toolkit=False`` says the same)
    host: str = "image"
    baseline: str | None = "auto"
    expectations: str | None = "auto"
    pass_env: tuple[str, ...] = ()
    cluster: str | None = None
    wait: bool = True
    mode: str = "resolve"
    slice_name: str = ""
    profiler: bool = True
    replace: bool = False
    cache: bool = True
    postload_every_layer: bool = False
    accepted: str | None = "auto"
    #: plant a raise in this fenced piece of the harness (a test of the fence: the audit must end INCOMPLETE)
    plant_fault: str = ""


def run_audit(pin_name: str, options: AuditOptions, *,
              progress: Progress = lambda *a, **k: None) -> AuditOutcome:
    import math

    o = options

    profile = o.profile
    started = time.monotonic()  # --timeout counts from here: building the environment is part of the audit
    if o.timeout_s is not None and not (isinstance(o.timeout_s, (int, float)) and math.isfinite(o.timeout_s)
                                      and o.timeout_s > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, got {o.timeout_s!r}")
    parallel = default_parallel() if o.parallel is None else o.parallel
    if not isinstance(parallel, int) or parallel < 1:
        raise UsageError(f"--parallel must be at least 1, got {parallel!r}")
    lock = lockmod.load(o.lock_path)
    pin = lock.get(pin_name)
    if profile.engine != pin.engine:
        raise UsageError(f"{pin.name} is a {pin.engine_contract.title} pin; the profile given is {profile.title} on "
                         f"{engines.get(profile.engine).title}",
                         hint=f"audit it with the model's {pin.engine_contract.title} profile (models.for_pin)")
    host = _host(pin, o)
    # this model's reports under this host's (the default model on the image host: reports/)
    root = models.reports_root(hosts.report_root(o.reports_dir, host.name), profile)
    report_dir_for(root, pin.name)  # a pin that cannot name a report directory is bad input
    if o.baseline not in (None, "", "auto", "none"):
        # an explicit baseline is the pin-bump gate: an unknown one, or one with no report to compare with, is
        # bad input before any work (the audit would run every cell and then have nothing to gate against)
        lock.get(o.baseline)
        from audit.report.diff import load_routing

        base = load_routing(root, o.baseline, profile)
        if base.get("model") != profile.name:  # never found out only after every cell ran
            raise UsageError(f"the baseline {o.baseline}'s report ({report_dir_for(root, o.baseline)}) is of the model "
                             f"{base.get('model')!r}, not of {profile.name!r}",
                             hint=f"gate against a report of {profile.name} (its reports live in {root}), or audit "
                                  f"the model that report is of: --model {base.get('model')}")
        load_accepted_findings(o.accepted, lock_path=o.lock_path, profile=profile)
    load_expectations(o.expectations, lock_path=o.lock_path, profile=profile)  # bad expectations fail early too
    sys_sel = select("system", o.systems, SYSTEMS)
    lay_sel = select("layout", o.layouts, profile.layouts)
    if o.runtime == "docker" and host.name == "pip":
        raise UsageError("the docker runtime audits the pinned image as it is: it cannot be another host",
                         hint="audit --host pip with the local runtime (it builds the pip install's environment)")
    rt = get_runtime(o.runtime, RuntimeOptions(cuda_toolkit=host.facts["nvcc"],
                                               flashinfer_cubin=host.facts["flashinfer_cubin"],
                                               lock_dir=Path(o.lock_path).resolve().parent,
                                               pass_env=tuple(o.pass_env), cluster=o.cluster, wait=o.wait))
    if not o.cache:
        rt.stat_memo = False  # --no-cache: the environment check re-reads every file it hashes too
    rt.check(pin)
    cells = cells_of(sys_sel, lay_sel)
    if not cells:
        raise UsageError("no (system, layout) pair to audit: " + ", ".join(
            f"{l.name} is for {l.scope}" for l in lay_sel if l.scope), hint="add a system the layout exists on")
    run_dir = new_run_dir(pin, root=rt.run_root, prefix=models.run_prefix(profile, pin.name))
    if o.mode not in ("resolve", "observe"):
        raise UsageError(f"unknown mode {o.mode!r}", hint="resolve (no GPU) or observe (serves on real GPUs)")
    if o.mode == "observe" and not pin.engine_contract.observe_agent:
        raise UsageError(f"observe mode is not built for {pin.engine_contract.title}: {pin.name} can be audited in "
                         "resolve mode only", hint="drop MODE=observe (resolve mode needs no GPU)")
    if o.slice_name and o.mode != "observe":
        raise UsageError(f"--slice {o.slice_name} serves a model slice, which only observe mode does",
                         hint="resolve mode always builds every layer: drop --slice, or add --mode observe")
    if o.slice_name and o.slice_name not in profile.slices:
        raise UsageError(f"unknown slice {o.slice_name!r} for {profile.title}",
                         hint="known slices: " + ", ".join(profile.slices))
    request = RunRequest(pin=pin, profile=profile, cells=cells, run_dir=run_dir, parallel=parallel,
                         timeout_s=o.timeout_s, mode=o.mode, slice=o.slice_name, profiler=o.profiler,
                         postload_every_layer=o.postload_every_layer, plant_fault=o.plant_fault,
                         trust_memo=o.cache, deadline=started + o.timeout_s if o.timeout_s else None,
                         preflight=_stop_on_misfit(run_dir) if o.mode == "resolve" else None)
    reproduce = reproduce_command(pin.name, sys_sel, lay_sel, o.runtime, host=host.name, lock=str(o.lock_path),
                                  expectations=str(o.expectations) if o.expectations not in (None, "") else "none",
                                  baseline="" if o.baseline in (None, "auto") else o.baseline, profile=profile)
    if o.mode == "observe":
        reproduce += " MODE=observe" + (f" SLICE={o.slice_name}" if o.slice_name else "") + ("" if o.profiler else " PROFILER=0")
    cached: dict = {}
    keys: dict = {}
    discarded: list = []
    rt.bind(request)  # --timeout bounds building the environment too
    if o.mode == "resolve":  # --no-cache looks nothing up, but refreshes
        keys, cached, discarded = _from_cache(rt, request, progress, use=o.cache)
    todo = [c for c in cells if (c[0].name, c[1].name) not in cached]
    try:
        if todo:
            result = rt.run(dataclasses.replace(request, cells=todo), progress)
        else:
            progress("stage", text=f"all {len(cells)} cell(s) from the evidence cache")
            first = next(iter(cached.values()))
            result = RunResult(evidence_dir=request.evidence_dir, missing={},
                               info={**first.get("info", {}), "date": time.strftime("%Y-%m-%d", time.gmtime())})
    except RunAborted as exc:
        # what was observed goes into an INCOMPLETE ledger beside the run; reports/ stays as it was
        exc.incomplete_ledger = _render_aborted(exc, request, pin=pin, profile=profile, lock_path=o.lock_path,
                                                reproduce=reproduce, expectations=o.expectations)
        raise
    run_info = {**result.info, pin.engine_contract.commit_key: pin.commit, "reproduce": reproduce}
    if o.mode == "resolve" and (o.runtime != "docker" or host.name != "undeclared"):
        # the host resolve mode arranged; docker runs the image itself (nothing arranged), whose facts only a
        # declaration in images.lock states
        run_info["host"] = host.record(arranged=o.runtime != "docker")
    if keys:
        _to_cache(rt, request, keys, cached, result, run_dir)
        run_info["cache"] = {"hits": sorted([s, l, e.get("run", "?"), e.get("date", "?")]
                                            for (s, l), e in cached.items()),
                             "ran": len(todo), "discarded": sorted(discarded), "used": o.cache}
    if o.slice_name:
        s = profile.slices[o.slice_name]
        run_info["slice"] = {"name": s.name, "layers": s.layers, "kept": s.kept, "cut": s.cut}
    _write_run_json(request, profile, run_info, result.missing)
    if run_info.get("slurm", {}).get("pending"):  # --no-wait: submitted; rendered later from run_dir
        return AuditOutcome(pin=pin.name, report_dir=root / pin.name, ledger=None, routing_path=None,
                            run_dir=run_dir, cells=len(cells), incomplete=0, partial=0, drift=0, pending=True)
    outcome = render_run(run_dir, lock_path=o.lock_path, reports_dir=o.reports_dir, baseline=o.baseline,
                         expectations=o.expectations, replace=o.replace or (len(sys_sel) == len(SYSTEMS)
                                                                         and len(lay_sel) == len(profile.layouts)),
                         accepted=o.accepted)
    prune_runs(pin, prefix=models.run_prefix(profile, pin.name), layouts=profile.layouts)
    return outcome


INCOMPLETE_REPORTS = "incomplete-report"
#: where an aborted run keeps its last output, in the run directory (an INCOMPLETE routing names it)
ABORTED_LOG = "aborted.log"


def _from_cache(rt, request: RunRequest, progress: Progress, *, use: bool = True) -> tuple[dict, dict, list]:
    """Each cell's cache key, the cells whose evidence is cached (checked against the entry's seal, then restored
    into the run directory), and ``[system, layout, why]`` for entries found damaged and discarded. With
    ``use`` False nothing is looked up: the keys only tell which entries the fresh run refreshes."""
    from audit.evidence import cache as evcache
    from audit.runtimes.base import model_dir_name, plan_targets, write_model_dirs

    identity = rt.cache_identity(request.pin, progress)
    if identity is None:  # this runtime keeps no evidence cache
        return {}, {}, []
    progress("stage", text="looking up cached evidence" if use else "computing evidence-cache keys")
    write_model_dirs(request)
    plan = {"probes": request.probes, "extra_targets": plan_targets(request),
            "model_probes": request.profile.probes, "model": request.profile.name, "stop_after": request.stop_after,
            "serve_args": list(request.serve_args), "slice": request.slice, "observe_install": request.observe_install,
            "postload_every_layer": request.postload_every_layer, "plant_fault": request.plant_fault,
            "draft_weights": list(request.profile.draft_weights),
            # the evidence names its pin: two pins of the same wheel keep their own entries
            "pin": request.pin.name, "harness_env": identity.get("harness_env", []), "redact_env": []}
    probes = evcache.probes_digest()
    # what every reused evidence file's header must say (check_evidence_identity refuses anything else later, so an
    # entry saying otherwise is discarded here instead of failing every audit that finds it)
    header = {"pin": request.pin.name, "wheel_sha256": request.pin.wheel_sha256}
    keys, cached, discarded = {}, {}, []
    for system, layout in request.cells:
        cell = {"system": system.as_job(), "layout": layout.as_job()}
        key, inputs = evcache.cell_key(identity, plan, cell,
                                       evcache.dir_digest(request.run_dir / model_dir_name(request, layout)), probes)
        keys[(system.name, layout.name)] = (key, inputs)
        if not use:
            continue
        entry, why = evcache.check(rt.root, key, (system.name, layout.name), request.profile.name, expect=header)
        if why:
            evcache.discard(rt.root, key)
            discarded.append([system.name, layout.name, why])
            continue
        if entry is not None:
            evcache.restore(rt.root, key, request.evidence_dir / cell_dir_name(system.name, layout.name), entry)
            cached[(system.name, layout.name)] = entry
            progress("cell-done", system=system.name, layout=layout.name)
    return keys, cached, discarded


def _to_cache(rt, request: RunRequest, keys: dict, cached: dict, result: RunResult, run_dir: Path) -> None:
    from audit.evidence import cache as evcache

    for (s, l), (key, inputs) in keys.items():
        if (s, l) in cached or (s, l) in result.missing:
            continue
        evcache.store(rt.root, key, request.evidence_dir / cell_dir_name(s, l), run=run_dir.name,
                      date=result.info.get("date", ""), inputs=inputs, info=result.info)


def _write_run_json(request: RunRequest, profile: Profile, run_info: dict, missing: dict) -> None:
    meta = {"pin": request.pin.name, "profile": profile.name, "run": run_info,
            "cells": [[s.name, l.name] for s, l in request.cells],
            "missing": [[k[0], k[1], v] for k, v in sorted(missing.items())]}
    if profile.engine != engines.DEFAULT:  # the first engine's runs name none (they are read as its)
        meta["engine"] = profile.engine
    write_atomic(request.run_dir / "run.json", json.dumps(meta, indent=1, sort_keys=True))


def _render_aborted(exc: RunAborted, request: RunRequest, *, pin, profile: Profile, lock_path, reproduce: str,
                    expectations) -> Path | None:
    """Render the evidence a timed-out or dead run left, marked INCOMPLETE, under the run directory."""
    partial = exc.partial
    missing = dict(partial.missing) if partial else {}
    # the run's last output goes to a file in the run directory, which the INCOMPLETE routing names: its pids and
    # timings differ from run to run, and the routing of the same fault must not
    log = ""
    if exc.log_tail:
        write_atomic(request.run_dir / ABORTED_LOG, exc.log_tail + "\n")
        log = ABORTED_LOG
    for (s, l), info in missing.items():
        info["reason"] = f"{exc.summary}; {info.get('reason', '')}".rstrip("; ")
        info["log"] = info.get("log") or log
    run_info = {**(partial.info if partial else {}), pin.engine_contract.commit_key: pin.commit, "reproduce": reproduce,
                "aborted": {"kind": exc.kind, "message": exc.summary, "returncode": exc.returncode, "log": log}}
    _write_run_json(request, profile, run_info, missing)
    try:
        outcome = render_run(request.run_dir, lock_path=lock_path, expectations=expectations, _beside_run=True)
    except AuditError:
        return None
    return outcome.ledger


def _host(pin, o: AuditOptions) -> "hosts.Host":
    """The host the audit arranges (``--no-cuda-toolkit`` is the pip host)."""
    name = o.host if o.cuda_toolkit else "pip"
    if name not in hosts.HOSTS:
        raise UsageError(f"unknown host {name!r}", hint="known hosts: " + "; ".join(
            f"{k} ({v})" for k, v in hosts.HOSTS.items()))
    return hosts.host_for(pin, name)


def _stop_on_misfit(run_dir: Path):
    """The check a runtime runs before any cell: a stand-in that does not fit this release (and that NOT_NEEDED does
    not cover) stops the audit there (exit 4, the stand-in named, no cell run, reports/ untouched). The same rule
    judges the cells' own account after the run (:func:`render_run`), for stand-ins only a cell reaches."""
    def check(fit: dict) -> None:
        misfits = standinfit.stopping(fit)
        if misfits:
            raise StandinMisfitError(misfits=misfits, run_dir=str(run_dir), before_cells=True)
    return check


def unbuilt_cells(cells: list[dict]) -> list[list[str]]:
    """``[system/layout, outcome]`` of every cell that stopped before vLLM finished constructing the model (its
    deepest stage passed is one before ``construct``), with what stopped it (``refused``: vLLM's own code;
    ``limit``, ``fault``, ...: anything else): nothing of the model's lanes was resolved there. Resolve mode's
    stages only (observe mode's serving process records no construction stages)."""
    from audit.report.routing import STAGE_ORDER

    before = STAGE_ORDER[:STAGE_ORDER.index("construct")] + ("",)
    return [[f"{c['system']}/{c['layout']}", (c.get("failure") or {}).get("outcome") or "stopped"] for c in cells
            if c.get("evidence") == "resolved" and (c.get("depth") or "") in before]


def load_expectations(spec: str | None, *, lock_path, profile: Profile):
    """``auto``: ``expectations/<model>.toml`` beside images.lock, else in the working directory (a lock
    copied elsewhere still finds the project's claims); ``none``: no verdicts, said in the ledger. ``auto``
    that finds no file is bad input, never a silent "nothing judged"."""
    from audit.report.expectations import ExpectationsError, load

    if spec in (None, "none", ""):
        return None, ""
    if spec == "auto":  # another engine's claims are in its own folder (expectations/<engine>/)
        rel = Path("expectations") / engines.get(profile.engine).reports_folder / f"{profile.name}.toml"
        places = list(dict.fromkeys([Path(lock_path).resolve().parent / rel, Path.cwd().resolve() / rel]))
        path = next((p for p in places if p.is_file()), None)
        if path is None:
            raise UsageError(f"no claims to judge: {' nor '.join(str(p) for p in places)} exists",
                             hint="pass --expectations FILE, or --expectations none to audit without verdicts")
        exp, shown = load(path), _display(path)
    else:
        exp, shown = load(spec), str(spec)
    for key, want in (("model", profile.name), ("architecture", profile.architecture),
                      ("framework", engines.get(profile.engine).framework)):
        if getattr(exp, key) != want:
            raise ExpectationsError(f"claims are about {key} {getattr(exp, key)!r}, this audit is of {want!r}",
                                    path=str(exp.path), hint=f"use the expectations file written for {want}")
    return exp, shown


def load_accepted_findings(spec: str | None, *, lock_path, profile: Profile) -> tuple[set, str]:
    """(finding keys, shown path) of the accepted-findings file the gate subtracts. ``auto``:
    ``expectations/<model>.accepted.toml`` beside images.lock or in the working directory, and no accepted
    findings when there is none (said in the gate's answer); ``none``: none; a named file must exist."""
    from audit.report.gate import load_accepted

    if spec in (None, "none", ""):
        return set(), ""
    if spec == "auto":
        rel = Path("expectations") / f"{profile.name}.accepted.toml"
        places = list(dict.fromkeys([Path(lock_path).resolve().parent / rel, Path.cwd().resolve() / rel]))
        path = next((p for p in places if p.exists()), None)
        if path is None:
            return set(), ""
        return load_accepted(path, model=profile.name, layouts=tuple(profile.layouts)), _display(path)
    return load_accepted(spec, model=profile.name, layouts=tuple(profile.layouts)), str(spec)


def accept_findings(pin_name: str, *, reports_dir: str | Path = "reports", lock_path: str | Path = "images.lock",
                    accepted: str | None = "auto", profile: Profile) -> tuple[Path, int]:
    """Write the accepted-findings file from an audited pin's report: every failing verdict and required probe
    drift in it (notes already written for the same findings are kept). Atomic; returns (path, count)."""
    from audit.report.diff import load_routing
    from audit.report.gate import accepted_text, findings, load_accepted

    reports_dir = models.reports_root(reports_dir, profile)
    lock = lockmod.load(lock_path)
    lock.get(pin_name)
    routing = load_routing(Path(reports_dir), pin_name)
    if not routing.get("verdicts"):
        raise UsageError(f"the report of {pin_name} judged no claims (it was audited with --expectations none)",
                         hint=f"audit it with claims first: make audit PIN={pin_name}")
    if accepted in (None, "", "none"):
        raise UsageError("--accepted none names no file to write")
    if accepted == "auto":
        path = Path(lock_path).resolve().parent / "expectations" / f"{profile.name}.accepted.toml"
    else:
        path = Path(accepted)
    notes: dict = {}
    if path.exists():
        load_accepted(path)  # a damaged file is reported, never overwritten blindly
        import tomllib

        from audit.report.gate import finding_key

        for raw in tomllib.loads(path.read_text(encoding="utf-8")).get("finding", []):
            if raw.get("note"):
                notes[finding_key(raw)] = raw["note"]
    source = f"{_display(Path(reports_dir) / pin_name / 'routing.json')}, audited {routing.get('run', {}).get('date', '?')}"
    write_atomic(path, accepted_text(routing, source=source, keep_notes=notes))
    return path, len(findings(routing))


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _read_run_json(run_dir: Path) -> dict:
    if not run_dir.exists():
        raise UsageError(f"{run_dir} is not a finished run directory (no run.json)",
                         hint="pass a directory printed by `serving-truth audit`")
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is a file, not a run directory",
                         hint="pass a directory printed by `serving-truth audit`")
    path = run_dir / "run.json"
    try:
        meta = json.loads(read_regular(path))
    except FileNotFoundError:
        raise UsageError(f"{run_dir} is not a finished run directory (no run.json)",
                         hint="pass a directory printed by `serving-truth audit`") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise EvidenceError(f"unreadable run record: {exc}", path=str(path),
                            hint="the run directory is damaged; re-run the audit") from None
    shape = {"pin": str, "profile": str, "run": dict, "cells": list, "missing": list}
    bad = [k for k, t in shape.items() if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if bad:
        raise EvidenceError(f"not a run record written by this harness (bad or missing: {', '.join(bad)})",
                            path=str(path), hint="the run directory is damaged; re-run the audit")
    try:
        meta["cells"] = [(str(s), str(l)) for s, l in meta["cells"]]
        meta["missing"] = [(str(s), str(l), dict(info)) for s, l, info in meta["missing"]]
    except (TypeError, ValueError):
        raise EvidenceError("malformed cells or missing entries", path=str(path),
                            hint="the run directory is damaged; re-run the audit") from None
    return meta


def check_evidence_identity(files, meta: dict, pin, run_dir: Path, profile) -> None:
    """Every evidence file must say it is evidence of this run: its pin (by name and by the wheel's sha256,
    checked against the lock), one of the run's cells, and for resolve cells the ``vllm serve`` arguments that
    cell's layout gives. Evidence of another pin, another cell or other arguments is refused, never rendered
    under this run's name. *profile*: the model the run names."""
    layouts = profile.layouts
    cells = {tuple(c) for c in meta.get("cells") or []}
    if not cells:
        raise EvidenceError("run.json names no cell", path=str(run_dir / "run.json"),
                            hint="a run directory written by `serving-truth audit` lists the cells it ran")
    try:
        plan = json.loads((run_dir / "plan.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        plan = {}
    model = profile.name
    mode = (meta.get("run") or {}).get("mode")
    stories: dict[tuple, list[str]] = {}
    for f in files:
        h, where = f.header, str(f.path)
        if mode and h.get("mode") not in (None, mode):
            raise EvidenceError(f"evidence of {h.get('mode')} mode in a {mode} run", path=where,
                                hint="a run's evidence is of the mode its run.json names: audit again")
        if h.get("model") != model:
            raise EvidenceError(f"evidence of the model {h.get('model')!r} in a run of {model}", path=where,
                                hint="a run's evidence is of the model its run.json names: audit that model again")
        if f.cell is not None and h.get("mode") == "resolve":  # one story a cell, whatever role a file names
            stories.setdefault((f.cell, "resolve"), []).append(where)
            _check_records_against_header(f, plan)
        if h.get("mode") == "resolve" or "pin" in h:
            if h.get("pin") != pin.name:
                raise EvidenceError(f"evidence of pin {h.get('pin')!r} in a run of {pin.name}", path=where,
                                    hint="run.json and the evidence disagree: audit the pin again")
            if pin.wheel_sha256 and h.get("wheel_sha256", "") != pin.wheel_sha256:
                raise EvidenceError(f"evidence of wheel sha256 {str(h.get('wheel_sha256'))[:16]}..., images.lock pins "
                                    f"{pin.name} to {pin.wheel_sha256[:16]}...", path=where,
                                    hint="the evidence was made from another build: audit the pin again")
        if f.cell is not None and f.cell not in cells:
            raise EvidenceError(f"evidence of cell {f.cell[0]}/{f.cell[1]}, which this run does not list", path=where)
        argv = h.get("argv")
        if h.get("mode") == "resolve" and f.cell is not None and argv is not None and f.cell[1] in layouts:
            # ``<model>`` in a layout's argument is the model directory the agent served (argv[2])
            expected = [*(a.replace("<model>", str(argv[2])) for a in layouts[f.cell[1]].serve_args),
                        *plan.get("serve_args", [])] if plan and len(argv) > 2 else None
            if expected is not None and list(argv[3:]) != expected:
                raise EvidenceError(f"evidence of `vllm serve` arguments {' '.join(argv[3:])!r}, not the "
                                    f"{f.cell[1]} layout's", path=where)
    for (cell, role), paths in sorted(stories.items()):
        if len(paths) > 1:  # one cell, one story: which file would be vLLM's answer is not for the harness to pick
            raise EvidenceError(f"{len(paths)} evidence files of cell {cell[0]}/{cell[1]} ({role}): "
                                + ", ".join(sorted(paths)), path=sorted(paths)[0],
                                hint="a cell's process writes one evidence file; remove the one that is not the "
                                     "run's (or audit again)")


def _check_records_against_header(f, plan: dict) -> None:
    """A resolve cell's records say what its header says: the job it ran is the header's cell and argv, the
    parallel sizes vLLM's config took are the ones the argv asks for, and the probes were installed unless the plan
    ran without them (a transparency baseline). Records of another cell or layout under this header are refused."""
    h, where = f.header, str(f.path)
    for job in f.of_kind("job"):
        named = ((job.get("system") or {}).get("name"), (job.get("layout") or {}).get("name"))
        if named != f.cell or list(job.get("argv") or []) != list(h.get("argv") or []):
            raise EvidenceError(f"a job record of {named[0]}/{named[1]} ({' '.join(map(str, job.get('argv') or []))!r}) "
                                f"under the header of {f.cell[0]}/{f.cell[1]}", path=where,
                                hint="records of another cell or layout are no evidence of this one: audit again")
    argv = [str(a) for a in h.get("argv") or []]
    for flag, key in (("--tensor-parallel-size", "tensor_parallel_size"), ("--data-parallel-size", "data_parallel_size")):
        asked = int(argv[argv.index(flag) + 1]) if flag in argv[:-1] and argv[argv.index(flag) + 1].isdigit() else 1
        for config in f.of_kind("config"):
            if key in config and config[key] != asked:
                raise EvidenceError(f"vLLM's config took {key} = {config[key]} under a header whose `vllm serve` "
                                    f"arguments ask for {asked}", path=where,
                                    hint="records of another layout are no evidence of this one: audit again")
    if plan.get("probes", True) and any(r.get("installed") is False for r in f.of_kind("probes")):
        raise EvidenceError("a record says the probes were not installed, in a run whose plan installs them", path=where,
                            hint="a cell without probes judges nothing: audit it again")


def render_run(run_dir: str | Path, *, lock_path: str | Path = "images.lock",
               reports_dir: str | Path = "reports", baseline: str | None = "auto",
               expectations: str | None = "auto", replace: bool = True, _beside_run: bool = False,
               accepted: str | None = "auto") -> AuditOutcome:
    """(Re)build routing.json and ledger.md from a run directory's evidence; idempotent.

    Only a run in which every cell left evidence may replace ``reports/<pin>/``. A run that was aborted,
    or one with cells that never finished, renders its INCOMPLETE ledger beside the run and raises
    :class:`RunIncomplete`. With ``replace=False`` a run whose cells are fewer than the committed report's
    (a subset audit) writes beside the run too, and the outcome says so.
    """
    run_dir = Path(run_dir)
    meta = _read_run_json(run_dir)
    lock = lockmod.load(lock_path)
    pin = lock.get(meta["pin"])
    profile = models.named_in(meta, what="run.json", path=str(run_dir / "run.json"), key="profile")
    if profile.engine != pin.engine:
        raise EvidenceError(f"run.json is of {engines.get(profile.engine).title}, and images.lock says {pin.name} is "
                            f"a {pin.engine_contract.title} pin", path=str(run_dir / "run.json"),
                            hint="the run directory does not belong to this pin: audit the pin again")
    host_name = ((meta["run"].get("host") or {}).get("name")) or hosts.DEFAULT
    image_root = models.reports_root(reports_dir, profile)  # the same pin on its image's host (a host diff's base)
    reports_dir = models.reports_root(hosts.report_root(reports_dir, host_name), profile)
    missing = {(s, l): info for s, l, info in meta["missing"]}
    refreshed = refresh_missing(run_dir, meta["run"])  # JobsPending while a batch job has not ended
    if refreshed is not None:
        missing = refreshed
        meta["run"].get("slurm", {}).pop("pending", None)
        meta["missing"] = [[k[0], k[1], v] for k, v in sorted(missing.items())]
        write_atomic(run_dir / "run.json", json.dumps(meta, indent=1, sort_keys=True))
    files = evidence.read_dir(run_dir / "evidence")
    check_evidence_identity(files, meta, pin, run_dir, profile)
    aborted = bool(meta["run"].get("aborted"))
    if not files and not aborted:
        raise EvidenceError(f"no evidence files under {run_dir / 'evidence'}",
                            hint="every cell's process died before writing evidence; see the logs there")
    routing = routingmod.build_routing(files, profile, pin=pin.as_provenance(), expected=meta["cells"],
                                       missing=missing, run=meta["run"], scrub=machine_paths(run_dir),
                                       previous=_committed_same_build(reports_dir, pin, profile))
    exp, exp_path = load_expectations(expectations, lock_path=lock_path, profile=profile)
    if exp is not None:
        from audit.report.verdicts import attach

        attach(routing, exp, profile, display_path=exp_path)
    else:
        routing["verdicts_skipped"] = "no expectations were given (--expectations none): no claim was judged"
    unfinished = [(c["system"], c["layout"]) for c in routing["cells"] if c["status"] == "INCOMPLETE"]
    # a stand-in that does not fit its release (and nothing says the misfit is harmless there) stops the audit
    misfits = standinfit.stopping(routing.get("standin_fit") or {})
    incomplete = aborted or bool(unfinished) or bool(misfits)
    if incomplete and not aborted and not _beside_run:
        faulty = [c for c in routing["cells"] if c.get("harness_faults")]
        died = len(unfinished) - len(faulty)
        routing["run"]["aborted"] = {
            # a misfit first: what ran past a stand-in that does not fit explains the faults and stops after it
            "kind": "standin-misfit" if misfits else
            "harness-fault" if faulty and not died else "cells-missing", "returncode": None, "log": "",
            "message": "; ".join(part for part in (
                f"{died} of {len(routing['cells'])} cell(s) left no evidence (their process died, was killed or its "
                "job failed)" if died else "",
                f"{len(faulty)} of {len(routing['cells'])} cell(s) stopped at a harness fault (the harness's own code "
                f"raised inside {pin.engine_contract.title}'s process; see Harness faults)" if faulty else "",
                f"{len(misfits)} stand-in(s) do not fit this release ({', '.join(sorted(misfits))}): what the "
                f"simulation ran past them may not be {pin.engine_contract.title}'s code as released (see What was "
                "simulated)"
                if misfits else "") if part)}
    beside = _beside_run or incomplete
    target_root = run_dir / INCOMPLETE_REPORTS if beside else Path(reports_dir)
    report_dir = report_dir_for(target_root, pin.name)
    subset_of = None
    shrunk: list[dict] = []
    if not beside and not replace:
        subset_of = _fuller_report(report_dir, meta["cells"])
        shrunk = [] if subset_of else _judgment_shrank(report_dir, routing)
        if subset_of or shrunk:
            report_dir = report_dir_for(run_dir / "report", pin.name)
    changes = None
    gate = None
    gated = baseline not in (None, "", "auto", "none")  # an explicit baseline is the pin-bump gate
    if beside:
        baseline = None  # an INCOMPLETE ledger compares with nothing
    base_root, diff_name = Path(reports_dir), None
    if baseline == "auto" and host_name not in (hosts.DEFAULT, "undeclared"):
        # another host than the image's: what changes is the host, so the same pin on the image's host is the base
        base_root, baseline = Path(image_root), pin.name
        diff_name = f"{pin.name}@{hosts.DEFAULT}..{pin.name}@{host_name}"
        if not (report_dir_for(base_root, baseline) / "routing.json").is_file():
            changes, baseline = {"unavailable": f"{baseline} on the image's host"}, None
    if baseline == "auto":  # the pin before this one in release order, when it has been audited
        prev = lockmod.previous_pin(lock, pin.name)
        baseline = prev.name if prev else None
        if baseline and not (report_dir_for(reports_dir, baseline) / "routing.json").is_file():
            changes, baseline = {"unavailable": baseline}, None
    if baseline in ("none", ""):
        baseline = None
    if baseline and not beside:
        from audit.report.diff import diff_routings, load_routing

        base = load_routing(base_root, baseline)
        changes = diff_routings(base, routing, profile)
        if gated:
            from audit.report.gate import judge_gate

            keys, shown = load_accepted_findings(accepted, lock_path=lock_path, profile=profile)
            gate = judge_gate(base, routing, keys, profile, accepted_path=shown, diff=changes)
            changes["gate"] = gate
    files_out = report_files(routing, profile=profile, reproduce=meta["run"]["reproduce"],
                             changes=changes, label_map=exp.label_map if exp is not None else None)
    try:
        with DirLock(report_dir):
            replace_dir(report_dir, files_out)
    except OSError as exc:
        raise ReportWriteError(f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
                               path=str(report_dir), run_dir=str(run_dir)) from None
    if changes is not None and not changes.get("unavailable") and not subset_of:
        from audit.report.diff import write_diff

        d = {k: v for k, v in changes.items() if k != "gate"}
        try:
            write_diff(Path(reports_dir), baseline, pin.name, profile, d, name=diff_name)
        except OSError as exc:
            raise ReportWriteError(f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
                                   path=str(Path(reports_dir) / "diffs"), run_dir=str(run_dir)) from None
    cells = routing["cells"]
    outcome = AuditOutcome(
        pin=pin.name, report_dir=report_dir, ledger=report_dir / "ledger.md",
        routing_path=report_dir / "routing.json", run_dir=run_dir, cells=len(cells),
        incomplete=len(unfinished),
        partial=sum(c["status"] == "PARTIAL" for c in cells),
        drift=len({d["target"] for c in cells for d in c["drift"]}),
        required_drift=sorted({d["target"] for c in cells for d in c["drift"] if d.get("required", True)}),
        verdicts=(routing.get("verdicts") or {}).get("summary"),
        judged=exp is not None, subset_of=subset_of, gate=gate, unbuilt=unbuilt_cells(cells),
    )
    faults = [{**f, "cell": f"{c['system']}/{c['layout']}"} for c in routing["cells"] for f in c.get("harness_faults") or []]
    if misfits and not _beside_run:
        raise StandinMisfitError(misfits=misfits, run_dir=str(run_dir), incomplete_ledger=outcome.ledger)
    if shrunk and not _beside_run:
        raise JudgmentShrank(claims=shrunk, run_dir=str(run_dir), report=str(report_dir_for(reports_dir, pin.name)),
                             ledger=outcome.ledger)
    if faults and not _beside_run:
        raise HarnessFaultError(cells=unfinished, run_dir=str(run_dir), faults=faults, incomplete_ledger=outcome.ledger)
    if incomplete and not _beside_run and not aborted:
        raise RunIncomplete(cells=unfinished, run_dir=str(run_dir), incomplete_ledger=outcome.ledger)
    if aborted and not _beside_run:
        raise RunIncomplete(cells=unfinished or meta["cells"], run_dir=str(run_dir), incomplete_ledger=outcome.ledger)
    return outcome


def _judgment_shrank(report_dir: Path, routing: dict) -> list[dict]:
    """The claims the report about to be replaced judged (any verdict but UNVERIFIED) in a cell and the new audit
    leaves UNVERIFIED there, or does not judge at all: a judgment may not shrink silently."""
    try:
        old = json.loads((report_dir / "routing.json").read_text(encoding="utf-8"))
        rows = (old.get("verdicts") or {}).get("rows") or []
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(rows, list) or not routing.get("verdicts"):
        return []
    key = lambda r: (r.get("claim"), r.get("system"), r.get("layout"), r.get("lane"), r.get("at", ""))  # noqa: E731
    now: dict[tuple, set] = {}
    for r in routing["verdicts"]["rows"]:
        now.setdefault(key(r), set()).add(r["verdict"])
    out = []
    for r in rows:
        if not isinstance(r, dict) or not r.get("claim") or r.get("verdict") == "UNVERIFIED" or r.get("system") == "—":
            continue
        if now.get(key(r), {"UNVERIFIED"}) <= {"UNVERIFIED"}:
            out.append({k: r.get(k, "") for k in ("claim", "system", "layout", "lane", "at", "verdict")})
    return [dict(t) for t in sorted({tuple(sorted(d.items())) for d in out})]


def _committed_same_build(reports_dir: Path, pin, profile: Profile) -> dict | None:
    """The committed routing of the same build (pin name and wheel or image identity), where one exists and reads:
    a cell that stops short of where it went there is the harness's fault (audit/report/routing.py)."""
    from audit.report.diff import read_routing

    path = report_dir_for(reports_dir, pin.name) / "routing.json"
    if not path.is_file():
        return None
    try:
        committed = read_routing(path, pin=pin.name, reports_dir=reports_dir, profile=profile)
    except AuditError:  # an unreadable committed report is judged where it is read as a baseline, not here
        return None
    same = {k: committed["pin"].get(k) for k in ("wheel_sha256", "image_config_digest")} == \
        {k: pin.as_provenance().get(k) for k in ("wheel_sha256", "image_config_digest")}
    return committed if same and committed.get("model") == profile.name else None


def machine_paths(run_dir: Path) -> dict[str, str]:
    """Paths that differ between machines, and what evidence shows instead."""
    from audit.fsutil import cache_root

    out = {str(run_dir.resolve()): "<run>", str(run_dir): "<run>", str(cache_root()): "<cache>"}
    try:
        out[str(cache_root().resolve())] = "<cache>"
    except OSError:
        pass
    out[str(Path.home()) + "/"] = "~/"
    return out


def _fuller_report(report_dir: Path, cells: list[tuple[str, str]]) -> int | None:
    """The number of cells in the existing report when it holds cells this run lacks, else None."""
    try:
        old = json.loads((report_dir / "routing.json").read_text(encoding="utf-8"))
        have = {(c["system"], c["layout"]) for c in old["cells"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(have) if have - set(cells) else None


def report_from_routing(pin_name: str, *, lock_path: str | Path = "images.lock", reports_dir: str | Path = "reports",
                        profile: Profile, write: bool = True, host: str = hosts.DEFAULT) -> dict[str, str]:
    """A committed report rendered again from its own routing.json with today's code, no audit: the routing (a
    schema 2 one upgraded to records) is judged again against the model's claims (unless its audit judged none),
    its records' families and flags filled in, and its ledger, labels and routing.json written anew, the "changes
    since" section against the previous pin's committed routing. Returns the files (name -> text); with *write*,
    the report directory is replaced as one unit. The same routing always renders the same bytes.

    *host* another than the image's: the report under ``reports/hosts/<host>/``, its "changes since" against the
    same pin on the image's host, and that host diff among the files (``diffs/<pin>@image..<pin>@<host>.md``/``.json``
    relative to the host's model root)."""
    from audit.report.diff import diff_routings, load_routing, render_diff

    lock = lockmod.load(lock_path)
    pin = lock.get(pin_name)
    root = models.reports_root(hosts.report_root(reports_dir, host), profile)
    routing = load_routing(root, pin.name, profile)
    if routing.get("model") != profile.name:
        raise UsageError(f"{report_dir_for(root, pin.name) / 'routing.json'} is of the model {routing.get('model')!r}, "
                         f"not of {profile.name!r}", hint=f"render it as its own model's: --model {routing.get('model')}")
    judged = "verdicts_skipped" not in routing
    routing.pop("verdicts", None)
    exp, exp_path = load_expectations("auto" if judged else "none", lock_path=lock_path, profile=profile)
    if exp is not None:
        from audit.report.verdicts import attach

        attach(routing, exp, profile, display_path=exp_path)
    changes = None
    prev = lockmod.previous_pin(lock, pin.name)
    hosted = host not in (hosts.DEFAULT, "undeclared")
    image_root = models.reports_root(reports_dir, profile)
    if hosted:  # the same pin on the image's host is the base, as the audit of this host took it
        if (report_dir_for(image_root, pin.name) / "routing.json").is_file():
            changes = diff_routings(load_routing(image_root, pin.name, profile), routing, profile)
        else:
            changes = {"unavailable": f"{pin.name} on the image's host"}
    elif prev is not None:
        if (report_dir_for(root, prev.name) / "routing.json").is_file():
            changes = diff_routings(load_routing(root, prev.name, profile), routing, profile)
        else:
            changes = {"unavailable": prev.name}
    files = report_files(routing, profile=profile, reproduce=(routing.get("run") or {}).get("reproduce", ""),
                         changes=changes, label_map=exp.label_map if exp is not None else None)
    diff_files = {}
    if hosted and changes and not changes.get("unavailable"):
        stem = f"{pin.name}@{hosts.DEFAULT}..{pin.name}@{host}"
        diff_files = {f"../diffs/{stem}.json": json.dumps(changes, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
                      f"../diffs/{stem}.md": render_diff(changes, profile)}
    if write:
        if diff_files:
            from audit.fsutil import write_all_atomic

            write_all_atomic({root / "diffs" / Path(name).name: text for name, text in diff_files.items()})
        report_dir = report_dir_for(root, pin.name)
        try:
            with DirLock(report_dir):
                replace_dir(report_dir, files)
        except OSError as exc:
            raise ReportWriteError(f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""),
                                   path=str(report_dir), run_dir="") from None
    return {**files, **diff_files}


def regenerate_reports(*, lock_path: str | Path = "images.lock", reports_dir: str | Path = "reports",
                       pins: list[str] | None = None, drop_envs: bool = False, keep_envs: tuple[str, ...] = (),
                       progress: Progress = lambda *a, **k: None, cache: bool = True,
                       from_runs: bool = False, from_reports: bool = False,
                       profile: Profile) -> list[AuditOutcome | Path]:
    """Audit every pin that has a wheel (or those named), in release order so that each ledger's "changes
    since" finds the previous pin's fresh report, replacing ``reports/<pin>/``; then write the diff between
    each pair of consecutive pins under ``reports/diffs/``. With ``drop_envs`` the environment of each pin
    not in ``keep_envs`` is removed after its audit (each holds ~9 GB).

    With ``from_runs`` nothing is audited: each pin's reports are rendered again from the evidence of its
    newest run of every cell (:func:`newest_full_run`), with today's verdicts, templates and expectations;
    no vLLM environment is needed; a pin whose runs are gone is rendered from its committed routing.json
    (:func:`report_from_routing`), and progress says so. With ``from_reports`` every pin is rendered from its
    committed routing.json, no run read."""
    from audit.report.diff import write_diff
    from audit.runtimes.local import LocalRuntime

    lock = lockmod.load(lock_path)
    # the profile's engine's pins only: another engine's releases are audited with its own profile
    chosen = [p for p in lockmod.sorted_pins(lock) if p.has_wheel and p.engine == profile.engine
              and (not pins or p.name in pins)]
    unknown = sorted(set(pins or ()) - {p.name for p in chosen})
    if unknown:
        for name in unknown:
            other = lock.get(name)  # an unknown name: UnknownPinError
            if other.engine != profile.engine:
                raise UsageError(f"{name} is a {other.engine_contract.title} pin; this regenerates "
                                 f"{engines.get(profile.engine).title} reports",
                                 hint=f"regenerate it with --engine {other.engine}")
        raise UsageError(f"pins without a wheel cannot be regenerated locally: {', '.join(unknown)}")
    outcomes = []
    root = models.reports_root(reports_dir, profile)
    for pin in chosen:
        if from_reports or from_runs:
            run = None if from_reports else newest_full_run(pin, prefix=models.run_prefix(profile, pin.name),
                                                            layouts=profile.layouts)
            if run is None and not (report_dir_for(root, pin.name) / "routing.json").is_file():
                raise UsageError(f"no finished run of every cell of {pin.name} under {cache_root() / 'runs'}, and no "
                                 f"committed report at {report_dir_for(root, pin.name)}",
                                 hint="regenerate without --from-runs (it audits), or audit the pin first")
            if run is None:
                progress("stage", text=f"rendering {pin.name} from its committed routing.json"
                                       + ("" if from_reports else " (no finished run of every cell is left)"))
                report_from_routing(pin.name, lock_path=lock_path, reports_dir=reports_dir, profile=profile)
                outcomes.append(report_dir_for(root, pin.name))
                continue
            progress("stage", text=f"rendering {pin.name} from {run.name}")
            try:
                outcomes.append(render_run(run, lock_path=lock_path, reports_dir=reports_dir, replace=True))
            except EvidenceError as exc:
                if "evidence schema" not in str(exc) or not (report_dir_for(root, pin.name) / "routing.json").is_file():
                    raise
                # a run this harness can no longer read (written at an older evidence schema): its committed
                # routing.json is what that run rendered, so the report is rendered from it, and progress says so
                progress("stage", text=f"rendering {pin.name} from its committed routing.json ({run.name} is of an "
                                       "older evidence schema)")
                report_from_routing(pin.name, lock_path=lock_path, reports_dir=reports_dir, profile=profile)
                outcomes.append(report_dir_for(root, pin.name))
            continue
        progress("stage", text=f"auditing {pin.name}")
        outcomes.append(run_audit(pin.name, AuditOptions(lock_path=lock_path, reports_dir=reports_dir, replace=True,
                                                         cache=cache, profile=profile, layouts="all"),
                                  progress=progress))
        if drop_envs and pin.name not in keep_envs:
            env = LocalRuntime().env_dir(pin)  # validated: a direct child of <cache>/envs
            shutil.rmtree(env, ignore_errors=True)
    for before, after in zip(chosen, chosen[1:]):
        write_diff(models.reports_root(reports_dir, profile), before.name, after.name, profile)
    if from_reports:  # the committed reports of other hosts render again too, each with its host diff
        for host in sorted(h for h in hosts.HOSTS if h != hosts.DEFAULT):
            for pin in chosen:
                if (report_dir_for(models.reports_root(hosts.report_root(reports_dir, host), profile), pin.name)
                        / "routing.json").is_file():
                    progress("stage", text=f"rendering {pin.name} on the {host} host from its committed routing.json")
                    report_from_routing(pin.name, lock_path=lock_path, reports_dir=reports_dir, profile=profile,
                                        host=host)
    return outcomes
