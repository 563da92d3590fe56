"""Which GPU kernels each observed kernel path launches: the map torch.profiler traces are read with.

Observe mode's probes count calls of vLLM's Python kernel entries (``probes.observe.KERNELS``, one
*path* each). A torch.profiler trace names the GPU kernels that actually ran. :data:`KERNEL_NAMES`
ties the two: per path, a regular expression over kernel names (``re.search``; written with
identifier fragments that appear alike in the demangled name a trace shows and the mangled name a
library holds) and where the kernel comes from in a build:

* ``triton:<module or package>`` — a ``@triton.jit`` function of that name in the module's source
  (a Triton kernel is named after its Python function);
* ``library:<glob>`` — a precompiled CUDA kernel whose mangled name is a string in a shared library
  matching the glob (relative to a ``sys.path`` entry; the host stub that registers a kernel holds it);
* ``jit-source:<directory>`` — a kernel compiled at run time (FlashInfer, DeepGEMM JIT) whose
  identifier appears in the sources below that directory;
* ``runtime-download:<what>`` — kernels fetched at run time, not in any wheel (cannot be checked here).

:func:`check_build` looks every entry up in the installed build, so a ledger can say which parts of
the map the pinned image actually contains (an entry whose kernel is not in the build reads no
trace). The research behind each entry is in ``docs/notes/kernel-names-0.33.md``.
Standard library only: it reads files and never imports what it inspects.
"""
from __future__ import annotations

import ast
import glob
import os
import re
import sys
from dataclasses import dataclass

ORIGIN_KINDS = ("triton", "library", "jit-source", "runtime-download")
#: mangled C++ names as they sit in a library's string table (kernels registered by their host stubs)
_MANGLED = re.compile(rb"_Z[0-9A-Za-z_]{6,}")
_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".cuh.in", ".inc", ".py", ".jinja")


@dataclass(frozen=True)
class KernelName:
    #: a ``Kernel.path`` of :data:`probes.observe.KERNELS`
    path: str
    pattern: str
    origin: str
    note: str = ""
    #: other paths that launch this same kernel (so a trace cannot tell them apart by it)
    shares: tuple[str, ...] = ()

    @property
    def origin_kind(self) -> str:
        return self.origin.split(":", 1)[0]

    @property
    def origin_where(self) -> str:
        return self.origin.split(":", 1)[1] if ":" in self.origin else ""


#: filled from docs/notes/kernel-names-0.33.md (vLLM 0.33.0); every path of KERNELS has entries
KERNEL_NAMES: tuple[KernelName, ...] = ()


def matches(entries, name: str) -> list[KernelName]:
    """The entries whose pattern matches kernel *name*."""
    return [e for e in entries if re.search(e.pattern, name)]


class _Build:
    """Lazily read views of an installed build (sys.path roots); each file is read at most once."""

    def __init__(self, roots):
        self.roots = [r for r in dict.fromkeys(roots) if r and os.path.isdir(r)]
        self._strings: dict[str, set[str]] = {}
        self._jit: dict[str, set[str]] = {}
        self._text: dict[str, str] = {}

    def _module_files(self, module: str) -> list[str]:
        rel = module.replace(".", os.sep)
        for root in self.roots:
            base = os.path.join(root, rel)
            if os.path.isfile(base + ".py"):
                return [base + ".py"]
            if os.path.isdir(base):
                return sorted(os.path.join(d, n) for d, _, ns in os.walk(base) for n in ns if n.endswith(".py"))
        return []

    def triton_functions(self, module: str) -> set[str]:
        if module not in self._jit:
            names: set[str] = set()
            for path in self._module_files(module):
                try:
                    tree = ast.parse(self._read_text(path))
                except (SyntaxError, ValueError):
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                        names.add(node.name)
            self._jit[module] = names
        return self._jit[module]

    def libraries(self, pattern: str) -> list[str]:
        found = []
        for root in self.roots:
            found += glob.glob(os.path.join(root, pattern), recursive=True)
        return sorted(set(found))

    def library_strings(self, path: str) -> set[str]:
        if path not in self._strings:
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                data = b""
            self._strings[path] = {m.decode("ascii") for m in _MANGLED.findall(data)}
        return self._strings[path]

    def source_files(self, directory: str) -> list[str]:
        out = []
        for root in self.roots:
            base = os.path.join(root, directory)
            if os.path.isdir(base):
                out += [os.path.join(d, n) for d, _, ns in os.walk(base) for n in ns if n.endswith(_SOURCE_SUFFIXES)]
        return sorted(set(out))

    def _read_text(self, path: str) -> str:
        if path not in self._text:
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    self._text[path] = fh.read()
            except OSError:
                self._text[path] = ""
        return self._text[path]

    def find(self, entry: KernelName) -> tuple[str, list[str]]:
        """(status, examples): ``in build`` with up to three matching names, ``not in build``, or
        ``not checkable`` (downloaded at run time)."""
        rx = re.compile(entry.pattern)
        kind, where = entry.origin_kind, entry.origin_where
        hits: list[str] = []
        if kind == "triton":
            hits = sorted(n for n in self.triton_functions(where) if rx.search(n))
        elif kind == "library":
            for lib in self.libraries(where):
                hits += sorted(s for s in self.library_strings(lib) if rx.search(s))
        elif kind == "jit-source":
            for path in self.source_files(where):
                m = rx.search(self._read_text(path))
                if m:
                    hits.append(f"{os.path.basename(path)}: {m.group(0)}")
        else:
            return "not checkable", []
        return ("in build" if hits else "not in build"), [h[:200] for h in hits[:3]]


def check_build(entries=None, roots=None) -> list[dict]:
    """Each entry of the map with what the installed build holds for it (see :meth:`_Build.find`)."""
    entries = KERNEL_NAMES if entries is None else entries
    build = _Build(sys.path if roots is None else roots)
    out = []
    for e in entries:
        try:
            status, examples = build.find(e)
        except re.error as exc:
            status, examples = f"bad pattern: {exc}", []
        out.append({"path": e.path, "pattern": e.pattern, "origin": e.origin, "status": status,
                    "examples": examples})
    return out


__all__ = ["KERNEL_NAMES", "ORIGIN_KINDS", "KernelName", "check_build", "matches"]
