"""Resolve-mode agent: run vLLM's own selection code for one (system, layout) cell.

Runs inside the pinned environment (a venv holding the pinned wheel, or the pinned image) as::

    python -m probes.agent JOB.json

The job (written by the host) names the simulated system, the serving layout as ``vllm serve``
arguments, the model directory (a config.json, no weights), the stub libcuda and the evidence
directory. Each stage is recorded with its outcome, so the ledger can say how deep construction
went; a failing stage is evidence, not a crash of the harness.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback

from .recorder import Recorder

JOB_SCHEMA = 1

#: packages whose presence/version changes what vLLM selects (install, not GPU)
FINGERPRINT_PACKAGES = (
    "vllm", "torch", "triton", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
    "deep-gemm", "deep_gemm", "nvidia-cutlass-dsl", "humming-kernels", "triton-kernels", "tilelang",
    "quack-kernels", "tokenspeed-mla", "flash-kda", "flashkda", "transformers", "compressed-tensors",
    "cuda-python", "nvidia-cuda-nvcc", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "xgrammar",
)
FINGERPRINT_MODULES = ("deep_gemm", "flashinfer", "flash_kda", "flashkda", "triton_kernels", "humming",
                       "cutlass", "tilelang", "vllm.third_party.deep_gemm")
FINGERPRINT_TOOLS = ("nvcc", "ninja", "gcc", "c++", "cc")
FINGERPRINT_ENV_PREFIXES = ("VLLM_", "CUDA_", "TRITON_", "FLASHINFER_", "DG_", "TORCH_CUDA_ARCH")


class Stage(contextlib.AbstractContextManager):
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, et, ev, tb):
        seconds = round(time.perf_counter() - self.t0, 3)
        if ev is None:
            self.rec.emit("stage", stage=self.name, ok=True, seconds=seconds)
            return False
        where = traceback.extract_tb(tb)[-1] if tb else None
        self.rec.emit("stage", stage=self.name, ok=False, seconds=seconds,
                      error={"type": f"{et.__module__}:{et.__qualname__}", "message": str(ev)[:4000],
                             "where": f"{where.filename}:{where.lineno} in {where.name}" if where else "",
                             "traceback": traceback.format_exception(et, ev, tb)[-12:]})
        raise _StageFailed(self.name) from ev


class _StageFailed(Exception):
    pass


def fingerprint() -> dict:
    pkgs = {}
    for name in FINGERPRINT_PACKAGES:
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    modules = {}
    for mod in FINGERPRINT_MODULES:
        try:
            modules[mod] = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            modules[mod] = False
    tools = {t: bool(shutil.which(t)) for t in FINGERPRINT_TOOLS}
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(FINGERPRINT_ENV_PREFIXES)
           and k not in ("TRITON_LIBCUDA_PATH",)}
    return {"packages": pkgs, "modules": modules, "tools": tools, "env": env,
            "python": sys.version.split()[0], "executable_prefix": sys.prefix}


def availability() -> dict:
    """vLLM's own "is X available" answers (after vLLM is importable)."""
    out = {}
    probes = (
        ("deep_gemm", "vllm.utils.deep_gemm", "has_deep_gemm"),
        ("flashinfer", "vllm.utils.flashinfer", "has_flashinfer"),
        ("flashinfer_cutlass_fused_moe", "vllm.utils.flashinfer", "has_flashinfer_cutlass_fused_moe"),
        ("flashinfer_trtllm_fused_moe", "vllm.utils.flashinfer", "has_flashinfer_trtllm_fused_moe"),
        ("triton_kernels", "vllm.utils.import_utils", "has_triton_kernels"),
        ("torch.cuda.is_available", "torch.cuda", "is_available"),
    )
    for key, module, fn in probes:
        try:
            out[key] = bool(getattr(importlib.import_module(module), fn)())
        except Exception as exc:
            out[key] = f"unknown ({type(exc).__name__})"
    try:
        import torch

        out["torch.version.cuda"] = torch.version.cuda
    except Exception:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m probes.agent JOB.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        job = json.load(fh)
    if job.get("schema") != JOB_SCHEMA:
        print(f"job schema {job.get('schema')!r}, this agent reads {JOB_SCHEMA}", file=sys.stderr)
        return 2
    rec = Recorder(job["out_dir"], role="resolve-agent", meta={
        "cell": {"system": job["system"]["name"], "layout": job["layout"]["name"]},
        "mode": "resolve", "pin": job.get("pin", ""),
    })
    try:
        run(job, rec)
    except _StageFailed:
        pass
    finally:
        path = rec.flush()
    print(f"evidence: {path}")
    return 0


def run(job: dict, rec: Recorder) -> None:
    from . import resolve

    resolve.run(job, rec, Stage)


if __name__ == "__main__":
    sys.exit(main())
