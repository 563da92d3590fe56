"""Read ELF64 shared objects in pure Python: which CUDA driver functions the installed libraries import.

Standard library only: it runs on the host (``audit.cudastub`` builds a stub ``libcuda.so.1`` from the
answer) and inside foreign images (``probes.core.inventory``), where binutils may be missing.
"""
from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

LIBCUDA_SONAME = "libcuda.so.1"

# Driver API names are ``cu`` + an upper-case letter (cuInit, cuMemAlloc_v2, cuLaunchKernel).
# The runtime API (``cudaMalloc``) and the CUDA libraries (``cublasCreate_v2``, ``cudnnCreate``,
# ``cufftPlan1d``, ``curandCreateGenerator``, ``cusparseCreate``, ``cusolverDnCreate``,
# ``cutensorCreate``) continue in lower case, so they do not match. cuFile (GPUDirect Storage,
# ``libcufile``) is the one library whose names look like driver names; it is excluded by prefix.
# Exporting a library's names from the stub would shadow the real library when the stub is
# loaded RTLD_GLOBAL, so the filter errs on the side of the driver API.
_DRIVER_NAME = re.compile(r"cu[A-Z][A-Za-z0-9_]*\Z")
_NOT_DRIVER_PREFIXES = ("cuFile",)
_VERSION_SUFFIX = re.compile(r"(_v[0-9]+|_ptsz|_ptds)\Z")


# --------------------------------------------------------------------------------------------
# ELF reading (ELF64 little-endian only)
# --------------------------------------------------------------------------------------------

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ELFDATA2LSB = 1
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")  # Elf64_Ehdr, 64 bytes
_SHDR = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr, 64 bytes
_SYM = struct.Struct("<IBBHQQ")  # Elf64_Sym, 24 bytes
_DYN = struct.Struct("<qQ")  # Elf64_Dyn, 16 bytes
_SHT_STRTAB = 3
_SHT_DYNAMIC = 6
_SHT_NOBITS = 8
_SHT_DYNSYM = 11
_DT_NULL = 0
_DT_NEEDED = 1
_STB_GLOBAL = 1
_STB_WEAK = 2
_STT_NOTYPE = 0
_STT_FUNC = 2
_SHN_UNDEF = 0
# sanity caps so a corrupt header cannot make us allocate gigabytes
_MAX_SECTIONS = 1 << 16
_MAX_TABLE_BYTES = 256 << 20


class _NotElf64(Exception):
    """The file is not a well-formed ELF64 little-endian object (or not one we can read)."""


@dataclass
class _ElfDynamicInfo:
    needed: list[str] = field(default_factory=list)
    #: undefined GLOBAL/WEAK FUNC/NOTYPE symbols of .dynsym
    undefined: set[str] = field(default_factory=set)
    #: names .dynsym defines (any type)
    defined: set[str] = field(default_factory=set)


