"""``make selftest-gpu``: on a host with one NVIDIA GPU, serve a model's selftest slice with vLLM's real
engine in observe mode and check that the kernel-entry probes of its selftest lanes fired (both are its
profile's: ``selftest_slice``, ``selftest_lanes``; the model is the one ``--model`` names).

Single GPU, tensor parallel 1: per-rank head counts are those of TP1, not of the TP8 lanes, so this checks the
probes, not a production lane. Refuses to run without a GPU.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from audit.runtimes import cudastub
from audit.errors import AuditError, EnvironmentBuildError, ExitCode
from audit.systems import SYSTEMS, Layout

SELFTEST_LAYOUT = Layout("tp1-selftest", "one GPU, TP1 (selftest only)", ("--tensor-parallel-size", "1"), 1)


class SelftestFailed(AuditError):
    exit_code = ExitCode.FINDINGS

    def __init__(self, missing: list[str], fired: dict, run_dir: str):
        self.missing = missing
        self.fired = fired
        super().__init__(f"no probe fired for lane(s) {', '.join(missing)}; fired: "
                         + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(fired.items())),
                         hint=f"the evidence and agent logs are under {run_dir}")


def detect_system():
    smi = shutil.which("nvidia-smi")
    if not smi or not cudastub.real_driver_present():
        raise EnvironmentBuildError("selftest-gpu needs an NVIDIA GPU and its driver; none found on this host",
                                    step="detect GPU", hint="nothing here has been run on a GPU; see README")
    out = subprocess.run([smi, "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60).stdout.strip().splitlines()
    if not out:
        raise EnvironmentBuildError("nvidia-smi lists no GPU", step="detect GPU")
    name, cap = [x.strip() for x in out[0].split(",")]
    major, minor = (int(x) for x in cap.split("."))
    for system in SYSTEMS.values():
        if system.capability == (major, minor) and system.device_name.split()[-1] in name:
            return system
    for system in SYSTEMS.values():
        if system.capability == (major, minor):
            return system
    raise EnvironmentBuildError(f"{name} (SM {cap}) is none of the audited systems", step="detect GPU")


def run_selftest(pin_name: str = "v0.33.0", *, lock_path: str | Path = "images.lock", progress=lambda *a, **k: None,
                 timeout_s: float | None = 3600, profile) -> dict:
    from audit import models
    from audit.errors import UsageError
    from audit.evidence import files as evidence
    from audit.pins import lock as lockmod
    from audit.report import routing
    from audit.runtimes.base import RunRequest, new_run_dir
    from audit.runtimes.local import LocalRuntime

    if not profile.selftest_slice or not profile.selftest_lanes:
        raise UsageError(f"{profile.name} has no GPU selftest (its profile names no selftest slice and lanes)",
                         hint="known models with one: " + ", ".join(
                             p.name for p in models.PROFILES.values() if p.selftest_slice and p.selftest_lanes))
    system = detect_system()
    pin = lockmod.load(lock_path).get(pin_name)
    run_dir = new_run_dir(pin)
    request = RunRequest(pin=pin, profile=profile, cells=[(system, SELFTEST_LAYOUT)], run_dir=run_dir,
                         timeout_s=timeout_s, mode="observe", slice=profile.selftest_slice, serve_args=())
    LocalRuntime().run(request, progress)
    built = routing.build_routing(evidence.read_dir(request.evidence_dir), profile, pin=pin.as_provenance(),
                                  expected=[(system.name, SELFTEST_LAYOUT.name)])
    (cell,) = built["cells"]
    fired: dict[str, set] = {}
    for row in (cell.get("observed") or {}).get("rows", []):
        fired.setdefault(row["lane"], set()).add(f"{row['path']} ({row['evidence']})")
    missing = [lane for lane in profile.selftest_lanes if lane not in fired]
    result = {lane: sorted(paths) for lane, paths in sorted(fired.items())}
    if missing:
        raise SelftestFailed(missing, result, str(run_dir))
    # corroboration is reported, not required: the probes are what the selftest checks
    profiler = (cell.get("observed") or {}).get("profiler") or {}
    corroboration = {l["lane"]: l["status"] for l in profiler.get("lanes", [])}
    return {"system": system.name, "run_dir": str(run_dir), "fired": result, "profiler": corroboration,
            "profiler_traces": profiler.get("traces", 0)}
