"""Pinned environments: a venv per pinned wheel, built once under the cache root, verified before every use.

A venv holds exactly the pinned engine wheel (its bytes checked against images.lock) and the CUDA build of torch;
it is keyed by the wheel's sha256 and the Python version, so two pins of the same wheel share one. Before each
use, every file the wheel installed is checked against the sha256s in the wheel's own RECORD, startup hooks
outside the installed distributions' RECORDs are refused, and the interpreter must be the venv's own. The local
runtime runs the agent in such an environment (and the Slurm runtime ships one to its nodes); what an agent
process sees of it (PATH, the CUDA toolkit the environment's wheels ship, caches) is decided here too.
"""
from __future__ import annotations

import contextlib

import base64
import csv
import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from audit.errors import DownloadHashMismatch, EnvironmentBuildError, EnvironmentInUse, EnvironmentModified, \
    UnsafeLockPath, WheelHashMismatch
from audit.fsutil import DirLock, cache_root, load_memo, memo_hash, save_memo, sha256_file, write_atomic
from audit.pins.fetch import download
from audit.pins.lock import Pin, contained, unsafe_path_field
from audit.pins.wheelcache import WheelCache
from audit.runtimes import cudastub
from audit.runtimes.base import Progress, RunRequest, agent_env, collect_missing, timed_out

ENV_MARKER = ".serving-truth-env.json"
#: the only PATH entries the agent sees besides the venv: the OS, not the host's toolchains
SYSTEM_PATH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def find_python(version: str) -> str:
    """An interpreter for ``3.X``: on PATH, or under pyenv; errors name what was tried."""
    tried = []
    candidates = [shutil.which(f"python{version}")]
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"), reverse=True)
    candidates += [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for c in candidates:
        if not c or not os.path.exists(c):
            continue
        tried.append(c)
        try:
            out = subprocess.run([c, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return c
    raise EnvironmentBuildError(
        f"no working Python {version} found (tried: {', '.join(tried) or 'nothing on PATH or under pyenv'})",
        step="find python", hint=f"install Python {version} (e.g. `pyenv install {version}`) or put python{version} on PATH",
    )


#: the resolutions shipped for the pinned releases' wheels (named by the first 16 hex digits of the wheel's sha256)
ENV_LOCKS = Path(__file__).resolve().parent.parent / "data" / "envlocks"


def resolution_text(report: dict, wheel: str, sha256: str, package: str = "vllm") -> str:
    """A resolution file from pip's installation report: a comment naming the wheel, then ``name==version`` for
    every package but the engine's own (*package*, installed from the wheel), sorted."""
    pins = sorted({f"{i['metadata']['name'].lower()}=={i['metadata']['version']}" for i in report.get("install", ())
                   if i["metadata"]["name"].lower() != package})
    return (f"# the packages {wheel} (sha256 {sha256}) is installed with: pip's resolution from PyPI\n"
            "# (serving-truth's environment builder; uv installs under these constraints)\n" + "\n".join(pins) + "\n")


def find_uv() -> str:
    """The uv that builds pin environments: the one installed beside this interpreter (``make setup`` pins it),
    else one on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("uv")
    if not found:
        raise EnvironmentBuildError("uv is not installed", step="find uv",
                                    hint="run `make setup` (it installs the pinned uv into .venv) or put uv on PATH")
    return found


class _AuditDeadline(Exception):
    """The audit's --timeout ran out while a step of building the environment ran (raised as RunTimedOut)."""

    def __init__(self, step: str, output: str):
        self.step, self.output = step, output


def _run(cmd: list[str], *, step: str, env: dict | None = None, timeout: float = 3600,
         remaining: float | None = None, stdin: str | None = None) -> str:
    """Run a build step; *remaining* is what is left of the audit's --timeout (the step is stopped there)."""
    limit = timeout if remaining is None else min(timeout, remaining)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit, input=stdin)
    except subprocess.TimeoutExpired as exc:
        if remaining is not None and limit < timeout:
            raise _AuditDeadline(step, str(exc.stdout or "")[-3000:]) from None
        raise EnvironmentBuildError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}", step=step,
                                    log_tail=str(exc.stdout or "")[-3000:]) from None
    except OSError as exc:
        raise EnvironmentBuildError(f"cannot run {cmd[0]}: {exc}", step=step) from None
    if out.returncode != 0:
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-30:])
        raise EnvironmentBuildError(f"failed (exit {out.returncode}): {' '.join(cmd)}", step=step, log_tail=tail)
    return out.stdout


