"""Runtimes run the probe agent somewhere that holds the pinned vLLM and hand back evidence.

Every runtime takes a :class:`~audit.runtimes.base.RunRequest` and returns a
:class:`~audit.runtimes.base.RunResult`; the rest of the harness never knows where it ran.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from audit.runtimes.base import RunRequest, RunResult, Runtime


@dataclass(frozen=True)
class RuntimeOptions:
    """What a runtime is built with (each runtime reads the options that apply to it)."""
    #: local and slurm: put the environment's CUDA toolkit on PATH and CUDA_HOME, as on a serving host
    cuda_toolkit: bool = True
    #: local and slurm: the host has flashinfer-cubin (VLLM_HAS_FLASHINFER_CUBIN=1; audit/pins/hosts.py)
    flashinfer_cubin: bool = False
    #: docker and slurm: the directory of images.lock (test images and the cluster profile are found from it)
    lock_dir: Path | None = None
    #: docker: host environment variables passed into the container
    pass_env: tuple[str, ...] = ()
    #: slurm: the cluster profile (default: the one beside images.lock)
    cluster: str | None = None
    #: slurm: wait for the jobs (False: submit and return; ``make audit`` collects them later)
    wait: bool = True


def _local(o: RuntimeOptions) -> Runtime:
    from audit.runtimes.local import LocalRuntime

    return LocalRuntime(with_cuda_toolkit=o.cuda_toolkit, with_flashinfer_cubin=o.flashinfer_cubin)


def _docker(o: RuntimeOptions) -> Runtime:
    from audit.runtimes.docker import DockerRuntime

    return DockerRuntime(lock_dir=o.lock_dir, pass_env=list(o.pass_env))


def _slurm(o: RuntimeOptions) -> Runtime:
    from audit.runtimes.cluster import default_profile_path, load
    from audit.runtimes.slurm import SlurmRuntime

    profile = load(o.cluster or default_profile_path(o.lock_dir or Path.cwd()))
    return SlurmRuntime(profile, wait=o.wait, with_cuda_toolkit=o.cuda_toolkit,
                        with_flashinfer_cubin=o.flashinfer_cubin)


#: the runtimes by name, each built from :class:`RuntimeOptions`: the one list of them (``--runtime`` picks one; a new
#: runtime is a subclass of :class:`~audit.runtimes.base.Runtime` and a line here)
RUNTIMES: dict[str, Callable[[RuntimeOptions], Runtime]] = {"local": _local, "docker": _docker, "slurm": _slurm}


def get_runtime(name: str, options: RuntimeOptions = RuntimeOptions()) -> Runtime:
    """The runtime *name*, built with *options*; an unknown name is bad input naming the known ones."""
    from audit.errors import SelectionError

    if name not in RUNTIMES:
        raise SelectionError("runtime", name, known=list(RUNTIMES))
    return RUNTIMES[name](options)


def refresh_missing(run_dir: Path, run_info: dict) -> dict | None:
    """For a run that was submitted and not waited for (slurm --no-wait): the cells that left no evidence,
    from the batch system's final job states (raises JobsPending while any job runs). None for runs whose
    runtime waited, which recorded their missing cells when they ended."""
    if run_info.get("slurm") and (Path(run_dir) / "jobs.json").exists():
        from audit.runtimes.slurm import refresh

        return refresh(Path(run_dir))
    return None


__all__ = ["RUNTIMES", "RunRequest", "RunResult", "Runtime", "RuntimeOptions", "get_runtime", "refresh_missing"]
