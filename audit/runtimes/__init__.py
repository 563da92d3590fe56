"""Runtimes run the probe agent somewhere that holds the pinned vLLM and hand back evidence.

Every runtime takes a :class:`~audit.runtimes.base.RunRequest` and returns a
:class:`~audit.runtimes.base.RunResult`; the rest of the harness never knows where it ran.
"""
from __future__ import annotations

from .base import RunRequest, RunResult, Runtime


def get_runtime(name: str, *, cuda_toolkit: bool = True) -> Runtime:
    from ..errors import SelectionError

    if name == "local":
        from .local import LocalRuntime

        return LocalRuntime(with_cuda_toolkit=cuda_toolkit)
    raise SelectionError("runtime", name, known=["local"])


__all__ = ["RunRequest", "RunResult", "Runtime", "get_runtime"]
