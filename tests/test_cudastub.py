"""Tests for audit.runtimes.cudastub: pure-Python ELF symbol collection and the generated stub libcuda."""
from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from audit.runtimes import cudastub
from audit.runtimes.cudastub import (
    ALWAYS_DEFINED,
    build_stub,
    needed_cuda_symbols,
    real_driver_present,
    stub_source,
)
from audit.errors import StubBuildError

GCC = shutil.which("gcc")
needs_gcc = pytest.mark.skipif(GCC is None, reason="gcc is not installed")

VLLM_ENV = Path("/root/.cache/serving-truth/envs/vllm-0.33.0-cp312-4b6bdec4ab26")
VLLM_SITE = VLLM_ENV / "lib/python3.12/site-packages"

# what the consumer library below imports; the cu[A-Z]* driver names are the expected answer
CONSUMER_DRIVER_NAMES = {"cuInit", "cuMemAlloc_v2", "cuLaunchKernel", "cuWeakOptional"}
CONSUMER_SOURCE = """\
extern int cuInit(unsigned int);
extern int cuMemAlloc_v2(void *, unsigned long);
extern int cuLaunchKernel(void);
extern int cuWeakOptional(void) __attribute__((weak));
extern int cudaMalloc(void **, unsigned long);   /* runtime API: not the driver */
extern int cublasCreate_v2(void **);             /* cuBLAS: not the driver */
extern int cuFileDriverOpen(void);               /* cuFile: not the driver */
extern int puts(const char *);
extern int cu_lower_case_helper(void);           /* not a driver name */

int consumer_entry(void)
{
    void *p = 0;
    int rc = cuInit(0) + cuMemAlloc_v2(&p, 16) + cuLaunchKernel() + cudaMalloc(&p, 1)
           + cublasCreate_v2(&p) + cuFileDriverOpen() + cu_lower_case_helper();
    if (cuWeakOptional)
        rc += cuWeakOptional();
    puts("consumer");
    return rc;
}
"""
BYSTANDER_SOURCE = """\
extern int cuCtxCreate_v2(void *, unsigned int, int);
int bystander_entry(void) { return cuCtxCreate_v2(0, 0, 0); }
"""


def _compile_so(source: str, out: Path, *extra: str) -> Path:
    src = out.with_name(out.name.split(".so")[0] + ".c")
    src.write_text(source)
    subprocess.run([GCC, "-shared", "-fPIC", "-o", str(out), str(src), *extra],
                   check=True, capture_output=True, text=True)
    src.unlink()
    return out