class PinEnvironments:
    """The environments under one cache root, built from pinned wheels and verified before use."""

    def __init__(self, root: Path | None = None, *, with_cuda_toolkit: bool = True, with_flashinfer_cubin: bool = False):
        self.root = root or cache_root()
        self.with_cuda_toolkit = with_cuda_toolkit
        #: the host has flashinfer-cubin installed (audit/pins/hosts.py): vLLM's own VLLM_HAS_FLASHINFER_CUBIN=1 says so
        self.with_flashinfer_cubin = with_flashinfer_cubin
        #: str(env) -> summary of its last :meth:`verify_env` in this process
        self.verified: dict[str, dict] = {}
        #: the verified wheels this cache holds
        self.wheels = WheelCache(self.root)
        #: the run being prepared (its deadline bounds building the environment); None outside a run
        self._request: RunRequest | None = None

    @property
    def stat_memo(self) -> bool:
        """Re-read only files whose stat changed since they were last hashed (False: hash every file, as
        ``--no-cache`` asks); the wheel cache follows it."""
        return self.wheels.stat_memo

    @stat_memo.setter
    def stat_memo(self, value: bool) -> None:
        self.wheels.stat_memo = value

    @staticmethod
    def cuda_toolkit(env: Path) -> Path | None:
        """The CUDA toolkit directory of the nvcc that the environment's NVIDIA wheels ship, if any."""
        for nvcc in sorted(env.glob("lib/python*/site-packages/nvidia/*/bin/nvcc")):
            if os.access(nvcc, os.X_OK):
                return nvcc.parent.parent
        return None

    @staticmethod
    def device_code(env: Path, packages: tuple[str, ...] = ("vllm",)) -> dict:
        """The GPU code the environment's engine ships, per library (read from each shared object's fatbins:
        probes/core/elfscan.py): ``{path under site-packages: {"sass": [...], "ptx": [...]}}``; a library that ships
        none is listed with ``None`` (DeepGEMM compiles its kernels at run time; it is listed with the SM majors its
        host code admits). A fact of the wheel, the same for every host."""
        from probes.core.elfscan import deep_gemm_sm_majors, device_code

        site = next(env.glob("lib/python*/site-packages"), None)
        if site is None:
            return {}
        out: dict = {}
        for so in sorted(so for package in packages for so in (site / package).rglob("*.so")):
            code = device_code(so)
            rel = str(so.relative_to(site))
            if code is not None and (code["sass"] or code["ptx"]):
                out[rel] = code
            elif "deep_gemm" in so.parts:  # one entry for the package (a build per CPython in some releases)
                out.setdefault(str(so.parent.relative_to(site)) + "/_C*.so", {
                    "sass": [], "ptx": [], "jit": True, "sm_majors": deep_gemm_sm_majors(so.parent)})
        return out

    def harness_env(self) -> list[str]:
        """The variables this runtime sets for the host it arranges (stated in the provenance)."""
        return ["CUDA_HOME"] + (["VLLM_HAS_FLASHINFER_CUBIN"] if self.with_flashinfer_cubin else [])

    def toolkit_note(self, env: Path) -> str:
        if not self.with_cuda_toolkit:
            return "none (audited as a host without a CUDA toolkit: CUDA_HOME points at an empty directory)"
        toolkit = self.cuda_toolkit(env)
        if toolkit is None:
            return "none: the environment's wheels ship no nvcc (CUDA_HOME points at an empty directory)"
        rel = toolkit.relative_to(next(env.glob("lib/python*/site-packages")))
        return (f"nvcc shipped in the environment ({rel}), on PATH and as CUDA_HOME, as on a serving host "
                "with a CUDA toolkit; the host's own toolkit is never used")

    def env_dir(self, pin: Pin) -> Path:
        bad = unsafe_path_field(pin)
        if bad:
            raise UnsafeLockPath(pin=pin.name, field=bad[0], value=bad[1], root=str(self.root))
        tag = "cp" + pin.python.replace(".", "")
        envs = self.root / "envs"
        engine = pin.engine_contract
        return contained(envs / f"{engine.package}-{pin.version}-{tag}-{pin.wheel_sha256[:12]}", envs, pin,
                         engine.version_key, pin.version)

    # -- environment ---------------------------------------------------------------------------
    def wheel_path(self, pin: Pin, progress: Progress) -> Path:
        found = self.wheels.find(pin)
        if found:
            return found
        if pin.wheel_url:
            progress("stage", text=f"downloading {pin.wheel_url}")
            dest = self.wheels.locations(pin)[1]
            try:
                download(pin.wheel_url, dest, expected_sha256=pin.wheel_sha256, expected_source="images.lock")
            except DownloadHashMismatch as exc:
                raise WheelHashMismatch(wheel=pin.wheel_url, expected=pin.wheel_sha256, found=exc.found) from None
            return dest
        wheels = self.root / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        path = self.wheels.locations(pin)[0]
        progress("stage", text=f"downloading {pin.wheel}")
        python = find_python(pin.python)
        tmp = wheels / f".download-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _run([python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                  f"{pin.engine_contract.package}=={pin.version}", "-d", str(tmp)], step="download wheel")
            got = tmp / pin.wheel
            if not got.exists():
                names = ", ".join(p.name for p in tmp.iterdir()) or "nothing"
                raise EnvironmentBuildError(
                    f"pip downloaded {names}, not the pinned {pin.wheel}", step="download wheel",
                    hint="the pinned wheel is for another platform/Python; check images.lock")
            found = sha256_file(got)
            if found != pin.wheel_sha256:
                raise WheelHashMismatch(wheel=pin.wheel, expected=pin.wheel_sha256, found=found)
            os.replace(got, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return path

    def ensure_env(self, pin: Pin, progress: Progress) -> Path:
        """Build (once) the venv holding the pinned wheel; verify it carries a CUDA torch. Every call checks
        the installed engine against the wheel's RECORD (:meth:`verify_env`) and refuses an edited one. A disk
        error on the way is the environment's (exit 3), never mistaken for a report that could not be written."""
        try:
            return self._ensure_env(pin, progress)
        except _AuditDeadline as exc:
            request = self._request
            raise timed_out(request, where=f"building the {pin.engine_contract.title} {pin.version} environment "
                                           f"({exc.step})",
                            log_tail_text=exc.output, missing=collect_missing(request),
                            runtime=f"local venv ({pin.name})") from None
        except OSError as exc:
            where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
            raise EnvironmentBuildError(f"{exc.strerror or exc}{where}", step="build or verify the environment",
                                        hint="free disk space or fix the permissions of the cache "
                                             "(SERVING_TRUTH_CACHE moves it), then audit again") from None

    def _ready(self, env: Path, pin: Pin, progress: Progress) -> bool:
        """Whether *env* is a finished build of *pin*'s wheel and resolution (its marker is written last, so a
        build that died is never taken for one); verified against the wheel's RECORD once per runtime."""
        marker = env / ENV_MARKER
        if not marker.is_file():
            return False
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError):
            info = {}
        lock = self.resolution_file(pin)
        if info.get("wheel_sha256") != pin.wheel_sha256 or (lock is not None and info.get("resolution") != sha256_file(lock)):
            return False
        if self.verified.get(str(env), {}).get("sha256") != pin.wheel_sha256:  # once per runtime (audit)
            self.verify_env(env, pin, self.wheel_path(pin, progress), progress)
        self.touch_used(env)
        return True

    def touch_used(self, env: Path) -> None:
        """Record that an audit used *env* now (``serving-truth envs`` lists it; kept beside the environments, never
        inside one, so the RECORD check sees nothing new)."""
        stamp = env.parent / ".used" / env.name
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()

    def list_envs(self, pins: list[Pin]) -> dict:
        """Every environment under the cache (``envs``): its name, the pins of *pins* it serves, its size (the
        bytes only it holds, and the bytes it shares with other environments or uv's cache through hard links),
        when an audit last used it, and whether it is a finished build (a build that died has no marker); and
        ``unique_bytes``, what all of them take on disk together (each hard-linked file once)."""
        envs = self.root / "envs"
        if not envs.is_dir():
            return {"envs": [], "unique_bytes": 0}
        seen: set[tuple[int, int]] = set()
        unique = 0
        by_dir: dict[str, list[str]] = {}
        for pin in pins:
            try:
                by_dir.setdefault(self.env_dir(pin).name, []).append(pin.name)
            except Exception:  # a pin this cache cannot hold (an unsafe field): it has no environment here
                continue
        out = []
        for env in sorted(p for p in envs.iterdir() if p.is_dir() and not p.name.startswith(".")):
            own = shared = 0
            for dirpath, _dirs, files in os.walk(env):
                for f in files:
                    try:
                        st = os.lstat(os.path.join(dirpath, f))
                    except OSError:
                        continue
                    if st.st_nlink > 1:
                        shared += st.st_size
                    else:
                        own += st.st_size
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        unique += st.st_size
            stamp = envs / ".used" / env.name
            used = stamp.stat().st_mtime if stamp.exists() else None
            out.append({"name": env.name, "path": str(env), "pins": sorted(by_dir.get(env.name, [])),
                        "own_bytes": own, "shared_bytes": shared, "last_used": used,
                        "finished": (env / ENV_MARKER).is_file()})
        return {"envs": out, "unique_bytes": unique}

    @contextlib.contextmanager
    def using(self, env: Path):
        """Hold *env* in use (a shared lock on ``<cache>/envs/.in-use/<name>``) while an audit's agent runs in it:
        ``envs --prune`` refuses an environment in use instead of deleting it under the audit."""
        import fcntl

        marker = self.root / "envs" / ".in-use" / env.name
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield env
        finally:
            os.close(fd)  # closing releases the lock

    def remove_env(self, name: str) -> None:
        """Remove one environment (a direct child of ``<cache>/envs``) under its build lock; one an audit is using
        (:meth:`using`) is refused (:class:`EnvironmentInUse`), never pulled from under it."""
        import fcntl

        envs = self.root / "envs"
        env = envs / name
        if env.parent != envs or not env.is_dir() or env.is_symlink() or name.startswith("."):
            raise ValueError(f"{name!r} is not an environment under {envs}")
        marker = envs / ".in-use" / name
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise EnvironmentInUse(name=name, path=str(env)) from None
            self._remove(env, name)
        finally:
            os.close(fd)

    def _remove(self, env: Path, name: str) -> None:
        envs = env.parent
        with DirLock(env):
            shutil.rmtree(env)
            # what only this environment's agents used: its bytecode, memos and learned imports
            shutil.rmtree(self.root / "runtime-cache" / name, ignore_errors=True)
        (envs / ".used" / name).unlink(missing_ok=True)

    def _ensure_env(self, pin: Pin, progress: Progress) -> Path:
        env = self.env_dir(pin)  # validated: a direct child of <cache>/envs, not a symbolic link
        if self._ready(env, pin, progress):
            return env
        # one build per environment: a second audit that needs it waits for the first, then uses what it built
        env.parent.mkdir(parents=True, exist_ok=True)
        waiting = lambda: progress("stage", text=f"waiting for another audit building the {pin.engine_contract.title} {pin.version} "  # noqa: E731
                                                 f"environment ({env.name})")
        with DirLock(env, on_wait=waiting):
            if self._ready(env, pin, progress):
                return env
            return self._build_env(env, pin, progress)

    def _build_env(self, env: Path, pin: Pin, progress: Progress) -> Path:
        marker = env / ENV_MARKER
        wheel = self.wheel_path(pin, progress)
        python = find_python(pin.python)
        engine = pin.engine_contract
        progress("stage", text=f"building the {engine.title} {pin.version} environment (once; several minutes)")
        if env.exists():
            shutil.rmtree(env)  # only ever <cache>/envs/<name>: env_dir refuses anything else
        env.parent.mkdir(parents=True, exist_ok=True)
        left = self._request.remaining if self._request is not None else (lambda: None)
        _run([python, "-m", "venv", str(env)], step="create venv", remaining=left())
        py = str(env / "bin" / "python")
        resolution = self.resolution(pin, wheel, py, progress, left)
        _run([find_uv(), "pip", "install", "--no-config", "--python", py, "--constraint",
              str(resolution), *self._override_args(pin, env), str(wheel)],
             step=f"uv pip install {engine.package} wheel", env=self._uv_env(), timeout=5400, remaining=left())
        probe = _run([py, "-c", engine.env_probe], step="check torch", env=self._env(env, None), remaining=left())
        info = json.loads(probe.strip().splitlines()[-1])
        if not info.get("cuda"):
            raise EnvironmentBuildError(
                f"torch {info.get('torch')} in {env} is a CPU build; {engine.title}'s compiled ops need the CUDA build",
                step="check torch", hint="a local find-links wheel shadowed PyPI's; remove it from pip's config and rebuild")
        if info.get("engine") != pin.version:
            raise EnvironmentBuildError(f"installed {engine.title} is {info.get('engine')}, pinned {pin.version}",
                                        step=f"check {engine.package}")
        self.verify_env(env, pin, wheel, progress)
        marker.write_text(json.dumps({"wheel_sha256": pin.wheel_sha256, "resolution": sha256_file(resolution),
                                      **info}, sort_keys=True))
        # one line per finished build, beside the environments: when, which, by which process
        with open(env.parent / ".builds.log", "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} built {env.name} (pin {pin.name}, "
                      f"pid {os.getpid()})\n")
        return env

    def _override_args(self, pin: Pin, env: Path) -> list[str]:
        """uv's ``--override`` for the requirements the pin declares in place of the wheel's own (images.lock's
        ``overrides``): written into the environment's folder, so the build states what it installed under."""
        if not pin.overrides:
            return []
        path = env / "overrides.txt"
        path.write_text("".join(f"{r}\n" for r in pin.overrides), encoding="utf-8")
        return ["--override", str(path)]

    def resolution_file(self, pin: Pin) -> Path | None:
        """The environment's resolution (every package ``name==version``) for *pin*'s wheel: shipped with the
        harness for the pinned releases (``audit/data/envlocks``), or written under the cache by an earlier build."""
        name = f"{pin.wheel_sha256[:16]}.txt"
        for folder in (ENV_LOCKS, self.root / "envlocks"):
            if (folder / name).is_file():
                return folder / name
        return None

    def resolution(self, pin: Pin, wheel: Path, py: str, progress: Progress, left) -> Path:
        """The resolution the environment is installed under. Where none exists yet, pip's resolver (what built
        every environment before uv did) resolves the wheel's dependencies once, without installing, from PyPI
        alone (no host pip configuration), and the answer is kept under the cache: later builds of the same wheel
        install exactly the same packages. uv resolves under these constraints, so its own resolver's preferences
        (it may pick another, equally valid, set) never change what an audit runs on."""
        found = self.resolution_file(pin)
        if found is not None:
            return found
        if pin.overrides:  # pip has no overrides: uv resolves, from PyPI's wheels alone, under the pin's
            return self._resolve_with_overrides(pin, wheel, py, progress, left)
        progress("stage", text=f"resolving {wheel.name}'s dependencies with pip (once per wheel)")
        report = Path(py).parent.parent / "pip-resolution.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
        _run([py, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--only-binary", ":all:",
              "--report", str(report), str(wheel)], step="resolve dependencies (pip)", env=env, remaining=left())
        text = resolution_text(json.loads(report.read_text(encoding="utf-8")), wheel.name, pin.wheel_sha256,
                               pin.engine_contract.package)
        report.unlink(missing_ok=True)
        dest = self.root / "envlocks" / f"{pin.wheel_sha256[:16]}.txt"
        write_atomic(dest, text)
        return dest

    def _resolve_with_overrides(self, pin: Pin, wheel: Path, py: str, progress: Progress, left) -> Path:
        """The resolution of a wheel one of whose declared requirements cannot be installed from PyPI (the pin's
        ``overrides`` replace it): uv's resolver, binary wheels only, from PyPI alone, once; kept under the cache
        like pip's, with a comment naming the overrides."""
        progress("stage", text=f"resolving {wheel.name}'s dependencies with uv under the pin's overrides (once per wheel)")
        env_dir = Path(py).parent.parent
        out = env_dir / "uv-resolution.txt"
        _run([find_uv(), "pip", "compile", "--no-config", "--only-binary", ":all:", "--python", py, "--no-header",
              "--no-annotate", "--no-emit-package", pin.engine_contract.package, *self._override_args(pin, env_dir),
              "-o", str(out), "-"], step="resolve dependencies (uv, with overrides)", env=self._uv_env(),
             remaining=left(), stdin=f"{wheel}\n")
        pins = sorted(line.strip().lower() for line in out.read_text(encoding="utf-8").splitlines()
                      if line.strip() and not line.startswith("#"))
        text = (f"# the packages {wheel.name} (sha256 {pin.wheel_sha256}) is installed with: uv's resolution from PyPI\n"
                f"# under the pin's overrides ({', '.join(pin.overrides)}: {pin.overrides_why})\n"
                "# (serving-truth's environment builder; uv installs under these constraints)\n" + "\n".join(pins) + "\n")
        out.unlink(missing_ok=True)
        dest = self.root / "envlocks" / f"{pin.wheel_sha256[:16]}.txt"
        write_atomic(dest, text)
        return dest

    def _uv_env(self) -> dict:
        """uv's process environment: the host's (certificates, proxies), with its package cache under the audit
        cache (files are hard-linked from there into every environment: one copy of torch on disk however many
        pins) and no index or configuration from the host's uv or pip settings."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
        env.update(UV_CACHE_DIR=str(self.root / "uv-cache"), UV_LINK_MODE="hardlink", UV_COMPILE_BYTECODE="0",
                   UV_NO_PROGRESS="1")
        return env

    def verify_env(self, env: Path, pin: Pin, wheel: Path, progress: Progress) -> dict:
        """Check the environment against the wheel (whose bytes :meth:`wheel_path` checked against the pin):
        every file the wheel's RECORD lists is installed with that sha256; every startup hook in
        site-packages (``*.pth``, ``sitecustomize``/``usercustomize``) is listed in some installed
        distribution's RECORD; the interpreter is the venv's own. Raises :class:`EnvironmentModified`;
        returns a summary, also kept in ``self.verified[env]`` for the run's provenance."""
        progress("stage", text=f"verifying the installed {pin.engine_contract.title} against {wheel.name}'s RECORD")
        site = self.site_packages(env)
        memo_path = self.root / "runtime-cache" / env.name / "record-hashes.json"
        memo = load_memo(memo_path) if self.stat_memo else None
        checked, skipped, modified, missing = record_check(wheel, site, env, memo)
        if memo is not None and not (modified or missing):
            save_memo(memo_path, memo)
        unexpected = _startup_hooks_outside_records(site)
        if not (modified or missing or unexpected):  # only then run its interpreter (site.py reads the .pth files)
            problem = _interpreter_problem(env, pin.python)
            if problem:
                modified.append(problem)
        if modified or missing or unexpected:
            raise EnvironmentModified(env=str(env), wheel=wheel.name, modified=modified, missing=missing,
                                      unexpected=unexpected, uv_cache=str(self.root / "uv-cache"))
        summary = {"files": checked, "skipped": skipped, "wheel": wheel.name, "sha256": pin.wheel_sha256,
                   "text": f"verified before the audit: the {checked} files {pin.wheel} installs match the sha256s "
                           "in its own RECORD" + (f" ({skipped} rewritten at install time not compared)" if skipped else "")
                           + "; no startup hook outside the installed distributions' RECORDs"}
        self.verified[str(env)] = summary
        return summary

    def site_packages(self, env: Path) -> Path:
        found = sorted(env.glob("lib/python*/site-packages"))
        if not found:
            raise EnvironmentBuildError(f"no site-packages under {env}", step="inspect venv")
        return found[0]

    def ensure_stub(self, env: Path) -> Path:
        if cudastub.real_driver_present():
            raise EnvironmentBuildError(
                "a real NVIDIA driver is present: resolve mode refuses to stand in for it",
                step="stub libcuda", hint="on a GPU host, audit with --mode observe")
        site = self.site_packages(env)
        # the driver symbols the environment's libraries import: scanning every shared object takes
        # seconds, so the answer is kept per environment, keyed by what changes when packages are added,
        # removed or rebuilt (the marker written at build time and site-packages' own change time)
        st = site.stat()
        key = hashlib.sha256(((env / ENV_MARKER).read_bytes() if (env / ENV_MARKER).is_file() else b"")
                             + f"{site}|{st.st_mtime_ns}|{st.st_ctime_ns}".encode()).hexdigest()
        memo = self.root / "runtime-cache" / env.name / "cuda-symbols.json"
        try:
            saved = json.loads(memo.read_text(encoding="utf-8"))
            symbols = saved["symbols"] if saved.get("key") == key else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            symbols = None
        if symbols is None:
            symbols = sorted(cudastub.needed_cuda_symbols([site]))
            try:
                write_atomic(memo, json.dumps({"key": key, "symbols": symbols}))
            except OSError:
                pass
        return cudastub.build_stub_for(symbols, self.root / "stubs")

    def _env(self, env: Path, stub: Path | None, pythonpath: Path | None = None,
             run_dir: Path | None = None) -> dict:
        """The agent's whole environment: explicit, minimal, reproducible."""
        caches = self.root / "runtime-cache" / env.name
        out = {
            "PATH": os.pathsep.join([str(env / "bin"), *SYSTEM_PATH]),
            "LANG": "C.UTF-8",
            # vLLM's own caches hold derived state (model info, compile artefacts): per run
            **agent_env(home=str(caches / "home"), vllm_cache=str((run_dir or caches) / "vllm-cache"),
                        triton_cache=str(caches / "triton"), xdg_cache=str(caches / "xdg")),
        }
        # Bytecode: written, but never into the environment (its files stay exactly the wheel's RECORD): under
        # this environment's runtime cache, mirroring the source paths. Python checks each .pyc against its
        # source's mtime and size, so an edited file is compiled again, never served stale. Measured on a 2-core
        # machine: importing torch + vLLM 0.33's config and MoE layers takes 19.3 s compiling from source and
        # 9.5 s from this cache (README: "Bytecode").
        del out["PYTHONDONTWRITEBYTECODE"]
        out["PYTHONPYCACHEPREFIX"] = str(bytecode_dir(caches))
        # vLLM's "is FlashInfer usable" check looks for nvcc under CUDA_HOME, PATH or /usr/local/cuda
        # (0.33) or on PATH (older releases): never let the host's toolkit decide. Either the nvcc the
        # environment's own wheels ship (on PATH and as CUDA_HOME), or none.
        toolkit = self.cuda_toolkit(env) if self.with_cuda_toolkit else None
        out["CUDA_HOME"] = str(toolkit) if toolkit else str(self.root / "no-cuda-toolkit")
        if toolkit:
            out["PATH"] = os.pathsep.join([str(env / "bin"), str(toolkit / "bin"), *SYSTEM_PATH])
        if self.with_flashinfer_cubin and stub is not None:
            # resolve mode (a stub driver): the declared host's cubin package, as vLLM's has_flashinfer_cubin()
            # reads it; observe mode serves on a real host as it is, so nothing is claimed for it
            out["VLLM_HAS_FLASHINFER_CUBIN"] = "1"
        if stub is not None:
            out["LD_LIBRARY_PATH"] = str(stub.parent)
        if pythonpath is not None:
            out["PYTHONPATH"] = str(pythonpath)
        if run_dir is not None:  # temporary files live and die with the run, never in the host's /tmp
            (run_dir / "tmp").mkdir(parents=True, exist_ok=True)
            out["TMPDIR"] = str(run_dir / "tmp")
        return out

