"""The Slurm runtime: one batch job per (system, layout) cell, evidence on a shared filesystem.

Placement comes from a cluster profile (:mod:`audit.runtimes.cluster`). A resolve cell needs no GPU and goes
to the profile's CPU partition; a hardware-bound cell (observe mode) asks its system's partition for
its GPUs. Each job runs the same probe agent as the local runtime, with a plan holding only its cell:

* ``container = "local"``: the pinned venv (built once by the local runtime under the profile's
  ``env_root`` on the shared filesystem) with the same explicit, minimal environment;
* ``container = "pyxis"``: ``srun --container-image`` with the pinned digest (per platform) or a
  pre-imported squashfs whose sha256 is checked; these command lines are produced by
  :func:`pyxis_srun_args` and checked as data, since pyxis cannot run on the test machines.

The harness records every job id it submitted (``jobs.json``), waits with progress, turns a job that
failed, was cancelled or could not be submitted into INCOMPLETE cells carrying the Slurm state and
the job log's tail, and on Ctrl-C/SIGTERM/timeout cancels exactly those ids. ``no_wait`` submits and
returns; ``serving-truth render RUN_DIR`` renders once every job has ended (idempotent).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from probes.core.lifecycle import WATCHDOG_ENV

from audit.runtimes.cluster import ClusterProfile, Placement
from audit.errors import EnvironmentBuildError, RuntimeUnsupportedError, UsageError
from audit.fsutil import cache_root
from audit.pins.lock import Pin
from audit.runtimes.base import (CONTAINER_CACHES, Progress, RunRequest, RunResult, RuntimeDefaults, agent_env,
                                 cell_dir_name, ended_line, observe_env, run_relative, stage_probes, timed_out,
                                 write_model_dirs, write_plan)

JOBS_FILE = "jobs.json"
#: Slurm job states after which a job will not run again
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"}
POLL_S = 2.0


class JobsPending(UsageError):
    """Rendering a --no-wait run whose jobs have not all ended yet."""

    def __init__(self, run_dir: str, pending: dict[str, str]):
        self.run_dir = run_dir
        self.pending = pending
        listing = ", ".join(f"{j} ({s})" for j, s in sorted(pending.items()))
        super().__init__(f"{len(pending)} Slurm job(s) of {run_dir} have not ended: {listing}",
                         hint="render again when they have (squeue -j <ids>); rendering is idempotent")


def _slurm(cmd: list[str], *, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise EnvironmentBuildError(f"{cmd[0]} not found", step="slurm",
                                    hint="run on a Slurm submit host (sbatch, squeue, scontrol, scancel on PATH)") from None
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError(f"{' '.join(cmd)} did not answer in {timeout:.0f}s", step="slurm",
                                    hint="is slurmctld up? `scontrol ping`") from None


def job_states(ids: list[str]) -> dict[str, dict]:
    """{job id: {"state", "exit_code", "reason"}} from squeue (all states) and scontrol."""
    if not ids:
        return {}
    out: dict[str, dict] = {}
    r = _slurm(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r"])
    for line in r.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 3 and parts[0] in ids:
            out[parts[0]] = {"state": parts[1], "reason": parts[2], "exit_code": None}
    for job in ids:
        if job in out and out[job]["state"] not in TERMINAL:
            continue
        r = _slurm(["scontrol", "-o", "show", "job", job])
        fields = dict(f.split("=", 1) for f in r.stdout.split() if "=" in f)
        if fields.get("JobState"):
            out[job] = {"state": fields["JobState"], "reason": fields.get("Reason", ""),
                        "exit_code": fields.get("ExitCode")}
        elif job not in out:
            out[job] = {"state": "UNKNOWN", "reason": "Slurm no longer knows this job", "exit_code": None}
    return out


def enroot_uri(image_ref: str) -> str:
    """``repo@sha256:..`` as pyxis/enroot accept it: ``REGISTRY#IMAGE:<digest>``.

    Enroot 3.x does not parse ``@digest``; the digest goes where a tag would (the manifest
    reference), with the registry named explicitly (Docker Hub is ``registry-1.docker.io``)."""
    from audit.pins.registry import parse_ref

    registry, name, reference = parse_ref(image_ref)
    if not reference.startswith("sha256:"):
        raise UsageError(f"{image_ref} is not pinned by digest")
    return f"{registry}#{name}:{reference}"


def agent_command_args(observe: bool, plan, engine=None) -> list[str]:
    """The agent a job runs: the engine's resolve agent, or its observe agent serving the job's one cell."""
    from audit import engines

    engine = engine or engines.get(engines.DEFAULT)
    return ["-m", engine.observe_agent, str(plan), "0"] if observe else ["-m", engine.resolve_agent, str(plan)]


def agent_command(request: RunRequest, plan) -> list[str]:
    return agent_command_args(request.mode == "observe", plan, request.pin.engine_contract)


def pyxis_srun_args(*, pin: Pin, placement: Placement, run_dir: Path, plan: str, env: dict[str, str],
                    observe: bool = False) -> list[str]:
    """The exact srun command a pyxis job runs for one cell (data; checked by the tests)."""
    if placement.squashfs:
        image = placement.squashfs
    else:
        ref = pin.image_for(f"linux/{placement.arch}")
        if not pin.image:
            raise RuntimeUnsupportedError(pin.name, runtime="slurm (pyxis)", supported=pin.runtimes,
                                          reason="pyxis pulls from a registry or a squashfs; this pin has neither")
        image = enroot_uri(ref)
    evidence = run_dir / "evidence"
    exports = ",".join(sorted(env))
    return [
        "srun", "--ntasks=1",
        f"--container-image={image}",
        f"--container-mounts={run_dir}:{run_dir}:ro,{evidence}:{evidence}:rw",
        "--no-container-mount-home", "--no-container-remap-root", "--no-container-entrypoint",
        "--container-workdir=/tmp",
        f"--export={exports}",
        "python3", *agent_command_args(observe, plan, pin.engine_contract),
    ]


class SlurmRuntime(RuntimeDefaults):
    name = "slurm"

    def __init__(self, profile: ClusterProfile, *, wait: bool = True, with_cuda_toolkit: bool = True,
                 with_flashinfer_cubin: bool = False):
        self.profile = profile
        self.wait = wait
        self.with_cuda_toolkit = with_cuda_toolkit
        self.with_flashinfer_cubin = with_flashinfer_cubin
        self.root = cache_root()

    @property
    def run_root(self) -> Path:
        return self.profile.shared_dir

    def check(self, pin: Pin) -> None:
        modes = {p.container for p in self.profile.placements.values()}
        if "local" in modes and not pin.has_wheel:
            raise RuntimeUnsupportedError(
                pin.name, runtime=self.name, supported=[r for r in pin.runtimes],
                reason=f"the cluster profile {self.profile.path} runs some systems with container = \"local\" "
                       "(the pinned wheel), and this pin has no wheel")
        if "pyxis" in modes and not pin.image and not all(
                p.squashfs for p in self.profile.placements.values() if p.container == "pyxis"):
            raise RuntimeUnsupportedError(pin.name, runtime=self.name, supported=pin.runtimes,
                                          reason="pyxis systems need a registry image or a squashfs")
        if "pyxis" in modes and not pin.has_wheel:
            raise RuntimeUnsupportedError(
                pin.name, runtime=self.name, supported=[r for r in pin.runtimes if r != self.name],
                reason="a pyxis resolve job needs the stub libcuda, which is built from the pinned wheel's "
                       "libraries; this pin has no wheel")

    # -- jobs ----------------------------------------------------------------------------------
    def sbatch_header(self, request: RunRequest, system, layout, log: Path) -> list[str]:
        p = self.profile.placement(system.name)
        lines = [
            f"--job-name=st-{request.pin.name}-{system.name}-{layout.name}",
            f"--output={log}",
            f"--time={self.profile.time_limit}",
            "--ntasks=1",
            f"--cpus-per-task={self.profile.resolve_cpus}",
        ]
        if request.mode == "observe":  # the GPUs the layout needs, on its system's partition
            per_node = p.gpus or 8
            nodes = max(1, -(-layout.world_size // per_node))
            lines += [f"--partition={p.partition}" if p.partition else "", f"--nodes={nodes}",
                      f"--gpus-per-node={min(per_node, layout.world_size)}"]
        else:  # resolve: no GPU requested, a CPU partition
            part = p.resolve_partition or self.profile.resolve_partition
            if part:
                lines.append(f"--partition={part}")
        if p.constraint:
            lines.append(f"--constraint={p.constraint}")
        if self.profile.resolve_mem and request.mode != "observe":
            lines.append(f"--mem={self.profile.resolve_mem}")
        lines += list(self.profile.sbatch_args)
        return [l for l in lines if l]

    def job_script(self, request: RunRequest, system, layout, *, plan: Path, log: Path, env: dict,
                   python: str) -> str:
        p = self.profile.placement(system.name)
        head = "\n".join(f"#SBATCH {a}" for a in self.sbatch_header(request, system, layout, log))
        if p.container == "pyxis":
            exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items()))
            cmd = " ".join(shlex.quote(a) for a in pyxis_srun_args(
                pin=request.pin, placement=p, run_dir=request.run_dir, plan=str(plan), env=env,
                observe=request.mode == "observe"))
            body = f"{exports}\nexec {cmd}"
        else:
            assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
            body = (f"cd {shlex.quote(str(request.run_dir))}\nexec env -i {assigns} {shlex.quote(python)} "
                    + " ".join(shlex.quote(a) for a in agent_command(request, plan)))
        return f"#!/bin/bash\n{head}\n# serving-truth cell {system.name}/{layout.name}, run {request.run_dir.name}\n{body}\n"

    def _check_squashfs(self, request: RunRequest) -> None:
        for system, _ in request.cells:
            p = self.profile.placement(system.name)
            if p.container != "pyxis" or not p.squashfs:
                continue
            path = Path(p.squashfs)
            if not path.is_file():
                raise UsageError(f"squashfs {path} for {system.name} does not exist", hint=f"fix {self.profile.path}")
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != p.squashfs_sha256:
                from audit.errors import ImageDigestMismatch

                raise ImageDigestMismatch(ref=str(path), what="sha256 of the squashfs", expected=p.squashfs_sha256,
                                          found=h.hexdigest())

    def run(self, request: RunRequest, progress: Progress) -> RunResult:
        from audit.runtimes.local import LocalRuntime

        self.check(request.pin)
        if not shutil.which("sbatch"):
            raise EnvironmentBuildError("sbatch not found", step="slurm", hint="run on a Slurm submit host")
        self._check_squashfs(request)
        local = LocalRuntime(root=self.profile.env_root, with_cuda_toolkit=self.with_cuda_toolkit,
                             with_flashinfer_cubin=self.with_flashinfer_cubin)
        env_dir = local.ensure_env(request.pin, progress)
        observe = request.mode == "observe"
        stub = None
        if not observe:  # observe jobs run on GPU nodes with the real driver
            progress("stage", text="building the stub libcuda (cached)")
            # a copy inside the run directory: every job (and every container) sees the run directory
            (request.run_dir / "stub").mkdir(exist_ok=True)
            stub = request.run_dir / "stub" / "libcuda.so.1"
            shutil.copy2(local.ensure_stub(env_dir), stub)
        model_dir = write_model_dirs(request)
        stage_probes(request.run_dir)
        request.evidence_dir.mkdir(parents=True, exist_ok=True)
        if request.preflight is not None and not observe:  # on the submit host, in the same pinned environment
            progress("stage", text="checking every stand-in's fit to this release (before any job)")
            plan = write_plan(request, model_dir=str(model_dir), stub_libcuda=str(stub), out_dir=str(request.evidence_dir),
                              name="plan-fit.json", harness_env=local.harness_env())
            request.preflight(local.stand_in_fit(request, env_dir, stub, plan))
        jobs_dir = request.run_dir / "jobs"
        jobs_dir.mkdir(exist_ok=True)
        started = datetime.now(timezone.utc)
        jobs: dict[str, dict] = {}
        if self.wait:
            _beat(request.run_dir)
        progress("stage", text=f"submitting {len(request.cells)} Slurm job(s)")
        try:
            for system, layout in request.cells:
                cell = cell_dir_name(system.name, layout.name)
                one = dataclasses.replace(request, cells=[(system, layout)])
                (request.evidence_dir / cell).mkdir(parents=True, exist_ok=True)
                plan = write_plan(one, model_dir=str(model_dir), stub_libcuda=str(stub or ""),
                                  out_dir=str(request.evidence_dir), name=f"plan-{cell}.json",
                                  harness_env=local.harness_env())
                if self.profile.placement(system.name).container == "local":
                    env = local._env(env_dir, stub, request.run_dir, request.run_dir)
                    # a job reads the environment's bytecode but writes none: it may outlive the harness (--no-wait),
                    # and what it compiled from the run's probes copy would outlive the run
                    env["PYTHONDONTWRITEBYTECODE"] = "1"
                else:
                    env = container_env(request.run_dir, stub)
                if observe:  # the plugin in every process vLLM starts; evidence per cell
                    env.update(observe_env(str(request.evidence_dir / cell), cell, request.profile))
                if self.wait:  # a job whose harness died ends itself (probes.core.lifecycle)
                    env[WATCHDOG_ENV] = f"heartbeat:{heartbeat_stale_s():.0f}:{request.run_dir / HEARTBEAT_FILE}"
                log = jobs_dir / f"{cell}.log"
                script = jobs_dir / f"{cell}.sbatch"
                script.write_text(self.job_script(request, system, layout, plan=plan, log=log, env=env,
                                                  python=str(env_dir / "bin" / "python")),
                                  encoding="utf-8")
                r = _slurm(["sbatch", "--parsable", str(script)])
                entry = {"system": system.name, "layout": layout.name, "script": str(script), "log": str(log)}
                if r.returncode == 0 and r.stdout.strip():
                    entry["job_id"] = r.stdout.strip().split(";")[0]
                else:
                    entry["submit_error"] = (r.stderr or r.stdout).strip()[-2000:]
                jobs[cell] = entry
                self._save_jobs(request.run_dir, jobs)
            if not self.wait:
                return RunResult(evidence_dir=request.evidence_dir, missing={}, info=self._info(started, pending=True))
            self._wait(request, jobs, progress)
        except BaseException:
            cancel(jobs)
            raise
        return RunResult(evidence_dir=request.evidence_dir, missing=missing_cells(request.run_dir, jobs),
                         info=self._info(started))

    def _info(self, started, pending: bool = False) -> dict:
        info = {"runtime": f"slurm (profile {self.profile.name}: one job per cell)", "mode": "resolve",
                "date": started.strftime("%Y-%m-%d"), "slurm": {"profile": self.profile.path}}
        if pending:
            info["slurm"]["pending"] = True
        return info

    @staticmethod
    def _save_jobs(run_dir: Path, jobs: dict) -> None:
        tmp = run_dir / (JOBS_FILE + ".tmp")
        tmp.write_text(json.dumps(jobs, indent=1, sort_keys=True), encoding="utf-8")
        tmp.replace(run_dir / JOBS_FILE)

    def _wait(self, request: RunRequest, jobs: dict, progress: Progress) -> None:
        left = request.remaining()
        deadline = time.monotonic() + left if left is not None else None
        ids = {e["job_id"]: cell for cell, e in jobs.items() if "job_id" in e}
        for cell, e in jobs.items():
            if "job_id" not in e:
                progress("cell-done", system=e["system"], layout=e["layout"])
        done: set[str] = set()
        while len(done) < len(ids):
            _beat(request.run_dir)
            states = job_states(sorted(set(ids) - done))
            for job, st in states.items():
                if st["state"] in TERMINAL and job not in done:
                    done.add(job)
                    e = jobs[ids[job]]
                    e.update(state=st["state"], exit_code=st["exit_code"], reason=st["reason"])
                    progress("cell-done", system=e["system"], layout=e["layout"])
            self._save_jobs(request.run_dir, jobs)
            if len(done) < len(ids):
                if deadline and time.monotonic() > deadline:
                    cancel(jobs)
                    raise timed_out(request, where=f"{len(ids) - len(done)} Slurm job(s)", log_tail_text="",
                                    missing=missing_cells(request.run_dir, jobs), runtime="slurm")
                running = [f"{ids[j]}={s['state']}" for j, s in states.items() if j not in done]
                progress("stage", text=f"{len(done)}/{len(ids)} job(s) ended; " + ", ".join(running[:3]))
                time.sleep(POLL_S)


#: while the harness waits for its jobs it rewrites this file in the run directory; a job that sees it
#: unchanged for HEARTBEAT_STALE_S seconds (its own clock) ends itself
HEARTBEAT_FILE = "heartbeat"
HEARTBEAT_STALE_S = 60.0
_beats = [0]


def heartbeat_stale_s() -> float:
    """HEARTBEAT_STALE_S, or SERVING_TRUTH_HEARTBEAT_S (at least 5 s) where a test needs it shorter."""
    try:
        return max(5.0, float(os.environ["SERVING_TRUTH_HEARTBEAT_S"]))
    except (KeyError, ValueError):
        return HEARTBEAT_STALE_S


def _beat(run_dir: Path) -> None:
    _beats[0] += 1
    try:
        (run_dir / HEARTBEAT_FILE).write_text(f"{os.getpid()} {_beats[0]}\n", encoding="utf-8")
    except OSError:
        pass


def container_env(run_dir: Path, stub: Path | None) -> dict[str, str]:
    """The explicit environment of a pyxis job's container (caches on its own /tmp)."""
    env = {**agent_env(**CONTAINER_CACHES), "PYTHONPATH": str(run_dir)}
    if stub is not None:  # resolve mode; observe jobs use the node's driver
        env["LD_LIBRARY_PATH"] = str(stub.parent)
    return env


