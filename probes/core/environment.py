"""What in a process's install and environment can change vLLM's choices (the evidence's fingerprint),
and vLLM's own availability answers. Standard library only until ``availability`` asks vLLM."""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys

#: packages whose presence/version changes what vLLM selects (install, not GPU)
FINGERPRINT_PACKAGES = (
    "vllm", "torch", "triton", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
    "deep-gemm", "deep_gemm", "nvidia-cutlass-dsl", "humming-kernels", "triton-kernels", "tilelang",
    "quack-kernels", "tokenspeed-mla", "transformers", "compressed-tensors",
    "cuda-python", "nvidia-cuda-nvcc", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "xgrammar", "ninja",
)
#: modules whose presence changes what vLLM selects for any model (a model's own kernel packages are its probes
#: package's ``FINGERPRINT_PACKAGES`` / ``FINGERPRINT_MODULES``)
FINGERPRINT_MODULES = ("deep_gemm", "flashinfer", "triton_kernels", "humming", "cutlass", "tilelang",
                       "vllm.third_party.deep_gemm")
FINGERPRINT_TOOLS = ("nvcc", "ninja", "gcc", "c++", "cc")
FINGERPRINT_ENV_PREFIXES = ("VLLM_", "CUDA_", "TRITON_", "FLASHINFER_", "DG_", "TORCH_CUDA_ARCH", "PYTORCH_")
#: set by the harness itself; not part of the audited environment (a plan can add to this list)
_HARNESS_ENV = ("TRITON_LIBCUDA_PATH", "PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR",
                "VLLM_PLUGINS")
#: values never written into evidence, whatever the prefix
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"


def _module_present(dotted: str) -> bool:
    """Whether a module is installed, without importing it or its parents (no side effects)."""
    top, _, rest = dotted.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    parts = rest.split(".")
    for base in spec.submodule_search_locations or ():
        folder = os.path.join(base, *parts[:-1])
        if os.path.isdir(os.path.join(folder, parts[-1])) or os.path.exists(os.path.join(folder, parts[-1] + ".py")):
            return True
        if os.path.isdir(folder) and any(n.startswith(parts[-1] + ".") and n.endswith(".so") for n in os.listdir(folder)):
            return True
    return False


def fingerprint(plan: dict | None = None, *, packages: tuple = (), modules: tuple = (), shared: bool = True,
                env_prefixes: tuple = ()) -> dict:
    """What in this process's install and environment can change vLLM's choices: the shared packages and modules,
    and the audited model's own (*packages*, *modules*: its probes package's).

    Variables the harness set (``plan["harness_env"]``, e.g. CUDA_HOME in the local runtime, where it
    is stated in the provenance instead) are left out; values of variables the user passed through
    by name (``plan["redact_env"]``) and of anything that looks like a credential are redacted. ``shared=False``: only
    the caller's packages, modules and variable prefixes (another engine's probes: the shared lists are the first
    engine's).
    """
    plan = plan or {}
    harness = set(_HARNESS_ENV) | set(plan.get("harness_env", ()))
    redact = set(plan.get("redact_env", ()))
    pkgs = {}
    for name in dict.fromkeys((FINGERPRINT_PACKAGES if shared else ()) + tuple(packages)):
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    env = {}
    for k, v in sorted(os.environ.items()):
        if k.startswith((FINGERPRINT_ENV_PREFIXES if shared else ()) + tuple(env_prefixes)) and k not in harness:
            env[k] = REDACTED if k in redact or any(w in k.upper() for w in _SECRET_WORDS) else v
    return {
        "packages": pkgs,
        "modules": {mod: _module_present(mod) for mod in dict.fromkeys((FINGERPRINT_MODULES if shared else ())
                                                                        + tuple(modules))},
        "tools": {t: bool(shutil.which(t)) for t in FINGERPRINT_TOOLS},
        "env": env,
        "python": sys.version.split()[0],
    }