def bytecode_dir(caches: Path) -> Path:
    """Where an environment's agents write bytecode (``PYTHONPYCACHEPREFIX``): beside its other runtime caches."""
    return caches / "pycache"


def drop_run_bytecode(caches: Path, run_dir: Path) -> None:
    """Remove the bytecode compiled from one run's own copy of the probes (it lives and dies with the run):
    the prefix mirrors absolute source paths, so that is the run directory's subtree under the prefix."""
    mirror = bytecode_dir(caches) / Path(os.path.abspath(run_dir)).relative_to("/")
    shutil.rmtree(mirror, ignore_errors=True)


def _record_hash(path: Path) -> str:
    """The RECORD-style hash of *path* (``sha256=`` and unpadded urlsafe base64)."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def record_check(wheel: Path, site: Path, env: Path, memo: dict | None = None) -> tuple[int, int, list[str], list[str]]:
    """Compare what *wheel* installs with its RECORD: (files checked, files skipped, modified, missing).

    Files go to site-packages, ``<dist>.data/{purelib,platlib}/`` likewise and ``.data/data/`` to the
    environment's root; ``.data/scripts`` and ``.data/headers`` are rewritten or relocated by the installer and
    are skipped (counted). The RECORD read is the one inside the wheel, never the installed copy."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            record_name = next((n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n)), None)
            if record_name is None:
                raise EnvironmentBuildError(f"{wheel.name} has no .dist-info/RECORD", step="verify environment")
            rows = list(csv.reader(io.StringIO(zf.read(record_name).decode("utf-8"))))
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as exc:
        raise EnvironmentBuildError(f"cannot read the RECORD of {wheel.name}: {exc}", step="verify environment") from None
    checked = skipped = 0
    modified: list[str] = []
    missing: list[str] = []
    for row in rows:
        if len(row) < 2 or not row[1]:
            continue  # RECORD itself, and signature files, carry no hash
        rel, digest = row[0], row[1]
        parts = rel.split("/")
        if rel.startswith("/") or ".." in parts or "\\" in rel:
            raise EnvironmentBuildError(f"{wheel.name}'s RECORD names {rel!r}, outside site-packages",
                                        step="verify environment")
        if not digest.startswith("sha256="):
            raise EnvironmentBuildError(f"{wheel.name}'s RECORD hashes {rel} with {digest.split('=')[0]}, not sha256",
                                        step="verify environment")
        target = site / rel
        if len(parts) > 2 and parts[0].endswith(".data"):
            scheme = parts[1]
            if scheme in ("purelib", "platlib"):
                target = site.joinpath(*parts[2:])
            elif scheme == "data":
                target = env.joinpath(*parts[2:])
            else:
                skipped += 1
                continue
        if not target.is_file() or target.is_symlink():
            missing.append(rel)
            continue
        checked += 1
        if memo_hash(target, memo, _record_hash) != digest:
            modified.append(rel)
    return checked, skipped, modified, missing


