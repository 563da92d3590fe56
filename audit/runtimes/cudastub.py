"""Build a stub ``libcuda.so.1`` so vLLM's compiled extensions load on a host without an NVIDIA driver.

vLLM's ``vllm/*.abi3.so`` (and some libraries of its dependencies) name ``libcuda.so.1`` in their
``DT_NEEDED``; on a machine without the driver the dynamic loader refuses to load them. This module
generates, from source and at setup time, a stand-in that defines every ``cu*`` driver function the
installed libraries import. It launches nothing: ``cuInit`` answers CUDA_ERROR_NO_DEVICE, a few
query functions answer harmlessly, and everything else answers CUDA_ERROR_NOT_INITIALIZED.

The symbol collection parses ELF in pure Python (no ``nm``/``readelf``: foreign images may lack
binutils). Callers must refuse to use the stub when :func:`real_driver_present` is True.

Standard library only; never imports vllm or torch.

Usage::

    python -m audit.runtimes.cudastub SITE_PACKAGES... --out DIR
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from audit.errors import AuditError, StubBuildError, UsageError
from probes.core.elfscan import (  # noqa: F401 (re-exported)
    LIBCUDA_SONAME, _VERSION_SUFFIX, _ElfFile, _NotElf64, _read_dynamic_info, _strip_version, needed_cuda_symbols,
)

__all__ = [
    "ALWAYS_DEFINED",
    "STUB_MARKER",
    "build_stub",
    "build_stub_for",
    "main",
    "needed_cuda_symbols",
    "real_driver_present",
    "stub_source",
]

STUB_FILENAME = "libcuda.so.1"
#: exported (data) symbol by which a stub built here can be recognised without loading it
STUB_MARKER = "audit_cudastub_marker"

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_NOT_FOUND = 500
STUB_DRIVER_VERSION = 13000

#: functions with hand-written bodies; always present in the stub
ALWAYS_DEFINED = frozenset(
    {
        "cuInit",
        "cuDriverGetVersion",
        "cuGetErrorString",
        "cuGetErrorName",
        "cuGetProcAddress",
        "cuGetProcAddress_v2",
        "cuDeviceGetCount",
    }
)

_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

_COMPILE_TIMEOUT_S = 300
_LOG_TAIL_LINES = 40


# --------------------------------------------------------------------------------------------
# C source
# --------------------------------------------------------------------------------------------

_SOURCE_HEADER = """\
/* Generated stub libcuda.so.1 (audit.runtimes.cudastub): it launches nothing and drives no GPU. */
/* cuInit answers CUDA_ERROR_NO_DEVICE; unlisted functions answer CUDA_ERROR_NOT_INITIALIZED. */
/* Only for hosts without an NVIDIA driver: never use it where a real libcuda exists. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#define STUB_EXPORT __attribute__((visibility("default")))

STUB_EXPORT const char {marker}[] = "audit.runtimes.cudastub generated stub; launches nothing";

static void *stub_self(void)
{{
    static void *self;
    if (!self) {{
        Dl_info info;
        if (dladdr((void *)&stub_self, &info) && info.dli_fname)
            self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
        if (!self)
            self = RTLD_DEFAULT;
    }}
    return self;
}}

static void *stub_lookup(const char *symbol)
{{
    void *fn;
    char versioned[256];
    size_t len;
    if (!symbol || !symbol[0] || strncmp(symbol, "cu", 2) != 0)
        return NULL;
    fn = dlsym(stub_self(), symbol);
    if (fn)
        return fn;
    /* callers ask for the base name (cuMemAlloc); the ABI they mean may carry _v2 */
    len = strlen(symbol);
    if (len + 4 < sizeof versioned) {{
        memcpy(versioned, symbol, len);
        memcpy(versioned + len, "_v2", 4);
        fn = dlsym(stub_self(), versioned);
    }}
    return fn;
}}