class _ElfFile:
    def __init__(self, fh, size: int):
        self._fh = fh
        self._size = size
        head = self._read(0, _EHDR.size)
        (ident, _type, _machine, _version, _entry, _phoff, shoff, _flags, _ehsize, _phentsize,
         _phnum, shentsize, shnum, _shstrndx) = _EHDR.unpack(head)
        if ident[:4] != _ELF_MAGIC or ident[4] != _ELFCLASS64 or ident[5] != _ELFDATA2LSB:
            raise _NotElf64("not ELF64 little-endian")
        if shoff == 0:
            raise _NotElf64("no section headers")
        if shentsize != _SHDR.size:
            raise _NotElf64(f"unexpected section header size {shentsize}")
        if shnum == 0:  # extended numbering: the real count is in section 0's sh_size
            shnum = _SHDR.unpack(self._read(shoff, _SHDR.size))[5]
        if not 0 < shnum <= _MAX_SECTIONS:
            raise _NotElf64(f"implausible section count {shnum}")
        raw = self._read(shoff, shnum * _SHDR.size)
        self.sections = [_SHDR.unpack_from(raw, i * _SHDR.size) for i in range(shnum)]

    def _read(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self._size or length > _MAX_TABLE_BYTES:
            raise _NotElf64(f"read of {length} bytes at {offset} is outside the file")
        self._fh.seek(offset)
        data = self._fh.read(length)
        if len(data) != length:
            raise _NotElf64("short read")
        return data

    def section_data(self, index: int) -> bytes:
        if not 0 <= index < len(self.sections):
            raise _NotElf64(f"section index {index} out of range")
        sh_type, offset, size = self.sections[index][1], self.sections[index][4], self.sections[index][5]
        if sh_type == _SHT_NOBITS:
            return b""
        return self._read(offset, size)

    def linked_strtab(self, index: int) -> bytes:
        link = self.sections[index][6]
        if not 0 <= link < len(self.sections) or self.sections[link][1] != _SHT_STRTAB:
            raise _NotElf64("section is not linked to a string table")
        return self.section_data(link)

    def sections_of_type(self, sh_type: int) -> list[int]:
        return [i for i, sh in enumerate(self.sections) if sh[1] == sh_type]


def _cstr(table: bytes, offset: int) -> str:
    if not 0 <= offset < len(table):
        raise _NotElf64("string offset outside its table")
    end = table.find(b"\0", offset)
    if end < 0:
        raise _NotElf64("unterminated string")
    return table[offset:end].decode("utf-8", "replace")


def _strip_version(name: str) -> str:
    # .dynsym names carry no version (that lives in .gnu.version), but tolerate name@VER / name@@VER
    return name.split("@", 1)[0]


def _read_dynamic_info(path: Path, *, symbols_if_needed: str | None = None) -> _ElfDynamicInfo:
    """DT_NEEDED and .dynsym of *path*; raises :class:`_NotElf64` (or OSError) when unreadable.

    With *symbols_if_needed*, the (possibly large) symbol table is read only when that soname
    is among the DT_NEEDED entries.
    """
    info = _ElfDynamicInfo()
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < _EHDR.size:
            raise _NotElf64("too short")
        elf = _ElfFile(fh, size)
        for index in elf.sections_of_type(_SHT_DYNAMIC):
            data = elf.section_data(index)
            strtab = elf.linked_strtab(index)
            for off in range(0, len(data) - _DYN.size + 1, _DYN.size):
                tag, val = _DYN.unpack_from(data, off)
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    info.needed.append(_cstr(strtab, val))
        if symbols_if_needed is not None and symbols_if_needed not in info.needed:
            return info
        for index in elf.sections_of_type(_SHT_DYNSYM):
            entsize = elf.sections[index][9] or _SYM.size
            if entsize != _SYM.size:
                raise _NotElf64(f"unexpected symbol entry size {entsize}")
            data = elf.section_data(index)
            strtab = elf.linked_strtab(index)
            # entry 0 is the reserved null symbol
            for off in range(_SYM.size, len(data) - _SYM.size + 1, _SYM.size):
                st_name, st_info, _other, st_shndx, _value, _size = _SYM.unpack_from(data, off)
                if st_name == 0:
                    continue
                name = _strip_version(_cstr(strtab, st_name))
                if not name:
                    continue
                if st_shndx != _SHN_UNDEF:
                    info.defined.add(name)
                    continue
                bind, typ = st_info >> 4, st_info & 0xF
                if bind in (_STB_GLOBAL, _STB_WEAK) and typ in (_STT_NOTYPE, _STT_FUNC):
                    info.undefined.add(name)
    return info


def _is_shared_object_name(name: str) -> bool:
    return name.endswith(".so") or ".so." in name


def _iter_shared_objects(roots: Iterable[Path]) -> Iterable[Path]:
    """Regular files named ``*.so`` / ``*.so.*`` under *roots*, each underlying file once."""
    seen: set[tuple[int, int]] = set()

    def accept(path: Path) -> bool:
        try:
            st = path.stat()  # follows symlinks; broken links raise
        except OSError:
            return False
        if not os.path.isfile(path):
            return False
        key = (st.st_dev, st.st_ino)
        if key in seen:
            return False
        seen.add(key)
        return True

    for root in roots:
        root = Path(root)
        if root.is_file():
            if accept(root):
                yield root
            continue
        # os.walk swallows unreadable directories; do not follow directory symlinks (loops)
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            for name in sorted(filenames):
                if _is_shared_object_name(name):
                    path = Path(dirpath, name)
                    if accept(path):
                        yield path


def _is_driver_symbol(name: str) -> bool:
    return bool(_DRIVER_NAME.match(name)) and not name.startswith(_NOT_DRIVER_PREFIXES)


def needed_cuda_symbols(roots: Iterable[Path]) -> set[str]:
    """Driver-API names (``cu*``) that the shared objects under *roots* import from libcuda.

    Only files whose DT_NEEDED contains ``libcuda.so.1`` contribute. Non-ELF, 32-bit, big-endian,
    truncated, unreadable or otherwise malformed files are skipped silently.
    """
    found: set[str] = set()
    for path in _iter_shared_objects(roots):
        try:
            info = _read_dynamic_info(path, symbols_if_needed=LIBCUDA_SONAME)
        except (_NotElf64, OSError, struct.error, ValueError):
            continue
        if LIBCUDA_SONAME in info.needed:
            found.update(name for name in info.undefined if _is_driver_symbol(name))
    found.update(source_cuda_symbols(roots))
    return found


_C_CALL = re.compile(r"(?<![\w.>])(cu[A-Z]\w*)\s*\(")


def source_cuda_symbols(roots: Iterable[Path]) -> set[str]:
    """Driver-API names called from C sources shipped to be compiled at run time.

    Triton compiles ``backends/nvidia/driver.c`` against libcuda on first use; its calls are not in
    any shipped ELF file, so they are read from the source (``*.c`` files that include cuda.h).
    """
    found: set[str] = set()
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.c")):
            try:
                text = path.read_text(encoding="utf-8", errors="replace")
            except OSError:
                continue
            if "cuda.h" not in text:
                continue
            found.update(n for n in _C_CALL.findall(text) if _is_driver_symbol(n) and not n.endswith("_t"))
    return found


# --------------------------------------------------------------------------------------------
# GPU code a shared object carries: the fatbin containers of its .nv_fatbin section
# --------------------------------------------------------------------------------------------
#
# A container: u32 magic 0xBA55ED50, u16 version 1, u16 header size, u64 size of the entries that follow. An entry:
# u16 kind (1 PTX, 2 SASS), u16, u32 header size, u64 payload size (the next entry follows header and payload),
# u32 compressed size, u32 options offset, u16 minor, u16 major, u32 SM number, u32 name offset, u32 name size,
# u64 flags (0x100000: an arch-specific build, "a"; 0x200000: a family build, "f"), u64, u64 uncompressed size. The
# header is never compressed, so the SM of a compressed entry is read all the same. Checked against cuobjdump's
# --list-elf / --list-ptx on the pinned environments' libraries (same SMs, same counts).

_FATBIN_MAGIC = 0xBA55ED50
_CONTAINER = struct.Struct("<IHHQ")
_ENTRY = struct.Struct("<HHIQIIHHIIIQ")  # the first 56 bytes of an entry header
_ARCH_SPECIFIC, _FAMILY = 0x100000, 0x200000


def device_code(path: str | os.PathLike) -> dict[str, list[str]] | None:
    """``{"sass": ["sm_90a", "sm_100f", ...], "ptx": ["compute_80", ...]}`` for a shared object's ``.nv_fatbin``
    section (empty lists: a section with no entries), or None when the file has no such section (no GPU code
    shipped: a library that compiles its kernels at run time, or a CPU-only one) or is no ELF64 file."""
    import mmap

    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = path.stat().st_size
            elf = _ElfFile(fh, size)
            names = elf.section_data(_shstrndx(fh))
            found = [sh for sh in elf.sections if _section_name(names, sh[0]) == ".nv_fatbin" and sh[1] != _SHT_NOBITS]
            if not found:
                return None
            sass, ptx = set(), set()
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:  # sections of hundreds of MB: never read
                for sh in found:
                    offset, length = sh[4], sh[5]
                    if offset + length > size:
                        return None
                    _read_containers(memoryview(mm)[offset:offset + length], sass, ptx)
    except (OSError, ValueError, _NotElf64, struct.error):
        return None
    order = lambda s: (int(re.sub(r"\D", "", s)), s)  # noqa: E731
    return {"sass": sorted(sass, key=order), "ptx": sorted(ptx, key=order)}


def _shstrndx(fh) -> int:
    fh.seek(0)
    return _EHDR.unpack(fh.read(_EHDR.size))[13]


def _section_name(names: bytes, offset: int) -> str:
    end = names.find(b"\0", offset)
    return names[offset:end].decode("latin-1") if 0 <= offset < len(names) and end >= 0 else ""


def _read_containers(data: memoryview, sass: set, ptx: set) -> None:
    at = 0
    magic_bytes = struct.pack("<I", _FATBIN_MAGIC)
    while at + _CONTAINER.size <= len(data):
        magic, version, head, size = _CONTAINER.unpack_from(data, at)
        if magic != _FATBIN_MAGIC or version != 1 or head < _CONTAINER.size:
            nxt = bytes(data[at + 1:at + 1 + 4096]).find(magic_bytes)  # padding between containers is short
            if nxt < 0:
                return
            at += 1 + nxt
            continue
        end = min(at + head + size, len(data))
        entry = at + head
        while entry + _ENTRY.size <= end:
            kind, _u, ehead, payload, _c, _o, _minor, _major, sm, _no, _nl, flags = _ENTRY.unpack_from(data, entry)
            if ehead < 64 or sm > 1000:
                break
            suffix = "a" if flags & _ARCH_SPECIFIC else "f" if flags & _FAMILY else ""
            if kind == 2:
                sass.add(f"sm_{sm}{suffix}")
            elif kind == 1:
                ptx.add(f"compute_{sm}{suffix}")
            entry += ehead + payload
        at = end


def deep_gemm_sm_majors(package_dir: str | os.PathLike) -> list[int]:
    """The SM majors a vendored DeepGEMM build has code for. DeepGEMM ships no GPU code (its ``_C*.so`` has no
    ``.nv_fatbin``: it compiles its kernels at run time for the device's SM), so its compiled host code decides: SM 9
    and SM 10 in every release, SM 12 where that code checks for it (``arch_major == 12``; the builds without it
    have no ``sm120`` kernel headers either)."""
    majors = {9, 10}
    for path in sorted(Path(package_dir).glob("_C*.so")):
        try:
            with open(path, "rb") as fh:
                if b"arch_major == 12" in fh.read():
                    majors.add(12)
        except OSError:
            continue
    return sorted(majors)
