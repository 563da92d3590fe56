"""The audit pipeline, without any UI: pin -> runtime -> evidence -> routing -> report files."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import evidence, lock as lockmod, routing as routingmod
from .errors import AuditError, EvidenceError, RunAborted, UsageError
from .profiles import KIMI_K3, Profile
from .fsutil import write_atomic
from .render import write_report
from .runtimes import RunRequest, get_runtime
from .runtimes.base import Progress, new_run_dir, prune_runs
from .systems import LAYOUTS, SYSTEMS, select


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


def reproduce_command(pin: str, systems: list, layouts: list, runtime: str, cuda_toolkit: bool = True) -> str:
    if not cuda_toolkit:
        cmd = f"serving-truth audit {pin} --runtime {runtime} --no-cuda-toolkit"
        if len(systems) != len(SYSTEMS):
            cmd += " --systems " + ",".join(s.name for s in systems)
        if len(layouts) != len(LAYOUTS):
            cmd += " --layouts " + ",".join(l.name for l in layouts)
        return cmd
    cmd = f"make audit PIN={pin}"
    if runtime != "local":
        cmd += f" RUNTIME={runtime}"
    if len(systems) != len(SYSTEMS):
        cmd += " SYSTEMS=" + ",".join(s.name for s in systems)
    if len(layouts) != len(LAYOUTS):
        cmd += " LAYOUTS=" + ",".join(l.name for l in layouts)
    return cmd


def run_audit(pin_name: str, *, lock_path: str | Path = "images.lock", runtime: str = "local",
              systems: str | list | None = None, layouts: str | list | None = None,
              reports_dir: str | Path = "reports", profile: Profile = KIMI_K3, parallel: int = 2,
              timeout_s: float | None = None, progress: Progress = lambda *a, **k: None,
              cuda_toolkit: bool = True, baseline: str | None = None,
              expectations: str | None = "auto", pass_env: list[str] = (), cluster: str | None = None,
              wait: bool = True, mode: str = "resolve", slice_name: str = "",
              profiler: bool = True) -> AuditOutcome:
    lock = lockmod.load(lock_path)
    pin = lock.get(pin_name)
    if baseline:
        lock.get(baseline)  # an unknown baseline is bad input, before any work
    load_expectations(expectations, lock_path=lock_path, profile=profile)  # bad expectations fail early too
    sys_sel = select("system", systems, SYSTEMS)
    lay_sel = select("layout", layouts, LAYOUTS)
    rt = get_runtime(runtime, cuda_toolkit=cuda_toolkit, lock_dir=Path(lock_path).resolve().parent,
                     pass_env=list(pass_env), cluster=cluster, wait=wait)
    rt.check(pin)
    cells = [(s, l) for s in sys_sel for l in lay_sel]
    run_dir = new_run_dir(pin, root=getattr(rt, "run_root", None))
    if mode not in ("resolve", "observe"):
        raise UsageError(f"unknown mode {mode!r}", hint="resolve (no GPU) or observe (serves on real GPUs)")
    if slice_name and slice_name not in profile.slices:
        raise UsageError(f"unknown slice {slice_name!r} for {profile.title}",
                         hint="known slices: " + ", ".join(profile.slices))
    request = RunRequest(pin=pin, profile=profile, cells=cells, run_dir=run_dir, parallel=parallel,
                         timeout_s=timeout_s, mode=mode, slice=slice_name, profiler=profiler)
    reproduce = reproduce_command(pin.name, sys_sel, lay_sel, runtime, cuda_toolkit)
    if mode == "observe":
        reproduce += " MODE=observe" + (f" SLICE={slice_name}" if slice_name else "") + ("" if profiler else " PROFILER=0")
    try:
        result = rt.run(request, progress)
    except RunAborted as exc:
        # what was observed goes into an INCOMPLETE ledger beside the run; reports/ stays as it was
        exc.incomplete_ledger = _render_aborted(exc, request, pin=pin, profile=profile, lock_path=lock_path,
                                                reproduce=reproduce, expectations=expectations)
        raise
    run_info = {**result.info, "vllm_commit": pin.vllm_commit, "reproduce": reproduce}
    if slice_name:
        s = profile.slices[slice_name]
        run_info["slice"] = {"name": s.name, "layers": s.layers, "kept": s.kept, "cut": s.cut}
    _write_run_json(request, profile, run_info, result.missing)
    if run_info.get("slurm", {}).get("pending"):  # --no-wait: submitted; rendered later from run_dir
        return AuditOutcome(pin=pin.name, report_dir=Path(reports_dir) / pin.name, ledger=None, routing_path=None,
                            run_dir=run_dir, cells=len(cells), incomplete=0, partial=0, drift=0, pending=True)
    outcome = render_run(run_dir, lock_path=lock_path, reports_dir=reports_dir, baseline=baseline,
                         expectations=expectations)
    prune_runs(pin)
    return outcome


INCOMPLETE_REPORTS = "incomplete-report"


def _write_run_json(request: RunRequest, profile: Profile, run_info: dict, missing: dict) -> None:
    meta = {"pin": request.pin.name, "profile": profile.name, "run": run_info,
            "cells": [[s.name, l.name] for s, l in request.cells],
            "missing": [[k[0], k[1], v] for k, v in sorted(missing.items())]}
    (request.run_dir / "run.json").write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")


def _render_aborted(exc: RunAborted, request: RunRequest, *, pin, profile: Profile, lock_path, reproduce: str,
                    expectations) -> Path | None:
    """Render the evidence a timed-out or dead run left, marked INCOMPLETE, under the run directory."""
    partial = exc.partial
    missing = dict(partial.missing) if partial else {}
    for (s, l), info in missing.items():
        info["reason"] = f"{exc.summary}; {info.get('reason', '')}".rstrip("; ")
        info["log_tail"] = info.get("log_tail") or exc.log_tail
    run_info = {**(partial.info if partial else {}), "vllm_commit": pin.vllm_commit, "reproduce": reproduce,
                "aborted": {"kind": exc.kind, "message": exc.summary, "returncode": exc.returncode,
                            "log_tail": exc.log_tail}}
    _write_run_json(request, profile, run_info, missing)
    try:
        outcome = render_run(request.run_dir, lock_path=lock_path, reports_dir=request.run_dir / INCOMPLETE_REPORTS,
                             expectations=expectations)
    except AuditError:
        return None
    return outcome.ledger


def load_expectations(spec: str | None, *, lock_path, profile: Profile):
    """``auto``: expectations/<model>.toml beside images.lock when it exists; ``none``: no verdicts."""
    from .expectations import load

    if spec in (None, "none", ""):
        return None, ""
    if spec == "auto":
        path = Path(lock_path).resolve().parent / "expectations" / f"{profile.name}.toml"
        if not path.exists():
            return None, ""
        return load(path), f"expectations/{profile.name}.toml"
    return load(spec), str(spec)


def render_run(run_dir: str | Path, *, lock_path: str | Path = "images.lock",
               reports_dir: str | Path = "reports", baseline: str | None = None,
               expectations: str | None = "auto") -> AuditOutcome:
    """(Re)build routing.json and ledger.md from a run directory's evidence; idempotent."""
    run_dir = Path(run_dir)
    try:
        meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{run_dir} is not a finished run directory (no run.json)",
                         hint="pass a directory printed by `serving-truth audit`") from None
    pin = lockmod.load(lock_path).get(meta["pin"])
    profile = {KIMI_K3.name: KIMI_K3}[meta["profile"]]
    files = evidence.read_dir(run_dir / "evidence")
    expected = [tuple(c) for c in meta["cells"]]
    missing = {(s, l): info for s, l, info in meta["missing"]}
    if meta["run"].get("slurm") and (run_dir / "jobs.json").exists():
        from .runtimes.slurm import refresh

        missing = refresh(run_dir)  # JobsPending while any job has not ended
        meta["run"]["slurm"].pop("pending", None)
        meta["missing"] = [[k[0], k[1], v] for k, v in sorted(missing.items())]
        write_atomic(run_dir / "run.json", json.dumps(meta, indent=1, sort_keys=True))
    if not files and not meta["run"].get("aborted"):
        raise EvidenceError(f"no evidence files under {run_dir / 'evidence'}")
    routing = routingmod.build_routing(files, profile, pin=pin.as_provenance(), expected=expected,
                                       missing=missing, run=meta["run"])
    exp, exp_path = load_expectations(expectations, lock_path=lock_path, profile=profile)
    if exp is not None:
        from .verdicts import attach

        attach(routing, exp, display_path=exp_path)
    report_dir = Path(reports_dir) / pin.name
    changes = None
    if baseline:
        from .diff import diff_routings, load_routing

        changes = diff_routings(load_routing(Path(reports_dir), baseline), routing)
    write_report(report_dir, routing, profile_title=profile.title, reproduce=meta["run"]["reproduce"],
                 changes=changes)
    cells = routing["cells"]
    return AuditOutcome(
        pin=pin.name, report_dir=report_dir, ledger=report_dir / "ledger.md",
        routing_path=report_dir / "routing.json", run_dir=run_dir, cells=len(cells),
        incomplete=sum(c["status"] == "INCOMPLETE" for c in cells),
        partial=sum(c["status"] == "PARTIAL" for c in cells),
        drift=len({d["target"] for c in cells for d in c["drift"]}),
        verdicts=(routing.get("verdicts") or {}).get("summary"),
    )


def clean_cache(keep_envs: bool = True) -> None:
    from .runtimes.base import cache_root

    shutil.rmtree(cache_root() / "runs", ignore_errors=True)
