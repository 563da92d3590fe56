"""The docker runtime: the probe agent runs inside the pinned image, through the Docker SDK.

Image identity: only images named in images.lock by digest run. A registry pin is pulled by digest
(the per-platform manifest digest when the lock records one for the cells' architecture) and checked
against the engine's RepoDigests and the image's architecture; a pin by config digest (a locally
built image, or a ``docker save`` tarball moved to an air-gapped host) is checked against the image
ID, which Docker computes from the config, after loading the tarball if needed.

The container is hardened: no network, every capability dropped, no-new-privileges, read-only root
filesystem with tmpfs for caches, the run directory (probes, plan, model configs) mounted read-only
and only the evidence directory writable, run as the invoking user. Nothing from the host
environment enters it unless named (``pass_env``), and named values are redacted from evidence.
Every container is labelled; it is removed on success, failure, timeout and interrupt, and
containers left by a harness that died are swept at the next start (``serving-truth
clean-containers`` does it on demand).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from probes.core.lifecycle import WATCHDOG_ENV

from audit.runtimes import cudastub
from audit.errors import (DockerUnavailable, ImageDigestMismatch, ImageError, ProbeRunError, RunExited,
                      RuntimeUnsupportedError)
from audit.fsutil import cache_root
from audit.pins.lock import Pin
from audit.runtimes.base import (CONTAINER_CACHES, Progress, RunRequest, RunResult, RuntimeDefaults, agent_env, cell_dir_name,
                   collect_missing, log_tail, observe_env, report_finished, stage_probes, timed_out, write_model_dirs,
                   write_plan)

LABEL_MANAGED = "serving-truth.managed"
LABEL_RUN = "serving-truth.run"
LABEL_PIN = "serving-truth.pin"
LABEL_IMAGE = "serving-truth.image"
LABEL_OWNER = "serving-truth.owner"
LABEL_ROLE = "serving-truth.role"

#: where things are inside the container
RUN_MOUNT = "/serving-truth/run"
STUB_MOUNT = "/serving-truth/stub"
#: the agent's exit codes that mean "it finished" (1: some cell process failed, reported per cell)
FINISHED_CODES = (0, 1)
#: tmpfs mounts: the only writable places besides the evidence directory
TMPFS = {"/tmp": "rw,nosuid,nodev,size=2g,mode=1777"}
SHM_SIZE = "1g"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def _client():
    try:
        import docker
        import docker.errors
    except ImportError as exc:  # a dependency of this package; missing means a broken install
        raise DockerUnavailable(f"the docker Python package is missing ({exc})") from None
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as exc:
        raise DockerUnavailable(str(exc)) from None
    return client


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_alive(owner: str) -> bool:
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine's run: not ours to judge
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(client=None, *, everything: bool = False, run_id: str | None = None) -> list[str]:
    """Remove serving-truth containers whose harness process is gone (or all of them, or one run's).

    Returns the names of the removed containers."""
    client = client or _client()
    filters = {"label": [f"{LABEL_MANAGED}=1"] + ([f"{LABEL_RUN}={run_id}"] if run_id else [])}
    removed = []
    for c in client.containers.list(all=True, filters=filters):
        owner = c.labels.get(LABEL_OWNER, "")
        if everything or run_id or not _owner_alive(owner):
            try:
                c.remove(force=True)
                removed.append(c.name)
            except Exception:  # already gone
                pass
    return removed


class DockerRuntime(RuntimeDefaults):
    name = "docker"

    def __init__(self, root: Path | None = None, *, lock_dir: Path | None = None, pass_env: list[str] = (),
                 client=None):
        self.root = root or cache_root()
        self.lock_dir = lock_dir or Path.cwd()
        self.pass_env = list(pass_env)
        self._client_obj = client

    @property
    def client(self):
        if self._client_obj is None:
            self._client_obj = _client()
        return self._client_obj

    def check(self, pin: Pin) -> None:
        if not pin.has_image:
            if pin.image_tag:
                from audit.errors import UsageError

                raise UsageError(f"pin {pin.name!r} names the tag {pin.image_tag} but no digest; tags are never run",
                                 hint=f"run `serving-truth lock resolve {pin.name}` to pin it by digest")
            raise RuntimeUnsupportedError(
                pin.name, runtime=self.name, supported=[r for r in pin.runtimes if r != self.name],
                reason="images.lock pins no image for it (add image = \"repo@sha256:...\" or image_config_digest)")
        missing = [k for k in self.pass_env if k not in os.environ]
        if missing:
            from audit.errors import UsageError

            raise UsageError(f"--pass-env names variables that are not set: {', '.join(missing)}",
                             hint="set them, or drop them from --pass-env")

    # -- image ---------------------------------------------------------------------------------
    def host_arch(self) -> str:
        return _ARCH.get(self.client.info().get("Architecture", ""), "amd64")

    def ensure_image(self, pin: Pin, platform: str, progress: Progress):
        """Make the pinned image present and verified; return (image, facts for the provenance)."""
        import docker.errors

        ref = pin.image_for(platform)
        if pin.image:
            try:
                image = self.client.images.get(ref)
            except docker.errors.ImageNotFound:
                progress("stage", text=f"pulling {ref}")
                try:
                    image = self.client.images.pull(ref, platform=platform)
                except docker.errors.APIError as exc:
                    raise ImageError(f"cannot pull {ref}: {exc.explanation or exc}", ref=ref,
                                     hint="on an air-gapped host, `docker load` the image and pin it by "
                                          "image_config_digest (+ image_tarball)") from None
            repo_digests = image.attrs.get("RepoDigests") or []
            if ref not in repo_digests:
                raise ImageDigestMismatch(ref=ref, what="repo digest", expected=ref.split("@", 1)[1],
                                          found=", ".join(repo_digests) or "none recorded by the engine")
        else:
            image = self._image_by_config(pin, progress)
        if pin.image_config_digest and image.id != pin.image_config_digest:
            raise ImageDigestMismatch(ref=ref, what="config digest (image ID)", expected=pin.image_config_digest,
                                      found=image.id)
        arch = image.attrs.get("Architecture", "")
        want = platform.split("/", 1)[1]
        if _ARCH.get(arch, arch) != want:
            raise ImageError(f"{ref} is a linux/{arch} image, the cells need {platform}", ref=ref,
                             hint="pin the per-platform digest under platform_digests")
        checks = (["repo digest"] if pin.image else []) + \
            (["config digest (image ID)"] if pin.image_config_digest else []) + ["architecture"]
        facts = {
            "ref": ref,
            "id": image.id,
            "repo_digests": sorted(image.attrs.get("RepoDigests") or []),
            "platform": f"linux/{arch}",
            "verified": ", ".join(checks),
        }
        return image, facts

    def _image_by_config(self, pin: Pin, progress: Progress):
        import docker.errors

        digest = pin.image_config_digest
        try:
            return self.client.images.get(digest)
        except docker.errors.ImageNotFound:
            pass
        if not pin.image_tarball:
            raise ImageError(f"no image with ID {digest} in the engine", ref=digest,
                             hint="load it (`docker load -i FILE`) or record image_tarball in images.lock")
        tar = (self.lock_dir / pin.image_tarball).resolve()
        if not tar.is_file():
            raise ImageError(f"image_tarball {tar} does not exist", ref=digest,
                             hint="copy the `docker save` file there or fix the path (relative to images.lock)")
        progress("stage", text=f"loading {tar.name}")
        with open(tar, "rb") as fh:
            try:
                loaded = self.client.images.load(fh)
            except docker.errors.APIError as exc:
                raise ImageError(f"docker load {tar} failed: {exc.explanation or exc}", ref=digest) from None
        ids = sorted({i.id for i in loaded})
        if digest not in ids:
            raise ImageDigestMismatch(ref=str(tar), what="config digest of the loaded tarball", expected=digest,
                                      found=", ".join(ids) or "no image")
        return self.client.images.get(digest)

    # -- containers ----------------------------------------------------------------------------
    def _labels(self, request: RunRequest, ref: str, role: str) -> dict:
        return {LABEL_MANAGED: "1", LABEL_RUN: request.run_dir.name, LABEL_PIN: request.pin.name,
                LABEL_IMAGE: ref, LABEL_OWNER: owner_id(), LABEL_ROLE: role}

    def _environment(self, image, *, with_stub: bool) -> dict:
        image_env = dict(e.split("=", 1) for e in (image.attrs.get("Config") or {}).get("Env") or [] if "=" in e)
        env = {**agent_env(**CONTAINER_CACHES),
               "PYTHONPATH": ":".join(p for p in (RUN_MOUNT, image_env.get("PYTHONPATH", "")) if p)}
        if with_stub:
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (STUB_MOUNT, image_env.get("LD_LIBRARY_PATH", "")) if p)
        for name in self.pass_env:
            env[name] = os.environ[name]
        return env

    def _container_kwargs(self, request: RunRequest, image, ref: str, *, role: str, mounts: list,
                          with_stub: bool, lifeline: bool = False) -> dict:
        """``lifeline``: the container's standard input stays open while this process holds an attached
        socket (stdin once); when the harness dies the socket closes, the daemon closes the container's
        stdin, and the agent ends its process group (probes.core.lifecycle): no container outlives the harness."""
        environment = self._environment(image, with_stub=with_stub)
        extra = {}
        if lifeline:
            environment[WATCHDOG_ENV] = "stdin"
            extra = {"stdin_open": True}
        return dict(
            image=image.id,
            entrypoint=["python3"],
            labels=self._labels(request, ref, role),
            environment=environment,
            mounts=mounts,
            network_mode="none",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=True,
            tmpfs=dict(TMPFS),
            shm_size=SHM_SIZE,
            user=f"{os.getuid()}:{os.getgid()}",
            working_dir="/tmp",
            detach=not lifeline,  # created, not run: detach only decides whether stdin is closed after one attach
            **extra,
        )

    def _inventory(self, request: RunRequest, image, ref: str) -> dict:
        """Run ``probes.core.inventory`` in the image: what it holds and which driver symbols it imports."""
        from docker.types import Mount

        mounts = [Mount(RUN_MOUNT, str(request.run_dir), type="bind", read_only=True)]
        kw = self._container_kwargs(request, image, ref, role="inventory", mounts=mounts, with_stub=False)
        engine = request.pin.engine_contract
        container = self.client.containers.create(
            command=["-m", "probes.core.inventory", "--engine", engine.package, "--cuda-symbols"], **kw)
        try:
            container.start()
            status = container.wait(timeout=600)
            out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
            err = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
        finally:
            container.remove(force=True)
        code = status.get("StatusCode")
        if code != 0:
            raise ImageError(f"the inventory step exited with {code} inside {ref}", ref=ref,
                             hint="the image needs python3 on PATH (Python >= 3.10)",
                             log_tail="\n".join(err.splitlines()[-30:]))
        try:
            inv = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ImageError(f"the inventory step printed no JSON inside {ref}", ref=ref,
                             log_tail="\n".join((out + err).splitlines()[-30:])) from None
        held = inv.get("engine") or {}
        if not held.get("installed"):
            raise ImageError(f"{ref} holds no {engine.title} ({engine.package} is not importable in the image)",
                             ref=ref, hint=f"pin {request.pin.name} is pinned to {engine.title} {request.pin.version}: "
                                           f"its image must carry {engine.package} {request.pin.version}")
        if held.get("version") != request.pin.version:
            raise ImageError(f"{ref} holds {engine.title} {held.get('version')}, pin {request.pin.name} says "
                             f"{request.pin.version}", ref=ref,
                             hint="images.lock names another image for this pin, or the pin's version is wrong")
        return inv

    # -- run -----------------------------------------------------------------------------------
    def platform_for(self, request: RunRequest) -> tuple[str, str]:
        """The platform to run, and a note when some cells' architecture cannot run on this host."""
        host = self.host_arch()
        wanted = sorted({s.arch for s, _ in request.cells})
        note = ""
        if any(a != host for a in wanted):
            others = ", ".join(s.name for s, _ in request.cells if s.arch != host)
            note = (f"cells of {others} ({'/'.join(a for a in wanted if a != host)}) were resolved with the "
                    f"linux/{host} image: this host cannot run other architectures; the per-platform "
                    "digest of those systems was not exercised")
        return f"linux/{host}", note

    def run(self, request: RunRequest, progress: Progress) -> RunResult:
        from docker.types import Mount

        self.check(request.pin)
        swept = sweep(self.client)
        if swept:
            progress("stage", text=f"removed {len(swept)} container(s) left by a harness that died")
        platform, arch_note = self.platform_for(request)
        image, image_facts = self.ensure_image(request.pin, platform, progress)
        ref = image_facts["ref"]
        stage_probes(request.run_dir)
        progress("stage", text="inventory of the image")
        inv = self._inventory(request, image, ref)
        image_facts["verified"] += f", {request.pin.engine_contract.title} {request.pin.version} in the image"
        if request.mode == "observe":
            if not request.pin.engine_contract.observe_agent:  # core refuses first; never run another engine's
                raise RuntimeUnsupportedError(request.pin.name, runtime="docker", supported=[],
                                              reason=f"observe mode is not built for "
                                                     f"{request.pin.engine_contract.title}")
            return self._run_observe(request, progress, image, ref, image_facts, inv)
        if inv.get("gpu", {}).get("gpus"):
            raise ImageError("the container sees a GPU: resolve mode refuses to stand in for a real driver",
                             ref=ref)
        stub = cudastub.build_stub_for(inv.pop("cuda_symbols", []), self.root / "stubs")
        model_dir = write_model_dirs(request)
        request.evidence_dir.mkdir(parents=True, exist_ok=True)
        run_dir = request.run_dir

        def where(path) -> str:
            path = Path(path)
            if path == stub:
                return f"{STUB_MOUNT}/{stub.name}"
            return f"{RUN_MOUNT}/{path.relative_to(run_dir)}"

        plan = write_plan(request, model_dir=str(model_dir), stub_libcuda=str(stub),
                          out_dir=str(request.evidence_dir), where=where, redact_env=self.pass_env)
        mounts = [
            Mount(RUN_MOUNT, str(run_dir), type="bind", read_only=True),
            Mount(f"{RUN_MOUNT}/evidence", str(request.evidence_dir), type="bind", read_only=False),
            Mount(STUB_MOUNT, str(stub.parent), type="bind", read_only=True),
        ]
        kw = self._container_kwargs(request, image, ref, role="agent", mounts=mounts, with_stub=True, lifeline=True)
        started = datetime.now(timezone.utc)
        progress("stage", text=f"resolving {len(request.cells)} cells inside {ref[:60]}")
        container = self.client.containers.create(command=["-m", request.pin.engine_contract.resolve_agent,
                                                            where(plan)], **kw)
        log = run_dir / "agent.log"
        code = self._run_container(container, request, progress, log)
        missing = collect_missing(request, fallback_log=log)
        info = {
            "runtime": f"docker ({ref})", "python": inv.get("python", {}).get("version"), "mode": "resolve",
            "date": started.strftime("%Y-%m-%d"), "image": image_facts, "inventory": _inventory_summary(inv, request.pin),
            "cuda_toolkit": _toolkit_note(inv),
        }
        if arch_note:
            info["architecture_note"] = arch_note
        result = RunResult(evidence_dir=request.evidence_dir, missing=missing, info=info)
        if code not in FINISHED_CODES:
            state = container.attrs.get("State", {}) if hasattr(container, "attrs") else {}
            if code == -1:
                reason = "the container disappeared (removed from outside the harness)"
            else:
                reason = f"exit code {code}" + (" (OOM-killed)" if state.get("OOMKilled") else "") + \
                    (f" (killed by signal {code - 128})" if code > 128 else "")
            exc = RunExited(where=f"container {container.name}", returncode=code, reason=reason,
                            log_tail=log_tail(log))
            exc.partial = result
            raise exc
        if len(missing) == len(request.cells):
            raise ProbeRunError("the agent produced no evidence for any cell", cell="all", returncode=code,
                                log_tail=log_tail(log))
        return result

    def _run_observe(self, request: RunRequest, progress: Progress, image, ref: str, image_facts: dict,
                     inv: dict) -> RunResult:
        """Serve each cell in the image on this host's GPUs (device requests), one container per cell."""
        from docker.types import DeviceRequest, Mount

        write_model_dirs(request)
        request.evidence_dir.mkdir(parents=True, exist_ok=True)
        run_dir = request.run_dir

        def where(path) -> str:
            return f"{RUN_MOUNT}/{Path(path).relative_to(run_dir)}"

        plan = write_plan(request, model_dir=str(run_dir / "model"), stub_libcuda="", out_dir=str(request.evidence_dir),
                          where=where, redact_env=self.pass_env)
        started = datetime.now(timezone.utc)
        for i, (system, layout) in enumerate(request.cells):
            cell = cell_dir_name(system.name, layout.name)
            (request.evidence_dir / cell).mkdir(parents=True, exist_ok=True)
            mounts = [Mount(RUN_MOUNT, str(run_dir), type="bind", read_only=True),
                      Mount(f"{RUN_MOUNT}/evidence", str(request.evidence_dir), type="bind", read_only=False)]
            kw = self._container_kwargs(request, image, ref, role="observe", mounts=mounts, with_stub=False,
                                        lifeline=True)
            kw["environment"].update(observe_env(f"{RUN_MOUNT}/evidence/{cell}", cell, request.profile))
            kw.update(device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])], shm_size="16g",
                      ipc_mode="host")
            kw["tmpfs"] = {"/tmp": "rw,nosuid,nodev,size=64g,mode=1777"}
            progress("stage", text=f"serving {system.name}/{layout.name} inside {ref[:60]}")
            container = self.client.containers.create(command=["-m", request.pin.engine_contract.observe_agent,
                                                                        where(plan), str(i)], **kw)
            log = request.evidence_dir / cell / "agent.log"
            self._run_container(container, dataclasses.replace(request, cells=[(system, layout)]), progress, log)
        return RunResult(evidence_dir=request.evidence_dir, missing=collect_missing(request), info={
            "runtime": f"docker ({ref}) on this host's GPUs", "python": inv.get("python", {}).get("version"),
            "mode": "observe", "date": started.strftime("%Y-%m-%d"), "image": image_facts,
            "inventory": _inventory_summary(inv, request.pin), "cuda_toolkit": _toolkit_note(inv)})

    def _run_container(self, container, request: RunRequest, progress: Progress, log: Path) -> int:
        """Start, wait (progress, timeout), keep the log, and always remove the container."""
        lifeline = None
        try:
            if (container.attrs.get("Config") or {}).get("StdinOnce"):
                lifeline = container.attach_socket(params={"stdin": 1, "stream": 1})
            container.start()
            return self._wait(container, request, progress, log)
        finally:
            if lifeline is not None:
                _close_socket(lifeline)
            self._save_logs(container, log)
            try:
                container.remove(force=True)
            except Exception:  # already gone
                pass

    def _save_logs(self, container, log: Path) -> None:
        try:
            data = container.logs(stdout=True, stderr=True)
        except Exception:
            return
        log.write_bytes(data)

    def _wait(self, container, request: RunRequest, progress: Progress, log: Path) -> int:
        left = request.remaining()
        deadline = time.monotonic() + left if left is not None else None
        reported: set[tuple[str, str]] = set()
        import docker.errors

        while True:
            try:
                container.reload()
            except docker.errors.NotFound:  # removed from under us (docker rm -f)
                return -1
            report_finished(request, reported, progress)
            if container.status in ("exited", "dead"):
                return int(container.attrs.get("State", {}).get("ExitCode", -1))
            if deadline and time.monotonic() > deadline:
                self._save_logs(container, log)
                raise timed_out(request, where=f"container {container.name}", log_tail_text=log_tail(log),
                                missing=collect_missing(request, fallback_log=log),
                                runtime=f"docker ({container.image.id})")
            time.sleep(0.5)


