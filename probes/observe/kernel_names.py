"""Which GPU kernels each observed kernel path launches: the map torch.profiler traces are read with.

Observe mode's probes count calls of vLLM's Python kernel entries (``probes.observe.session.KERNELS``, one
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
    #: a ``Kernel.path`` of :data:`probes.observe.session.KERNELS` (or of a model's own ``KERNELS``)
    path: str
    pattern: str
    origin: str
    note: str = ""
    #: other paths that launch this same kernel (so a trace cannot tell them apart by it)
    shares: tuple[str, ...] = ()
    #: what the build check searches the origin for when it differs from the trace name: CuTe DSL kernels
    #: are named when compiled (``kernel_cutlass_<function>_<module><class>...``), so their sources
    #: hold the function or class, not the name a trace shows
    look_for: str = ""

    @property
    def origin_kind(self) -> str:
        return self.origin.split(":", 1)[0]

    @property
    def origin_where(self) -> str:
        return self.origin.split(":", 1)[1] if ":" in self.origin else ""


MOE_C = "library:vllm/_moe_C*.so"
VLLM_C = "library:vllm/_C*.so"
DG_IMPLS = "jit-source:vllm/third_party/deep_gemm/include/deep_gemm/impls"
DG_GEMMS = r"sm90_fp8_gemm_1d2d_impl|sm100_fp8_fp4_gemm_1d1d_impl|sm120_fp8_fp4_gemm_1d1d_impl"
HUMMING = ("Humming (indexed)", "Humming (grouped)", "Humming (batched grouped)")


#: the routing/activation/finalize kernels FlashInfer's TRT-LLM-gen MoE launches around its batched GEMMs (every
#: quantization scheme's TRT-LLM-gen experts)
TRTLLM_MOE_DEV = (r"moe(?:::|3)dev(?:::|\d)+(?:finalize|activation|permute|routing|convertsf)",
                  "jit-source:flashinfer/data/csrc/fused_moe/trtllm_backend",
                  r"__global__.*(?:finalizeKernel|activationKernel|permuteKernel)\(")


def _others(group, me):
    return tuple(p for p in group if p != me)


#: vLLM 0.33.0, researched in docs/notes/kernel-names-0.33.md; every path of KERNELS has entries (a quantization
#: scheme's own kernel paths have theirs in its module, a model's in its probes package: ``KERNEL_NAMES``)
KERNEL_NAMES: tuple[KernelName, ...] = (
    # -- MLA decode
    KernelName("FlashMLA", r"flash_fwd_splitkv_mla_(?:combine_)?kernel|flash_fwd_mla_combine_kernel|get_mla_metadata_kernel",
               "library:vllm/_flashmla*.so"),
    KernelName("FlashInfer MLA", r"fmhaSm\d+[a-z]*Kernel_\w*ForGen",
               "runtime-download:FlashInfer trtllm-gen FMHA cubins (TRTLLM_GEN_FMHA)"),
    KernelName("FlashInfer MLA", r"fmhaReductionKernel", "jit-source:flashinfer/data/csrc"),
    KernelName("FlashInfer MLA", r"kernel_cutlass_\w*flashinfercute_dslattention(?:monolithic)?mla_(?:decode|reducer)",
               "jit-source:flashinfer/cute_dsl/attention",
               look_for=r"class (?:BlackwellMultiHeadLatentAttentionForwardFP(?:16|8)|MLAReducer)\b"),
    KernelName("CUTLASS MLA", r"Sm100FmhaMlaKernelTmaWarpspecialized|Sm100FmhaMlaReductionKernel", VLLM_C),
    KernelName("Triton MLA", r"^(?:_fwd_grouped_kernel_stage1|_fwd_kernel_stage1|_fwd_kernel_stage2)$",
               "triton:vllm.v1.attention.ops.triton_decode_attention"),
    KernelName("FlashAttn MLA", r"FlashAttnFwdSm90.*(?:C<64> ?>, 512, |EEELi512E)",
               "library:vllm/vllm_flash_attn/_vllm_fa3_C*.so", note="FA3 with a 512-wide V head: the MLA decode instance"),
    KernelName("Tokenspeed MLA", r"kernel_cutlass_\w*tokenspeed_(?:mla)?mla_decode", "jit-source:tokenspeed_mla",
               look_for=r"def (?:split_kv_kernel|reduction_kernel|mixed_split_kv_kernel)\("),
    # -- MLA prefill
    KernelName("FlashAttn prefill", r"FlashAttnFwdSm90(?!.*(?:C<64> ?>, 512, |EEELi512E))",
               "library:vllm/vllm_flash_attn/_vllm_fa3_C*.so", note="FA3 (SM90)"),
    KernelName("FlashAttn prefill", r"flash_fwd_(?:splitkv_(?:combine_)?)?kernel",
               "library:vllm/vllm_flash_attn/_vllm_fa2_C*.so", note="FA2 (SM8x)"),
    KernelName("FlashAttn prefill", r"kernel_cutlass_kernel_vllmvllm_flash_attncute(?:flash_fwd_sm100FlashAttentionForwardSm100|"
               r"flash_fwd_combineFlashAttentionForwardCombine|sm100_hd256_2cta_fmha_forwardBlackwellFusedMultiHeadAttentionForward)",
               "jit-source:vllm/vllm_flash_attn/cute", look_for=r"class (?:FlashAttentionForwardSm100|FlashAttentionForwardCombine)\b",
               note="FA4 (SM10x); a vision tower launches the same kernels"),
    KernelName("FlashInfer prefill", r"Sm100FmhaFwdKernelTmaWarpspecialized",
               "jit-source:flashinfer/data/include/flashinfer/attention/blackwell"),
    KernelName("TRT-LLM ragged prefill", r"fmhaSm\d+[a-z]*Kernel_\w*Context",
               "runtime-download:FlashInfer trtllm-gen FMHA cubins (TRTLLM_GEN_FMHA)"),
    KernelName("Tokenspeed prefill", r"kernel_cutlass_\w*tokenspeed_mla_?fmha", "jit-source:tokenspeed_mla",
               look_for=r"class BlackwellFusedMultiHeadAttentionForward\b"),
    # -- MoE experts
    KernelName("Marlin", r"marlin_moe_wna16(?:::|6)Marlin", MOE_C, shares=("Marlin (batched)",)),
    KernelName("Marlin (batched)", r"marlin_moe_wna16(?:::|6)Marlin", MOE_C, shares=("Marlin",)),
    *(KernelName(p, r"humming<|_Z7hummingI", "jit-source:humming/kernel", shares=_others(HUMMING, p),
                 note="humming-kernels package, compiled with NVRTC at run time") for p in HUMMING),
    KernelName("FlashInfer CUTLASS", r"GemmUniversalPrecomputedScheduler|SingleWarpgroupPersistentGemm|"
               r"ScaledAcc(?:PerRowBiasPerColScale|PerColBiasPerRowScale)Scatter",
               "jit-source:flashinfer/data/csrc/nv_internal"),
    KernelName("FlashInfer CUTLASS", r"cutlass_kernels(?:::|\d+)(?:expandInputRowsKernel|finalizeMoeRouting(?:NoFilling)?Kernel|"
               r"do(?:Gated)?ActivationKernel|fusedBuildExpertMapsSortFirstTokenKernel|computeStridesTmaWarpSpecializedKernel)",
               "jit-source:flashinfer/data/csrc/fused_moe/cutlass_backend",
               look_for=r"__global__.*(?:expandInputRowsKernel|finalizeMoeRouting(?:NoFilling)?Kernel|do(?:Gated)?ActivationKernel)\("),
    KernelName("DeepGEMM (batched)", DG_GEMMS, DG_IMPLS,
               shares=("Triton or DeepGEMM / CUTLASS fallback", "DeepGEMM FP4")),  # sm90_* is FP8 only: not FP4's
    KernelName("Triton or DeepGEMM / CUTLASS fallback", DG_GEMMS, DG_IMPLS, shares=("DeepGEMM (batched)", "DeepGEMM FP4")),
    KernelName("Triton or DeepGEMM / CUTLASS fallback", r"cutlass_3x_group_gemm", VLLM_C),
    KernelName("Triton or DeepGEMM / CUTLASS fallback", r"^fused_moe_kernel$",
               "triton:vllm.model_executor.layers.fused_moe.fused_moe", shares=("Triton",)),
    KernelName("Triton", r"^fused_moe_kernel$", "triton:vllm.model_executor.layers.fused_moe.fused_moe",
               shares=("Triton or DeepGEMM / CUTLASS fallback",)),
)


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

    def find(self, entry: KernelName, limit: int | None = 200, count: int | None = 3) -> tuple[str, list[str]]:
        """(status, examples): ``in build`` with up to three matching names, ``not in build``, or
        ``not checkable`` (downloaded at run time)."""
        rx = re.compile(entry.look_for or entry.pattern)
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
        return ("in build" if hits else "not in build"), [h[:limit] for h in hits[:count]]


def all_names(model=None) -> tuple[KernelName, ...]:
    """The shared map and *model*'s entries (a ``probes.models.ModelProbes``; None: this process's model)."""
    from probes import models as models_probes

    own = models_probes.current() if model is None else model
    return tuple(own.kernel_names) + KERNEL_NAMES


def check_build(entries=None, roots=None, *, example_chars: int | None = 200, examples: int | None = 3) -> list[dict]:
    """Each entry of the map with what the installed build holds for it (see :meth:`_Build.find`): up to
    *examples* matching names (None: all), each cut to *example_chars* (None: whole)."""
    entries = all_names() if entries is None else entries
    build = _Build(sys.path if roots is None else roots)
    out = []
    for e in entries:
        try:
            status, found = build.find(e, example_chars, examples)
        except re.error as exc:  # a malformed pattern is the map's bug: say so per entry
            status, found = f"bad pattern: {exc}", []
        out.append({"path": e.path, "pattern": e.pattern, "origin": e.origin, "status": status,
                    "examples": found})
    return out


__all__ = ["KERNEL_NAMES", "ORIGIN_KINDS", "KernelName", "all_names", "check_build", "matches"]