static const char *stub_error_string(int error)
{{
    switch (error) {{
    case {ok}: return "no error";
    case {invalid}: return "invalid argument";
    case {not_init}: return "initialization error (stub libcuda: no driver, nothing runs)";
    case {no_device}: return "no CUDA-capable device is detected (stub libcuda)";
    case {not_found}: return "named symbol not found";
    default: return "unknown error (stub libcuda)";
    }}
}}

static const char *stub_error_name(int error)
{{
    switch (error) {{
    case {ok}: return "CUDA_SUCCESS";
    case {invalid}: return "CUDA_ERROR_INVALID_VALUE";
    case {not_init}: return "CUDA_ERROR_NOT_INITIALIZED";
    case {no_device}: return "CUDA_ERROR_NO_DEVICE";
    case {not_found}: return "CUDA_ERROR_NOT_FOUND";
    default: return "CUDA_ERROR_UNKNOWN";
    }}
}}
"""

_SPECIAL_BODIES = {
    "cuInit": """\
STUB_EXPORT int cuInit(unsigned int flags)
{{
    (void)flags;
    return {no_device};
}}
""",
    "cuDriverGetVersion": """\
STUB_EXPORT int cuDriverGetVersion(int *version)
{{
    if (!version)
        return {invalid};
    *version = {driver_version};
    return {ok};
}}
""",
    "cuDeviceGetCount": """\
STUB_EXPORT int cuDeviceGetCount(int *count)
{{
    if (!count)
        return {invalid};
    *count = 0;
    return {ok};
}}
""",
    "cuGetErrorString": """\
STUB_EXPORT int cuGetErrorString(int error, const char **text)
{{
    if (!text)
        return {invalid};
    *text = stub_error_string(error);
    return {ok};
}}
""",
    "cuGetErrorName": """\
STUB_EXPORT int cuGetErrorName(int error, const char **text)
{{
    if (!text)
        return {invalid};
    *text = stub_error_name(error);
    return {ok};
}}
""",
    "cuGetProcAddress": """\
STUB_EXPORT int cuGetProcAddress(const char *symbol, void **pfn, int cuda_version,
                                 unsigned long long flags)
{{
    void *fn;
    (void)cuda_version;
    (void)flags;
    if (!pfn)
        return {invalid};
    fn = stub_lookup(symbol);
    *pfn = fn;
    return fn ? {ok} : {not_found};
}}
""",
    "cuGetProcAddress_v2": """\