def availability() -> dict:
    """vLLM's own "is X available" answers, asked after the model was built."""
    out = {}
    checks = (
        ("deep_gemm", "vllm.utils.deep_gemm", "has_deep_gemm"),
        ("flashinfer", "vllm.utils.flashinfer", "has_flashinfer"),
        ("flashinfer_cutlass_fused_moe", "vllm.utils.flashinfer", "has_flashinfer_cutlass_fused_moe"),
        ("flashinfer_trtllm_fused_moe", "vllm.utils.flashinfer", "has_flashinfer_trtllm_fused_moe"),
        ("triton_kernels", "vllm.utils.import_utils", "has_triton_kernels"),
    )
    for key, module, fn in checks:
        try:
            out[key] = bool(getattr(importlib.import_module(module), fn)())
        except Exception as exc:
            out[key] = f"unknown ({type(exc).__name__})"
    # TRT-LLM attention needs NVIDIA's cubins: vLLM asks whether its artifactory answers (a network request,
    # cached) unless the flashinfer-cubin package is installed. The answer is read only if vLLM asked: the
    # probes never send a request of their own.
    try:
        fi = importlib.import_module("vllm.utils.flashinfer")
        if hasattr(fi, "has_flashinfer_cubin"):
            out["flashinfer_cubin"] = bool(fi.has_flashinfer_cubin())
        reach = getattr(fi, "has_nvidia_artifactory", None)
        if reach is not None:
            info = getattr(reach, "cache_info", None)
            out["nvidia_artifactory"] = bool(reach()) if info is not None and info().currsize else "not asked by vLLM"
    except Exception as exc:
        out["nvidia_artifactory"] = f"unknown ({type(exc).__name__})"
    for key, module, fn in PACKAGE_CHECKS:  # vLLM's own answer, where this release has the check
        if key in out:
            continue
        try:
            check = getattr(importlib.import_module(module), fn, None)
        except Exception:
            continue
        if check is not None:
            try:
                out[key] = bool(check())
            except Exception as exc:
                out[key] = f"unknown ({type(exc).__name__})"
    try:
        import torch

        out["torch.version.cuda"] = torch.version.cuda
    except Exception:
        pass
    out["why_not"] = why_unavailable(out)
    return out


#: vLLM's optional-package checks beyond those :func:`availability` always asks, each read where the release
#: has it: (answer key, vLLM module, function)
PACKAGE_CHECKS = (
    ("humming", "vllm.utils.import_utils", "has_humming"),
    ("deep_ep", "vllm.utils.import_utils", "has_deep_ep"),
    ("tilelang", "vllm.utils.import_utils", "has_tilelang"),
    ("cutedsl", "vllm.utils.import_utils", "has_cutedsl"),
    ("flashinfer_moe", "vllm.utils.flashinfer", "has_flashinfer_moe"),
    ("flashinfer_comm", "vllm.utils.flashinfer", "has_flashinfer_comm"),
)
#: the modules each answer is about, where vLLM's check is a trial import of one of them (a package vLLM also
#: vendors under vllm.third_party is tried there too, as vLLM's own check does)
ANSWER_MODULES = {"deep_gemm": ("deep_gemm", "vllm.third_party.deep_gemm"), "flashinfer": ("flashinfer",),
                  "triton_kernels": ("triton_kernels", "vllm.third_party.triton_kernels"), "humming": ("humming",),
                  "deep_ep": ("deep_ep",), "tilelang": ("tilelang",), "cutedsl": ("cutlass",)}


def why_unavailable(answers: dict) -> dict:
    """For each package vLLM answered "not available" although it is installed: why, from a plain import of it now
    (after the cell's stages; nothing vLLM decides reads it any more). An import that fails gives its error's
    first line; one whose traceback passes through the harness's own code is a harness fault (a stand-in or hook
    broke the package, and vLLM's check swallowed it). An import that works says so: vLLM's "no" then comes from
    something else its check reads (an environment variable, the device), or from an earlier failure."""
    import traceback

    from probes.core import fence

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the probes package
    out = {}
    for key, modules in sorted(ANSWER_MODULES.items()):
        present = [m for m in modules if _module_present(m)]
        if answers.get(key) is not False or not present:
            continue
        module = present[0]
        try:
            importlib.import_module(module)
        except Exception as exc:
            first = (str(exc).splitlines() or [""])[0][:300]
            frames = traceback.extract_tb(exc.__traceback__)
            ours = [f for f in frames if os.path.abspath(f.filename).startswith(here + os.sep)]
            out[key] = f"installed, but importing {module} raises {type(exc).__name__}: {first}"
            if ours:
                out[key] += f" (through the harness's own {os.path.relpath(ours[-1].filename, here)}: a harness fault)"
                fence.fault(f"availability of {module}", exc, where=f"{ours[-1].filename}:{ours[-1].lineno}")
        else:
            out[key] = (f"installed, and {module} imports in this process: vLLM's check answers no for a reason "
                        "other than the import (its other conditions), or its trial import failed earlier")
    return out