def _startup_hooks_outside_records(site: Path) -> list[str]:
    """``*.pth`` files and site/user customize modules that no installed distribution's RECORD lists:
    Python runs them at every start."""
    recorded: set[str] = set()
    for rec in site.glob("*.dist-info/RECORD"):
        try:
            recorded.update(row[0] for row in csv.reader(io.StringIO(rec.read_text(encoding="utf-8"))) if row)
        except (OSError, UnicodeDecodeError):
            continue
    hooks = [p.name for p in site.iterdir() if p.suffix == ".pth"
             or p.name in ("sitecustomize.py", "usercustomize.py", "sitecustomize", "usercustomize")]
    return sorted(h for h in hooks if h not in recorded)


def _interpreter_problem(env: Path, python: str) -> str:
    """"" when bin/python is the venv's own interpreter for *python*, else what is wrong with it."""
    cfg = env / "pyvenv.cfg"
    exe = env / "bin" / "python"
    try:
        text = cfg.read_text(encoding="utf-8")
    except OSError:
        return "pyvenv.cfg (missing: not a venv)"
    m = re.search(r"^version(?:_info)?\s*=\s*(\S+)", text, re.M)
    if not m or not (m.group(1) + ".").startswith(python + "."):
        return f"pyvenv.cfg (Python {m.group(1) if m else '?'}, the pin says {python})"
    if not exe.exists() or not os.access(exe, os.X_OK):
        return "bin/python (missing)"
    try:
        out = subprocess.run([str(exe), "-I", "-c", "import sys; print(sys.prefix); print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bin/python (does not run: {exc})"
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != env.resolve() or lines[1] != python:
        return f"bin/python (reports prefix/version {' '.join(lines) or out.stderr.strip()[-200:]!r})"
    return ""