STUB_EXPORT int cuGetProcAddress_v2(const char *symbol, void **pfn, int cuda_version,
                                    unsigned long long flags, int *symbol_status)
{{
    void *fn;
    (void)cuda_version;
    (void)flags;
    if (!pfn)
        return {invalid};
    fn = stub_lookup(symbol);
    *pfn = fn;
    /* CU_GET_PROC_ADDRESS_SUCCESS = 0, CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1 */
    if (symbol_status)
        *symbol_status = fn ? 0 : 1;
    return fn ? {ok} : {not_found};
}}
""",
}
assert set(_SPECIAL_BODIES) == ALWAYS_DEFINED

# Generic stubs touch no argument, so the parameter list is irrelevant to the ABI (the caller
# owns its arguments on x86-64 and aarch64); (void) keeps every C standard from C89 to C23 quiet.
_GENERIC_BODY = "STUB_EXPORT int {name}(void) {{ return {not_init}; }}\n"

_CODES = dict(
    ok=CUDA_SUCCESS,
    invalid=CUDA_ERROR_INVALID_VALUE,
    not_init=CUDA_ERROR_NOT_INITIALIZED,
    no_device=CUDA_ERROR_NO_DEVICE,
    not_found=CUDA_ERROR_NOT_FOUND,
    driver_version=STUB_DRIVER_VERSION,
    marker=STUB_MARKER,
)


def stub_function_names(symbols: Iterable[str]) -> list[str]:
    """Sorted names the stub for *symbols* defines: the fixed set, the names, and ``_v2`` variants."""
    names = set(ALWAYS_DEFINED)
    for name in symbols:
        name = _strip_version(str(name))
        if not _C_IDENTIFIER.match(name):
            raise ValueError(f"not a C identifier, cannot stub: {name!r}")
        names.add(name)
        if name not in ALWAYS_DEFINED and not _VERSION_SUFFIX.search(name):
            names.add(name + "_v2")
    return sorted(names)


def stub_source(symbols: Iterable[str]) -> str:
    """Deterministic C source of a stub libcuda defining *symbols* (see :func:`stub_function_names`)."""
    parts = [_SOURCE_HEADER.format(**_CODES)]
    for name in stub_function_names(symbols):
        parts.append("\n")
        if name in _SPECIAL_BODIES:
            parts.append(_SPECIAL_BODIES[name].format(**_CODES))
        else:
            parts.append(_GENERIC_BODY.format(name=name, **_CODES))
    return "".join(parts)


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------

_BUILD_STEP = "build cuda stub"
_CC_HINT = "install a C compiler, e.g. `apt-get install -y gcc`"


def _tail(text: str, lines: int = _LOG_TAIL_LINES) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _resolve_compiler(cc: str) -> str:
    found = shutil.which(cc)
    if not found:
        raise StubBuildError(f"C compiler {cc!r} not found", step=_BUILD_STEP, hint=_CC_HINT)
    return found


def build_stub(roots: Iterable[Path], out_dir: Path, *, cc: str = "gcc") -> Path:
    """Build (or reuse) the stub for the libraries under *roots*; return the ``libcuda.so.1`` path.

    The library lands in ``out_dir/<sha256(source)[:16]>/libcuda.so.1``, written atomically, so
    an existing file for the same source is reused as is. Raises :class:`StubBuildError` when the
    compiler is missing or fails.
    """
    return build_stub_for(needed_cuda_symbols(roots), out_dir, cc=cc)


def build_stub_for(symbols: Iterable[str], out_dir: Path, *, cc: str = "gcc") -> Path:
    """Build (or reuse) the stub defining *symbols*, e.g. names scanned inside a container image."""
    symbols = set(symbols)
    source = stub_source(symbols)
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
    target_dir = Path(out_dir) / digest
    target = target_dir / STUB_FILENAME
    if target.is_file():
        return target

    compiler = _resolve_compiler(cc)
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        source_path = target_dir / "stub.c"
        _write_atomically(source_path, source.encode("utf-8"))
    except OSError as exc:
        raise StubBuildError(f"cannot write the stub source under {target_dir}: {exc}",
                             step=_BUILD_STEP) from exc

    fd, tmp_name = tempfile.mkstemp(dir=target_dir, prefix=f".{STUB_FILENAME}.", suffix=".tmp")
    os.close(fd)
    cmd = [compiler, "-shared", "-fPIC", "-O1", f"-Wl,-soname,{LIBCUDA_SONAME}",
           "-o", tmp_name, str(source_path), "-ldl"]
    try:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, errors="replace", timeout=_COMPILE_TIMEOUT_S, check=False)
        except FileNotFoundError as exc:
            raise StubBuildError(f"C compiler {cc!r} could not be run: {exc}", step=_BUILD_STEP,
                                 hint=_CC_HINT) from exc
        except subprocess.TimeoutExpired as exc:
            out = exc.output or ""
            if isinstance(out, bytes):
                out = out.decode("utf-8", "replace")
            raise StubBuildError(f"compiler timed out after {_COMPILE_TIMEOUT_S} s",
                                 step=_BUILD_STEP, log_tail=_tail(out)) from exc
        if proc.returncode != 0:
            raise StubBuildError(
                f"{' '.join(cmd)} failed with exit code {proc.returncode}",
                step=_BUILD_STEP, log_tail=_tail(proc.stdout or ""), hint=_CC_HINT,
            )
        _check_built(Path(tmp_name), symbols)
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, target)
    finally:
        _unlink_quietly(tmp_name)
    return target


def _check_built(path: Path, symbols: Iterable[str]) -> None:
    """The compiled file must be ELF64 and export every name the libraries need."""
    try:
        info = _read_dynamic_info(path)
    except (_NotElf64, OSError, struct.error, ValueError) as exc:
        raise StubBuildError(f"the compiler produced an unreadable library: {exc}",
                             step=_BUILD_STEP) from exc
    missing = sorted((set(symbols) | ALWAYS_DEFINED | {STUB_MARKER}) - info.defined)
    if missing:
        raise StubBuildError(
            f"the compiled stub does not export {len(missing)} expected name(s)",
            step=_BUILD_STEP, log_tail="\n".join(missing[:_LOG_TAIL_LINES]),
        )


# --------------------------------------------------------------------------------------------
# Real driver detection
# --------------------------------------------------------------------------------------------

_NVIDIACTL = Path("/dev/nvidiactl")
_LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
    "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64", "/lib",
    "/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/wsl/lib", "/usr/local/cuda/lib64",
)


def _is_stub_library(path: Path) -> bool:
    """True for a stub built here (marker symbol) or NVIDIA's link-time stub (``.../stubs/``)."""
    if "stubs" in Path(path).parts:
        return True
    try:
        return STUB_MARKER in _read_dynamic_info(path).defined
    except (_NotElf64, OSError, struct.error, ValueError):
        return False


