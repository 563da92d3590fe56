"""What an image (or environment) holds, read without importing vLLM or torch.

    python -m probes.core.inventory [--engine PACKAGE] [--cuda-symbols]

Prints one JSON object: Python, the packages that decide the serving engine's kernel choices (the
engine's version and git sha, torch and its CUDA, FlashInfer, DeepGEMM external or vendored, CUTLASS
DSL, ...), the CUDA toolkit the image carries, the GPU and driver when one is visible, and with
``--cuda-symbols`` the CUDA driver functions its libraries import (the host builds the stub libcuda
from that list). ``--engine`` names the engine's import package (the host passes its engine contract's;
``vllm`` when absent). Versions come from package metadata and from reading the engine's
``_version.py`` and ``torch/version.py`` as text, so nothing heavy is imported and nothing
initialises CUDA. Standard library only.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import site
import subprocess
import sys
import sysconfig

#: distributions reported by name when installed (absent ones are listed as absent)
PACKAGES = ("vllm", "torch", "triton", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
            "deep-gemm", "nvidia-cutlass-dsl", "humming-kernels", "triton-kernels", "transformers",
            "nvidia-nccl-cu13", "nvidia-nccl-cu12", "cuda-python")


def _assignments(path: str) -> dict:
    """Top-level ``name = <literal>`` assignments of a Python file, without executing it."""
    out: dict = {}
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return out
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            value = node.value
            for t in node.targets:
                targets += [t] if isinstance(t, ast.Name) else [e for e in getattr(t, "elts", ()) if isinstance(e, ast.Name)]
            # chained: a = b = 'x' comes as Assign(targets=[a, b])
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            try:
                out[t.id] = ast.literal_eval(value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                pass
    return out


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _engine(package: str) -> dict:
    """The engine's version and commit as its build wrote them into ``<package>/_version.py``, and whether it
    vendors DeepGEMM (``third_party/deep_gemm``)."""
    d = _package_dir(package)
    if d is None:
        return {"package": package, "installed": False}
    v = _assignments(os.path.join(d, "_version.py"))
    version = v.get("__version__") or v.get("version")
    if not version:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = None
    vendored = os.path.isdir(os.path.join(d, "third_party", "deep_gemm"))
    return {"package": package, "installed": True, "version": version,
            "commit": v.get("__commit_id__") or v.get("commit_id"), "path": d, "deep_gemm_vendored": vendored}


def _providers(module: str) -> list[str]:
    """The distributions that install the top-level import *module* (``deep_gemm`` ships as deep-gemm or under
    an engine's own name)."""
    try:
        return sorted(set(importlib.metadata.packages_distributions().get(module, [])))
    except Exception:  # noqa: BLE001 - a broken metadata entry must not end the inventory
        return []


def _torch() -> dict:
    d = _package_dir("torch")
    if d is None:
        return {"installed": False}
    v = _assignments(os.path.join(d, "version.py"))
    return {"installed": True, "version": v.get("__version__"), "cuda": v.get("cuda"),
            "git_version": v.get("git_version")}


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _toolkit() -> dict:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    nvcc = shutil.which("nvcc") or (os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None)
    if nvcc and not os.access(nvcc, os.X_OK):
        nvcc = None
    release = None
    if nvcc:
        text = _run([nvcc, "--version"]) or ""
        for line in text.splitlines():
            if "release" in line:
                release = line.strip()
    return {"CUDA_HOME": cuda_home, "nvcc": nvcc, "nvcc_release": release,
            "usr_local_cuda": os.path.isdir("/usr/local/cuda")}


def _gpus() -> dict:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {"nvidia_smi": False, "gpus": []}
    text = _run([smi, "--query-gpu=name,driver_version,compute_cap", "--format=csv,noheader"]) or ""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            gpus.append({"name": parts[0], "driver": parts[1], "compute_capability": parts[2]})
    return {"nvidia_smi": True, "gpus": gpus}


def _os_release() -> str:
    try:
        with open("/etc/os-release", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return ""


def site_dirs() -> list[str]:
    dirs = []
    for d in [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]:
        if os.path.isdir(d) and d not in dirs:
            dirs.append(d)
    return dirs


def inventory(cuda_symbols: bool = False, engine: str = "vllm") -> dict:
    dg = _providers("deep_gemm")
    out = {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "machine": platform.machine(),
        "os": _os_release(),
        "packages": _versions(),
        "engine": _engine(engine),
        "torch": _torch(),
        "deep_gemm_external": _package_dir("deep_gemm") is not None,
        "deep_gemm_from": {name: _version_of(name) for name in dg},
        "cuda_toolkit": _toolkit(),
        "gpu": _gpus(),
        "site_packages": site_dirs(),
    }
    if cuda_symbols:
        from probes.core.elfscan import needed_cuda_symbols

        out["cuda_symbols"] = sorted(needed_cuda_symbols(site_dirs()))
    return out


def _version_of(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    engine = "vllm"
    if "--engine" in argv:
        at = argv.index("--engine")
        if at + 1 >= len(argv) or not argv[at + 1].isidentifier():
            print("usage: python -m probes.core.inventory [--engine PACKAGE] [--cuda-symbols]", file=sys.stderr)
            return 2
        engine = argv[at + 1]
    print(json.dumps(inventory(cuda_symbols="--cuda-symbols" in argv, engine=engine), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
