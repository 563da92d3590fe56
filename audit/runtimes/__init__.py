"""Runtimes run the probe agent somewhere that holds the pinned vLLM and hand back evidence.

Every runtime takes a :class:`~audit.runtimes.base.RunRequest` and returns a
:class:`~audit.runtimes.base.RunResult`; the rest of the harness never knows where it ran.
"""
from __future__ import annotations

from pathlib import Path

from audit.runtimes.base import RunRequest, RunResult, Runtime


RUNTIMES = ("local", "docker", "slurm")


def get_runtime(name: str, *, cuda_toolkit: bool = True, lock_dir: Path | None = None,
                pass_env: list[str] = (), cluster: str | None = None, wait: bool = True) -> Runtime:
    from audit.errors import SelectionError

    if name == "local":
        from audit.runtimes.local import LocalRuntime

        return LocalRuntime(with_cuda_toolkit=cuda_toolkit)
    if name == "docker":
        from audit.runtimes.docker import DockerRuntime

        return DockerRuntime(lock_dir=lock_dir, pass_env=list(pass_env))
    if name == "slurm":
        from audit.runtimes.cluster import default_profile_path, load
        from audit.runtimes.slurm import SlurmRuntime

        profile = load(cluster or default_profile_path(lock_dir or Path.cwd()))
        return SlurmRuntime(profile, wait=wait, with_cuda_toolkit=cuda_toolkit)
    raise SelectionError("runtime", name, known=list(RUNTIMES))


def refresh_missing(run_dir: Path, run_info: dict) -> dict | None:
    """For a run that was submitted and not waited for (slurm --no-wait): the cells that left no evidence,
    from the batch system's final job states (raises JobsPending while any job runs). None for runs whose
    runtime waited, which recorded their missing cells when they ended."""
    if run_info.get("slurm") and (Path(run_dir) / "jobs.json").exists():
        from audit.runtimes.slurm import refresh

        return refresh(Path(run_dir))
    return None


__all__ = ["RunRequest", "RunResult", "Runtime", "get_runtime", "refresh_missing"]