def cancel(jobs: dict) -> list[str]:
    """scancel exactly the jobs this run submitted (and that have not ended)."""
    ids = [e["job_id"] for e in jobs.values() if "job_id" in e and e.get("state") not in TERMINAL]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)
    return ids


def missing_cells(run_dir: Path, jobs: dict) -> dict[tuple[str, str], dict]:
    """Cells without evidence, each with its job's Slurm state and where its log is (relative to the run)."""
    out = {}
    for cell, e in jobs.items():
        d = run_dir / "evidence" / cell
        if any(d.glob("evidence-*.jsonl")):
            continue
        if "job_id" not in e:
            reason = f"sbatch refused the job: {e.get('submit_error', '?')}"
            log = ""
        else:
            # the job's id stays in jobs.json: the routing says the same of the same fault in every run
            why = ended_line(d)
            reason = (f"its Slurm job (jobs.json names it) ended {e.get('state', 'in an unknown state')}"
                      + (f" (exit {e['exit_code']})" if e.get("exit_code") else "")
                      + (f", reason {e['reason']}" if e.get("reason") not in (None, "", "None") else "")
                      + " without writing evidence"
                      + (f" ({why})" if why else ""))
            job_log = Path(e["log"])
            written = job_log.is_file() and job_log.stat().st_size > 0  # Slurm creates it when the job starts
            log = (run_relative(run_dir, job_log) if written else "") or run_relative(run_dir, d / "agent.log")
        out[(e["system"], e["layout"])] = {"reason": reason, "log": log}
    return out


def refresh(run_dir: Path) -> dict[tuple[str, str], dict]:
    """For rendering a --no-wait run: the jobs' final states, or JobsPending while any still runs."""
    jobs = json.loads((run_dir / JOBS_FILE).read_text(encoding="utf-8"))
    ids = {e["job_id"]: cell for cell, e in jobs.items() if "job_id" in e}
    states = job_states(sorted(ids))
    pending = {j: s["state"] for j, s in states.items() if s["state"] not in TERMINAL}
    if pending:
        raise JobsPending(str(run_dir), pending)
    for job, st in states.items():
        jobs[ids[job]].update(state=st["state"], exit_code=st["exit_code"], reason=st["reason"])
    SlurmRuntime._save_jobs(run_dir, jobs)
    return missing_cells(run_dir, jobs)


__all__ = ["SlurmRuntime", "JobsPending", "cancel", "enroot_uri", "job_states", "missing_cells", "pyxis_srun_args",
           "refresh"]