def _close_socket(sock) -> None:
    for obj in (getattr(sock, "_sock", None), sock):
        try:
            if obj is not None:
                obj.close()
        except Exception:  # noqa: BLE001 - closing a lifeline that is already gone
            pass


def _inventory_summary(inv: dict, pin: Pin) -> dict:
    """The provenance facts (the site-packages paths and the raw GPU query stay in run.json only)."""
    pk = inv.get("packages", {})
    held = inv.get("engine", {})
    providers = inv.get("deep_gemm_from") or {}
    external = ", ".join(f"{name} {version or '(version unknown)'}" for name, version in sorted(providers.items())) \
        or pk.get("deep-gemm") or "(version unknown)"
    return {
        "python": inv.get("python", {}).get("version"),
        "os": inv.get("os"),
        "machine": inv.get("machine"),
        "engine": held.get("version"),
        "engine_commit": held.get("commit"),
        "torch": inv.get("torch", {}).get("version"),
        "torch_cuda": inv.get("torch", {}).get("cuda"),
        "flashinfer": pk.get("flashinfer-python"),
        "deep_gemm": ("external: " + external) if inv.get("deep_gemm_external")
        else (f"vendored in {pin.engine_contract.title}" if held.get("deep_gemm_vendored") else "absent"),
        "cutlass_dsl": pk.get("nvidia-cutlass-dsl"),
        "triton": pk.get("triton"),
        "gpus": inv.get("gpu", {}).get("gpus", []),
        "nvidia_smi": inv.get("gpu", {}).get("nvidia_smi", False),
    }


def _toolkit_note(inv: dict) -> str:
    tk = inv.get("cuda_toolkit", {})
    if tk.get("nvcc"):
        return f"the image's own: nvcc at {tk['nvcc']} ({tk.get('nvcc_release') or 'release unknown'}), " \
               f"CUDA_HOME={tk.get('CUDA_HOME') or 'unset'}"
    return "none in the image (no nvcc on PATH or under CUDA_HOME)"


__all__ = ["DockerRuntime", "sweep", "LABEL_MANAGED", "LABEL_RUN"]