def _readelf_needed(path: Path) -> list[str]:
    return cudastub._read_dynamic_info(path).needed


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A fake site-packages: a consumer needing libcuda.so.1, a bystander that does not."""
    base = tmp_path_factory.mktemp("site")
    link_dir = tmp_path_factory.mktemp("link")
    # a first stub for {cuInit} only, to link against so the consumer's DT_NEEDED names libcuda.so.1
    first = build_stub([], link_dir / "cache")
    assert first.name == "libcuda.so.1"
    pkg = base / "pkg" / "sub"
    pkg.mkdir(parents=True)
    consumer = _compile_so(CONSUMER_SOURCE, pkg / "libconsumer.so.1",
                           f"-L{first.parent}", "-Wl,--no-as-needed", "-l:libcuda.so.1")
    os.symlink(consumer.name, pkg / "libconsumer.so")  # the same file twice: read once
    _compile_so(BYSTANDER_SOURCE, base / "pkg" / "bystander.cpython-312-x86_64-linux-gnu.so")
    return base


# ----------------------------------------------------------------------------- (a) collection

@needs_gcc
def test_needed_symbols_finds_exactly_the_driver_names(site):
    consumer = site / "pkg" / "sub" / "libconsumer.so.1"
    assert "libcuda.so.1" in _readelf_needed(consumer)
    assert needed_cuda_symbols([site]) == CONSUMER_DRIVER_NAMES


@needs_gcc
def test_library_without_libcuda_needed_is_ignored(site):
    bystander = site / "pkg" / "bystander.cpython-312-x86_64-linux-gnu.so"
    assert "libcuda.so.1" not in _readelf_needed(bystander)
    assert "cuCtxCreate_v2" in cudastub._read_dynamic_info(bystander).undefined
    assert needed_cuda_symbols([bystander]) == set()
    assert "cuCtxCreate_v2" not in needed_cuda_symbols([site])


@needs_gcc
def test_roots_may_be_files_and_missing_roots_are_harmless(site, tmp_path):
    consumer = site / "pkg" / "sub" / "libconsumer.so.1"
    assert needed_cuda_symbols([consumer, tmp_path / "does-not-exist"]) == CONSUMER_DRIVER_NAMES
    assert needed_cuda_symbols([]) == set()


@needs_gcc
def test_not_so_named_files_are_not_scanned(site, tmp_path):
    shutil.copy(site / "pkg" / "sub" / "libconsumer.so.1", tmp_path / "consumer.bin")
    assert needed_cuda_symbols([tmp_path]) == set()


# ----------------------------------------------------------------------------- source

def test_stub_source_fixed_set_first_line_and_variants():
    src = stub_source(["cuMemAlloc", "cuMemAlloc_v2", "cuStreamSynchronize_ptsz", "cuLinkCreate_v3"])
    first = src.splitlines()[0]
    assert first.startswith("/*") and "generated" in first.lower() and "launches nothing" in first
    for name in ALWAYS_DEFINED:
        assert f" {name}(" in src
    assert "int cuMemAlloc(void)" in src and "int cuMemAlloc_v2(void)" in src
    assert "cuMemAlloc_v2_v2" not in src
    assert "cuStreamSynchronize_ptsz_v2" not in src and "cuLinkCreate_v3_v2" not in src
    assert "cuInit_v2" not in src and "cuGetProcAddress_v2_v2" not in src
    assert src.count("int cuInit(") == 1


def test_stub_source_is_deterministic_and_sorted():
    names = ["cuMemFree", "cuCtxCreate", "cuLaunchKernel"]
    a = stub_source(names)
    assert a == stub_source(reversed(names)) == stub_source(set(names) | {"cuInit"})
    generic = [line.split()[2].split("(")[0] for line in a.splitlines()
               if line.startswith("STUB_EXPORT int ") and "(void) { return 3; }" in line]
    assert generic == sorted(generic)


def test_stub_source_rejects_non_identifiers():
    with pytest.raises(ValueError):
        stub_source(["cu Evil(); int x"])


# ----------------------------------------------------------------------------- (b) behaviour

@pytest.fixture(scope="module")
def built(site, tmp_path_factory) -> Path:
    return build_stub([site], tmp_path_factory.mktemp("stubcache"))


@needs_gcc
def test_built_stub_behaves(built):
    lib = ctypes.CDLL(str(built))
    assert lib.cuInit(0) == 100

    version = ctypes.c_int(-1)
    assert lib.cuDriverGetVersion(ctypes.byref(version)) == 0
    assert version.value == 13000

    count = ctypes.c_int(-1)
    assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0
    assert count.value == 0

    for fn in (lib.cuGetErrorString, lib.cuGetErrorName):
        text = ctypes.c_char_p()
        assert fn(100, ctypes.byref(text)) == 0
        assert text.value
    name = ctypes.c_char_p()
    lib.cuGetErrorName(3, ctypes.byref(name))
    assert name.value == b"CUDA_ERROR_NOT_INITIALIZED"

    # generic stubs answer CUDA_ERROR_NOT_INITIALIZED
    assert lib.cuMemAlloc_v2(None, 16) == 3
    assert lib.cuLaunchKernel() == 3
    assert lib.cuLaunchKernel_v2() == 3  # added _v2 variant


@needs_gcc
def test_get_proc_address_resolves_against_the_stub(built):
    lib = ctypes.CDLL(str(built))
    lib.cuGetProcAddress.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_int, ctypes.c_uint64]
    pfn = ctypes.c_void_p()
    assert lib.cuGetProcAddress(b"cuInit", ctypes.byref(pfn), 13000, 0) == 0
    assert pfn.value == ctypes.cast(lib.cuInit, ctypes.c_void_p).value
    # the resolved pointer is callable and is the real cuInit stub
    assert ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint)(pfn.value)(0) == 100

    # both cuLaunchKernel and cuLaunchKernel_v2 exist: the exact name wins
    assert lib.cuGetProcAddress(b"cuLaunchKernel", ctypes.byref(pfn), 13000, 0) == 0
    assert pfn.value == ctypes.cast(lib.cuLaunchKernel, ctypes.c_void_p).value

    pfn = ctypes.c_void_p(1)
    assert lib.cuGetProcAddress(b"cuNoSuchFunction", ctypes.byref(pfn), 13000, 0) == 500
    assert pfn.value is None
    assert lib.cuGetProcAddress(b"malloc", ctypes.byref(pfn), 13000, 0) == 500

    lib.cuGetProcAddress_v2.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    status = ctypes.c_int(-1)
    assert lib.cuGetProcAddress_v2(b"cuDriverGetVersion", ctypes.byref(pfn), 13000, 0,
                                   ctypes.byref(status)) == 0
    assert pfn.value == ctypes.cast(lib.cuDriverGetVersion, ctypes.c_void_p).value
    assert status.value == 0
    assert lib.cuGetProcAddress_v2(b"cuNope", ctypes.byref(pfn), 13000, 0, ctypes.byref(status)) == 500
    assert status.value == 1


@needs_gcc
def test_get_proc_address_falls_back_to_v2(tmp_path):
    # a library that imports only cuMemAlloc_v2; asking for "cuMemAlloc" must find the _v2 ABI
    stub = build_stub([], tmp_path / "first")
    (tmp_path / "site").mkdir()
    _compile_so("extern int cuInit(unsigned); extern int cuMemAlloc_v2(void);\n"
                "int f(void) { return cuInit(0) + cuMemAlloc_v2(); }",
                tmp_path / "site" / "libv2only.so", f"-L{stub.parent}", "-Wl,--no-as-needed",
                "-l:libcuda.so.1")
    built = build_stub([tmp_path / "site"], tmp_path / "cache")
    lib = ctypes.CDLL(str(built))
    assert not hasattr_symbol(lib, "cuMemAlloc")
    pfn = ctypes.c_void_p()
    lib.cuGetProcAddress.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_int, ctypes.c_uint64]
    assert lib.cuGetProcAddress(b"cuMemAlloc", ctypes.byref(pfn), 13000, 0) == 0
    assert pfn.value == ctypes.cast(lib.cuMemAlloc_v2, ctypes.c_void_p).value


def hasattr_symbol(lib, name: str) -> bool:
    try:
        getattr(lib, name)
    except AttributeError:
        return False
    return True


@needs_gcc
def test_built_stub_has_soname_and_exports(built):
    info = cudastub._read_dynamic_info(built)
    assert CONSUMER_DRIVER_NAMES | ALWAYS_DEFINED | {"cuMemAlloc_v2", "cuLaunchKernel_v2"} <= info.defined
    assert cudastub.STUB_MARKER in info.defined
    assert (built.parent / "stub.c").read_text() == stub_source(CONSUMER_DRIVER_NAMES)
    soname = subprocess.run(["readelf", "-d", str(built)], capture_output=True, text=True).stdout \
        if shutil.which("readelf") else "(SONAME) [libcuda.so.1]"
    assert "[libcuda.so.1]" in soname


# ----------------------------------------------------------------------------- (c) cache

@needs_gcc
def test_build_stub_is_cached_and_deterministic(site, tmp_path):
    first = build_stub([site], tmp_path / "a")
    mtime = first.stat().st_mtime_ns
    again = build_stub([site], tmp_path / "a")
    assert again == first
    assert again.stat().st_mtime_ns == mtime

    other = build_stub([site], tmp_path / "b")
    assert other.parent.name == first.parent.name  # same source, same hash directory
    assert len(first.parent.name) == 16
    assert (other.parent / "stub.c").read_bytes() == (first.parent / "stub.c").read_bytes()
    # no temporary files left behind
    assert sorted(p.name for p in first.parent.iterdir()) == ["libcuda.so.1", "stub.c"]


@needs_gcc
def test_cache_hit_does_not_need_the_compiler(site, tmp_path):
    first = build_stub([site], tmp_path)
    assert build_stub([site], tmp_path, cc="/nonexistent/cc") == first


# ----------------------------------------------------------------------------- errors

def test_missing_compiler_raises(tmp_path):
    with pytest.raises(StubBuildError) as info:
        build_stub([], tmp_path, cc="/nonexistent/bin/gcc-none")
    assert info.value.step
    assert "apt-get install -y gcc" in (info.value.hint or "")


def test_failing_compiler_raises_with_log_tail(tmp_path):
    fake = tmp_path / "badcc"
    fake.write_text("#!/bin/sh\necho 'stub.c:1: error: this compiler is broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(StubBuildError) as info:
        build_stub([], tmp_path / "out", cc=str(fake))
    assert "this compiler is broken" in info.value.log_tail
    assert "this compiler is broken" in str(info.value)
    # nothing half-built is left where the cache would find it
    assert not list((tmp_path / "out").glob("*/libcuda.so.1"))
    assert not list((tmp_path / "out").glob("*/.libcuda*"))


def test_compiler_that_produces_garbage_raises(tmp_path):
    fake = tmp_path / "liarcc"
    # writes a non-ELF file to the -o argument and claims success
    fake.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho junk > "$2"\nexit 0\n')
    fake.chmod(0o755)
    with pytest.raises(StubBuildError):
        build_stub([], tmp_path / "out", cc=str(fake))
    assert not list((tmp_path / "out").glob("*/libcuda.so.1"))


# ----------------------------------------------------------------------------- (d) robustness

def _elf64_header(**over) -> bytearray:
    fields = dict(ident=b"\x7fELF\x02\x01\x01" + b"\0" * 9, type=3, machine=62, version=1, entry=0,
                  phoff=0, shoff=64, flags=0, ehsize=64, phentsize=56, phnum=0, shentsize=64,
                  shnum=3, shstrndx=0)
    fields.update(over)
    return bytearray(struct.pack("<16sHHIQQQIHHHHHH", *fields.values()))


@needs_gcc
def test_bogus_files_are_skipped(site, tmp_path):
    shutil.copytree(site, tmp_path / "site", symlinks=True)
    d = tmp_path / "site" / "junk"
    d.mkdir()
    good = tmp_path / "site" / "pkg" / "sub" / "libconsumer.so.1"
    data = good.read_bytes()
    (d / "text.so").write_text("/* GNU ld script */\nGROUP ( libc.so.6 )\n")
    (d / "empty.so").write_bytes(b"")
    (d / "magic-only.so").write_bytes(b"\x7fELF")
    (d / "elf32.so").write_bytes(b"\x7fELF\x01\x01\x01" + b"\0" * 60)
    (d / "bigendian.so").write_bytes(b"\x7fELF\x02\x02\x01" + b"\0" * 60)
    (d / "truncated.so.2").write_bytes(data[: len(data) // 2])
    (d / "headers-only.so").write_bytes(data[:64])
    (d / "shoff-beyond-eof.so").write_bytes(bytes(_elf64_header(shoff=1 << 40)))
    (d / "huge-shnum.so").write_bytes(bytes(_elf64_header(shnum=0)) + b"\0" * 64)
    (d / "bad-shentsize.so").write_bytes(bytes(_elf64_header(shentsize=40)) + b"\0" * 200)
    # a copy of the consumer with its dynamic string table offset pointing into nowhere
    mangled = bytearray(data)
    with open(good, "rb") as fh:
        elf = cudastub._ElfFile(fh, len(data))
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    for i, sh in enumerate(elf.sections):
        if sh[1] in (6, 11):  # SHT_DYNAMIC, SHT_DYNSYM: size far past end of file
            struct.pack_into("<Q", mangled, shoff + i * 64 + 32, 1 << 50)
    (d / "mangled.so").write_bytes(bytes(mangled))
    random = bytes((i * 7919 + 13) % 256 for i in range(4096))
    (d / "random.so").write_bytes(b"\x7fELF\x02\x01\x01" + random)
    (d / "dir.so").mkdir()
    os.symlink(d / "nowhere.so", d / "broken-link.so")
    os.symlink(d, d / "loop")  # directory symlinks are not followed

    assert needed_cuda_symbols([tmp_path / "site"]) == CONSUMER_DRIVER_NAMES
    assert needed_cuda_symbols([d]) == set()
    built = build_stub([tmp_path / "site"], tmp_path / "cache")
    assert built.is_file()


# ----------------------------------------------------------------------------- real driver

@pytest.fixture
def no_driver(monkeypatch, tmp_path):
    monkeypatch.setattr(cudastub, "_NVIDIACTL", tmp_path / "nvidiactl")
    monkeypatch.setattr(cudastub, "_loaded_real_libcuda", lambda: False)


def test_real_driver_absent(no_driver, monkeypatch):
    monkeypatch.setattr(cudastub.ctypes.util, "find_library", lambda name: None)
    assert real_driver_present() is False


def test_real_driver_nvidiactl(no_driver, monkeypatch, tmp_path):
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(cudastub.ctypes.util, "find_library", lambda name: None)
    assert real_driver_present() is True


@needs_gcc
def test_real_driver_our_stub_does_not_count(no_driver, monkeypatch, built):
    monkeypatch.setattr(cudastub.ctypes.util, "find_library", lambda name: str(built))
    assert real_driver_present() is False
    # found by soname through LD_LIBRARY_PATH
    monkeypatch.setattr(cudastub.ctypes.util, "find_library", lambda name: "libcuda.so.1")
    monkeypatch.setattr(cudastub, "_LIBRARY_DIRS", ())
    monkeypatch.setattr(cudastub, "_ldconfig_paths", lambda name: [])
    monkeypatch.setenv("LD_LIBRARY_PATH", str(built.parent))
    assert real_driver_present() is False


@needs_gcc
def test_real_driver_other_libcuda_counts(no_driver, monkeypatch, tmp_path, site):
    fake_driver = tmp_path / "lib" / "libcuda.so.1"
    fake_driver.parent.mkdir()
    shutil.copy(site / "pkg" / "sub" / "libconsumer.so.1", fake_driver)
    monkeypatch.setattr(cudastub.ctypes.util, "find_library", lambda name: str(fake_driver))
    assert real_driver_present() is True
    # found but not locatable on disk: refuse the stub
    monkeypatch.setattr(cudastub.ctypes.util, "find_library", lambda name: "libcuda.so.1")
    monkeypatch.setattr(cudastub, "_LIBRARY_DIRS", ())
    monkeypatch.setattr(cudastub, "_ldconfig_paths", lambda name: [])
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    assert real_driver_present() is True


def test_real_driver_on_this_host_is_consistent():
    expected_true = Path("/dev/nvidiactl").exists()
    if expected_true:
        assert real_driver_present() is True
    else:
        assert isinstance(real_driver_present(), bool)


# ----------------------------------------------------------------------------- CLI

@needs_gcc
def test_main_prints_built_path(site, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cudastub, "real_driver_present", lambda: False)
    assert cudastub.main([str(site), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(build_stub([site], tmp_path))


def test_main_usage_error_for_missing_root(tmp_path, capsys):
    assert cudastub.main([str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "no such path" in capsys.readouterr().err


def test_main_refuses_with_real_driver(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cudastub, "real_driver_present", lambda: True)
    assert cudastub.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 3
    assert "real NVIDIA driver" in capsys.readouterr().err


@needs_gcc
def test_module_entry_point(site, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "audit.runtimes.cudastub", str(site), "--out", str(tmp_path)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
    if proc.returncode == 3 and "real NVIDIA driver" in proc.stderr:
        pytest.skip("a real driver is present on this host")
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name == "libcuda.so.1" and path.is_file()


def test_audit_does_not_import_vllm_or_torch():
    code = textwrap.dedent("""
        import sys
        import audit.runtimes.cudastub
        bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=Path(__file__).resolve().parents[1])


