"""The local runtime: the probe agent in a cached venv holding exactly the pinned engine wheel, no GPU needed.

The environment itself (built once per wheel sha256 and Python, verified against the wheel's own RECORD before
every use) is :mod:`audit.runtimes.environment`'s. The agent runs in a subprocess of that venv with a minimal,
explicit environment (no host variables leak in, host toolchains such as a CUDA toolkit on /usr/local are not
on PATH), in resolve mode; observe mode serves with the same environment.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

from probes.core.lifecycle import WATCHDOG_ENV

from audit.errors import EnvironmentBuildError, RuntimeUnsupportedError
from audit.fsutil import sha256_file
from audit.pins.lock import Pin
from audit.runtimes import cudastub
from audit.runtimes.base import (Progress, RunRequest, RunResult, RuntimeDefaults, ahead_imports, cell_dir_name, collect_missing,
                                 learn_imports, learn_shared_imports, learned_imports, log_tail, observe_env,
                                 report_finished, shared_imports, stage_probes, timed_out, write_model_dirs,
                                 write_plan)
from audit.runtimes.environment import ENV_MARKER, PinEnvironments, drop_run_bytecode, find_python

class LocalRuntime(PinEnvironments, RuntimeDefaults):
    """Runs the probe agent in the pinned environment :class:`PinEnvironments` builds and verifies."""

    name = "local"

    # -- pins ----------------------------------------------------------------------------------
    def check(self, pin: Pin) -> None:
        if not pin.has_wheel:
            raise RuntimeUnsupportedError(
                pin.name, runtime=self.name, supported=[r for r in pin.runtimes if r != self.name],
                reason="it pins an image and no wheel; to audit it locally, add its wheel to the pin "
                       "(wheel, wheel_sha256, wheel_url: `serving-truth lock add NAME --commit SHA` writes them)")

    def cache_identity(self, pin: Pin, progress: Progress) -> dict:
        """What identifies this runtime's environment for the evidence cache (audit.evidence.cache): the verified
        environment built from the pinned wheel, the stub libcuda and the toolkit choice."""
        env = self.ensure_env(pin, progress)
        stub = self.ensure_stub(env)
        marker = json.loads((env / ENV_MARKER).read_text())
        return {"runtime": self.name, "wheel_sha256": pin.wheel_sha256, "env": marker,
                "stub_sha256": sha256_file(stub), "cuda_toolkit": self.toolkit_note(env),
                "flashinfer_cubin": self.with_flashinfer_cubin, "harness_env": self.harness_env()}

    # -- run -----------------------------------------------------------------------------------
    def bind(self, request: RunRequest) -> None:
        """The run about to be prepared: its deadline (``--timeout`` from the audit's start) bounds building the
        environment, wherever that happens first (the evidence cache's lookup builds it before the run)."""
        self._request = request

    def run(self, request: RunRequest, progress: Progress) -> RunResult:
        self.check(request.pin)
        self.bind(request)
        if request.mode == "observe":
            return self._run_observe(request, progress)
        with self.using(self.env_dir(request.pin)):  # `envs --prune` refuses it while the audit uses it
            env = self.ensure_env(request.pin, progress)
            return self._run_resolve(request, progress, env)

    def _run_resolve(self, request: RunRequest, progress: Progress, env: Path) -> RunResult:
        progress("stage", text="building the stub libcuda (cached)")
        stub = self.ensure_stub(env)
        model_dir = write_model_dirs(request)
        stage_probes(request.run_dir)
        request.evidence_dir.mkdir(parents=True, exist_ok=True)
        caches = self.root / "runtime-cache" / env.name
        plan = write_plan(request, model_dir=str(model_dir), stub_libcuda=str(stub),
                          out_dir=str(request.evidence_dir), learned=learned_imports(caches),
                          shared=shared_imports(caches), ahead=ahead_imports(caches),
                          harness_env=self.harness_env(),  # chosen by this runtime, stated in the provenance
                          memo_dir=os.environ.get("SERVING_TRUTH_MEMO") or str(caches / "memo"))
        if request.preflight is not None:
            progress("stage", text="checking every stand-in's fit to this release (before any cell)")
            request.preflight(self.stand_in_fit(request, env, stub, plan))
        log = request.run_dir / "agent.log"
        started = datetime.now(timezone.utc)
        engine = request.pin.engine_contract
        progress("stage", text=f"resolving {len(request.cells)} cells with {engine.title} {request.pin.version}")
        with open(log, "wb") as fh:
            proc = subprocess.Popen([str(env / "bin" / "python"), "-m", engine.resolve_agent, str(plan)],
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                    env={**self._env(env, stub, request.run_dir, request.run_dir), **LIFELINE},
                                    cwd=str(request.run_dir), start_new_session=True)
            try:
                self._wait(proc, request, progress)
            except BaseException:
                _kill(proc)
                raise
            finally:
                # a process the agent started and did not wait for (a spawn-context child re-imports the agent's
                # module from the run's probes copy) must not write that copy's bytecode after it is dropped
                _end_group(proc)
                drop_run_bytecode(caches, request.run_dir)
        learn_imports(caches, request.evidence_dir)
        learn_shared_imports(caches, request.evidence_dir)
        missing = collect_missing(request, fallback_log=log)
        if len(missing) == len(request.cells):
            from audit.errors import ProbeRunError

            raise ProbeRunError("the agent produced no evidence for any cell", cell="all",
                                returncode=proc.returncode, log_tail=log_tail(log))
        py = json.loads((env / ENV_MARKER).read_text())
        return RunResult(evidence_dir=request.evidence_dir, missing=missing, info={
            "runtime": f"local venv ({env.name})", "python": py.get("python"),
            "mode": "resolve", "date": started.strftime("%Y-%m-%d"), "cuda_toolkit": self.toolkit_note(env),
            "env_verified": self.verified[str(env)]["text"], "device_code": self.device_code(env, request.pin.engine_contract.device_code_packages),
        })

    def fit_cache(self, env: Path) -> Path:
        """Where the fit check's answers for *env* are kept (beside its other runtime caches)."""
        return self.root / "runtime-cache" / env.name / "fit"

    def stand_in_fit(self, request: RunRequest, env: Path, stub: Path, plan: Path) -> dict:
        """Every stand-in's fit to the environment's release ({stand-in: fit}), from probes/resolve/fitcheck.py run
        in the environment as the agent runs (no cell built). Cached beside the environment's runtime caches,
        keyed by what decides the answer: the verified environment, the probes' sources, the model's probes and
        schemes, the host arrangement, and any module the run directory itself puts on the path."""
        from audit.evidence.cache import probes_digest

        p = json.loads(plan.read_text(encoding="utf-8"))
        extra = sorted((f.name, sha256_file(f)) for f in request.run_dir.glob("*.py"))
        key = hashlib.sha256(json.dumps({
            "fitcheck": 1, "env": env.name, "probes": probes_digest(), "model_probes": p.get("model_probes", ""),
            "schemes": p.get("schemes", []), "harness_env": self.harness_env(),
            "cuda_toolkit": self.with_cuda_toolkit, "run_dir_modules": extra}, sort_keys=True).encode()).hexdigest()
        cached = self.fit_cache(env) / f"{key[:32]}.json"
        try:
            return dict(json.loads(cached.read_text(encoding="utf-8"))["fit"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        out = request.run_dir / "stand-in-fit.json"
        log = request.run_dir / "stand-in-fit.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen([str(env / "bin" / "python"), "-m", request.pin.engine_contract.fit_agent, str(plan),
                                     str(out)],
                                    stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                    env={**self._env(env, stub, request.run_dir, request.run_dir), **LIFELINE},
                                    cwd=str(request.run_dir), start_new_session=True)
            try:
                proc.wait(timeout=request.remaining())
            except subprocess.TimeoutExpired:
                _kill(proc)
                raise timed_out(request, where="the stand-in fit check (before any cell)",
                                log_tail_text=log_tail(log), missing={}, runtime=f"local venv ({request.pin.name})")
            except BaseException:
                _kill(proc)
                raise
            finally:
                _end_group(proc)
        try:
            answer = json.loads(out.read_text(encoding="utf-8"))
            fit = answer["fit"]
            if proc.returncode != 0 or not isinstance(fit, dict):
                raise ValueError(proc.returncode)
        except (OSError, ValueError, KeyError, TypeError):
            from audit.errors import ProbeRunError

            raise ProbeRunError("the stand-in fit check (probes/resolve/fitcheck.py) ended without its answer",
                                cell="before any cell", returncode=proc.returncode, log_tail=log_tail(log))
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(answer, sort_keys=True), encoding="utf-8")
        os.replace(tmp, cached)
        return dict(fit)

    def _run_observe(self, request: RunRequest, progress: Progress) -> RunResult:
        """Serve each cell's slice with vLLM's real engine on this host's GPUs (one cell at a time)."""
        if not cudastub.real_driver_present():
            raise EnvironmentBuildError("observe mode needs NVIDIA GPUs and their driver; none found here",
                                        step="observe", hint="resolve mode (the default) needs no GPU")
        if not request.pin.engine_contract.observe_agent:
            raise EnvironmentBuildError(f"observe mode is not built for {request.pin.engine_contract.title} yet",
                                        step="observe", hint="audit this pin in resolve mode (the default)")
        env = self.ensure_env(request.pin, progress)
        write_model_dirs(request)
        stage_probes(request.run_dir)
        request.evidence_dir.mkdir(parents=True, exist_ok=True)
        plan = write_plan(request, model_dir=str(request.run_dir / "model"), stub_libcuda="",
                          out_dir=str(request.evidence_dir), harness_env=self.harness_env())
        started = datetime.now(timezone.utc)
        for i, (system, layout) in enumerate(request.cells):
            cell = cell_dir_name(system.name, layout.name)
            out = request.evidence_dir / cell
            out.mkdir(parents=True, exist_ok=True)
            run_env = {**self._env(env, None, request.run_dir, request.run_dir), **observe_env(str(out), cell, request.profile)}
            if os.environ.get("CUDA_VISIBLE_DEVICES"):
                run_env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
            progress("stage", text=f"serving {system.name}/{layout.name} on this host's GPUs")
            with open(out / "agent.log", "wb") as fh:
                proc = subprocess.Popen([str(env / "bin" / "python"), "-m", "probes.observe.agent", str(plan), str(i)],
                                        stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                        env={**run_env, **LIFELINE}, cwd=str(request.run_dir),
                                        start_new_session=True)
                try:
                    proc.wait(timeout=request.remaining())
                except subprocess.TimeoutExpired:
                    _kill(proc)
                    raise timed_out(request, where=f"observe {cell}", log_tail_text=log_tail(out / "agent.log"),
                                    missing=collect_missing(request), runtime="local")
                except BaseException:
                    _kill(proc)
                    raise
            progress("cell-done", system=system.name, layout=layout.name)
        py = json.loads((env / ENV_MARKER).read_text())
        return RunResult(evidence_dir=request.evidence_dir, missing=collect_missing(request), info={
            "runtime": f"local venv ({env.name}) on this host's GPUs", "python": py.get("python"), "mode": "observe",
            "date": started.strftime("%Y-%m-%d"), "cuda_toolkit": self.toolkit_note(env),
            "slice": request.slice, "env_verified": self.verified[str(env)]["text"]})

    def _wait(self, proc: subprocess.Popen, request: RunRequest, progress: Progress) -> None:
        left = request.remaining()
        deadline = time.monotonic() + left if left is not None else None
        reported: set[tuple[str, str]] = set()
        while True:
            rc = proc.poll()
            report_finished(request, reported, progress)
            if rc is not None:
                return
            if deadline and time.monotonic() > deadline:
                _kill(proc)
                log = request.run_dir / "agent.log"
                raise timed_out(request, where="the probe agent", log_tail_text=log_tail(log),
                                missing=collect_missing(request, fallback_log=log),
                                runtime=f"local venv ({request.pin.name})")
            time.sleep(0.5)


#: the agent's standard input stays open as its lifeline: when this process dies, the agent's whole
#: process group ends (probes.core.lifecycle), so no SM or cell process outlives the harness
LIFELINE = {WATCHDOG_ENV: "stdin"}


def _end_group(proc: subprocess.Popen, grace_s: float = 2.0) -> None:
    """After the agent exited: SIGKILL whatever is left of its process group (the agent leads its own session)
    and wait, briefly, until none is left."""
    import signal

    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:  # zombies a non-reaping init keeps: they write nothing
            return
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    """Stop the agent and every process it forked (they share its session)."""
    import signal

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


__all__ = ["ENV_MARKER", "LocalRuntime", "find_python"]