def _ldconfig_paths(name: str) -> list[Path]:
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None)
    if not ldconfig:
        return []
    try:
        out = subprocess.run([ldconfig, "-p"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, errors="replace", timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    paths = []
    for line in out.splitlines():
        lib, sep, where = line.strip().partition(" => ")
        if sep and lib.split(" ", 1)[0] == name:
            paths.append(Path(where.strip()))
    return paths


def _candidate_paths(found: str) -> list[Path]:
    if os.path.isabs(found):
        return [Path(found)]
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    paths = [Path(d, found) for d in (*dirs, *_LIBRARY_DIRS)]
    paths += _ldconfig_paths(found)
    return [p for p in paths if p.is_file()]


def _loaded_real_libcuda() -> bool:
    """A libcuda already in this process that is not one of our stubs."""
    try:
        lib = ctypes.CDLL(LIBCUDA_SONAME, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    try:
        getattr(lib, STUB_MARKER)
    except AttributeError:
        return True
    return False


def real_driver_present() -> bool:
    """True when an NVIDIA driver seems present; callers must then refuse to use the stub.

    Signs: ``/dev/nvidiactl`` exists, a non-stub libcuda is already loaded, or
    ``ctypes.util.find_library('cuda')`` finds a libcuda that is neither a stub built here nor
    NVIDIA's link-time stub. When the found library cannot be located on disk, the answer is
    True (refusing the stub is the safe side).
    """
    if _NVIDIACTL.exists():
        return True
    if _loaded_real_libcuda():
        return True
    found = ctypes.util.find_library("cuda")
    if not found:
        return False
    candidates = _candidate_paths(found)
    if not candidates:
        return True
    return any(not _is_stub_library(p) for p in candidates)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m audit.runtimes.cudastub",
        description="Build a stub libcuda.so.1 (launches nothing) for the libraries under SITE_PACKAGES.",
    )
    parser.add_argument("roots", nargs="+", type=Path, metavar="SITE_PACKAGES")
    parser.add_argument("--out", required=True, type=Path, help="cache directory for built stubs")
    parser.add_argument("--cc", default="gcc", help="C compiler (default: gcc)")
    parser.add_argument("--allow-real-driver", action="store_true",
                        help="build even when a real NVIDIA driver seems present")
    args = parser.parse_args(argv)
    try:
        missing = [str(r) for r in args.roots if not r.exists()]
        if missing:
            raise UsageError("no such path: " + ", ".join(missing))
        if not args.allow_real_driver and real_driver_present():
            raise StubBuildError("a real NVIDIA driver is present; refusing to build a stub",
                                 step=_BUILD_STEP, hint="use the real driver instead")
        path = build_stub(args.roots, args.out, cc=args.cc)
    except AuditError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