# ----------------------------------------------------------------------------- (e) real vLLM
# vLLM 0.33.0's CUDA wheel has no vllm/_C.abi3.so: its core extension is _C_stable_libtorch (the
# first one an import of vllm loads). The test imports every compiled vllm extension instead.

def _vllm_env_ready() -> bool:
    # pip writes a distribution's RECORD last, so its presence means that install finished
    return ((VLLM_SITE / "vllm" / "_C_stable_libtorch.abi3.so").is_file()
            and (VLLM_SITE / "torch" / "__init__.py").is_file()
            and any(VLLM_SITE.glob("vllm-*.dist-info/RECORD"))
            and any(VLLM_SITE.glob("torch-*.dist-info/RECORD"))
            and (VLLM_ENV / "bin" / "python").exists())


def _vllm_extension_modules() -> list[str]:
    mods = []
    for so in sorted((VLLM_SITE / "vllm").rglob("*.abi3.so")):
        rel = so.relative_to(VLLM_SITE)
        mods.append(".".join((*rel.parts[:-1], rel.name.split(".", 1)[0])))
    return mods


_IMPORT_EXTENSIONS = textwrap.dedent("""
    import ctypes, importlib, json, sys
    if sys.argv[1]:
        ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    import torch
    failed = {}
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = repr(exc)
    print(json.dumps({"failed": failed, "cuda_available": torch.cuda.is_available()}))
""")


def _import_in_venv(stub: Path | None, modules: list[str], cwd: Path) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    proc = subprocess.run([str(VLLM_ENV / "bin" / "python"), "-c", _IMPORT_EXTENSIONS,
                           str(stub or ""), *modules],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_env_ready(), reason=f"vLLM venv not ready at {VLLM_ENV}")
@needs_gcc
def test_vllm_extensions_import_with_stub(tmp_path):
    if real_driver_present():
        pytest.skip("a real NVIDIA driver is present; the stub must not be used")
    names = needed_cuda_symbols([VLLM_SITE])
    assert len(names) > 30, sorted(names)
    assert {"cuInit", "cuGetErrorString", "cuLaunchKernel"} <= names
    assert not any(n.startswith("cuda") for n in names)

    modules = _vllm_extension_modules()
    assert "vllm._C_stable_libtorch" in modules

    # control: without the stub the extensions cannot load for want of libcuda.so.1
    without = _import_in_venv(None, ["vllm._C_stable_libtorch"], tmp_path)
    assert "libcuda.so.1" in without["failed"].get("vllm._C_stable_libtorch", ""), without

    stub = build_stub([VLLM_SITE], tmp_path / "cache")
    result = _import_in_venv(stub, modules, tmp_path)
    assert result["failed"] == {}, result["failed"]
    assert result["cuda_available"] is False  # the stub launches nothing and reports no device
