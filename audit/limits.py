"""The places resolve mode is declared unable to go on without a device: the **simulation limits**, per library and
release, each with the function it stops in and why. Data, read by the routing model (``audit/report/routing.py``).

A cell that stops (construction or a post-load step) where vLLM's own code did not refuse is a simulation limit only
where a declaration here matches the stop: the function the exception was raised in, its type and message, and the
version of the library that raised it, as the cell's environment fingerprint recorded it. A stop no declaration
matches is a **harness fault** (the cell is INCOMPLETE, exit 4): resolve mode has always gone further there, or
nobody has looked at why it cannot, so what lies past it must not read as a fact about vLLM. Declaring a limit is a
reviewed change: find why the simulation cannot go on there (a device runtime, an op with no meta kernel), write it
in ``why``, and name the releases it was checked on.

Standard library only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Limit:
    """One declared limit. ``raised_in``, ``type`` and ``message`` are regular expressions on the stop's innermost
    function (``module:qualname``), exception type (``module:Qualname``) and message; ``library`` is the distribution
    whose version decides (as the cell's fingerprint names it: ``vllm`` for its own compiled ops and vendored
    libraries); ``versions`` the releases of it the limit was checked on."""
    id: str
    library: str
    versions: tuple[str, ...]
    raised_in: str
    type: str
    message: str
    why: str

    def matches(self, raised_in: str, type_: str, message: str, packages: dict) -> bool:
        return (packages.get(self.library) in self.versions and bool(re.search(self.raised_in, raised_in or ""))
                and bool(re.search(self.type, type_ or "")) and bool(re.search(self.message, message or "")))


_VLLM = ("0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")

#: every declared limit
LIMITS: tuple[Limit, ...] = (
    Limit("cute-dsl-cuda-runtime", "nvidia-cutlass-dsl", ("4.8.0",),
          raised_in=r"^cutlass\.base_dsl\.runtime\.cuda:checkCudaErrors$",
          type=r"^cutlass\.base_dsl\.common:DSLCudaRuntimeError$", message=r"cudaErrorNoDevice",
          why="CuTe DSL compiles and loads its kernels through the CUDA runtime of a device (cudaGetDevice and module "
              "loading): with no GPU the runtime answers cudaErrorNoDevice, and no shape-only stand-in can give what "
              "a compiled kernel object is. Checked on vLLM 0.33.0's CuTe DSL decode kernels, built after load."),
    Limit("vllm-C-per-token-group-fp8-quant-packed", "vllm", _VLLM,
          raised_in=r"^torch\._ops:OpOverloadPacket\.__call__$", type=r"^builtins:NotImplementedError$",
          message=r"^_C::per_token_group_fp8_quant_packed: attempted to run this operator with Meta tensors",
          why="vLLM's compiled op _C::per_token_group_fp8_quant_packed registers no Meta kernel and no fake "
              "implementation; its checks differ between releases (group sizes {128} on 0.27-0.29, {32, 128} on "
              "0.30+), so no stand-in is written for it. MLA's post-load calls it (DeepGEMM's packed FP8 "
              "activation quantization)."),
    Limit("vllm-C-per-token-group-fp8-quant", "vllm", ("0.33.0",),
          raised_in=r"^torch\._ops:OpOverloadPacket\.__call__$", type=r"^builtins:NotImplementedError$",
          message=r"^_C::per_token_group_fp8_quant: attempted to run this operator with Meta tensors",
          why="the unpacked sibling of the op above: vLLM's compiled _C::per_token_group_fp8_quant registers no Meta "
              "kernel and no fake implementation either. MLA's post-load reaches it on SM 9.0 where FlashInfer is "
              "not available (the pip host, audit/pins/hosts.py); checked on vLLM 0.33.0."),
)


def declared(raised_in: str, type_: str, message: str, packages: dict) -> Limit | None:
    """The declaration covering a stop, or None (then the stop is a harness fault)."""
    return next((lim for lim in LIMITS if lim.matches(raised_in, type_, message, packages)), None)


def raised_in_of(where: str) -> str:
    """``module:function`` of a recorded ``<path>:<line> in <function>`` (a construction stop's innermost frame; the
    path relative to site-packages or absolute)."""
    m = re.match(r"^(?P<path>.+?\.py):\d+ in (?P<func>.+)$", where or "")
    if not m:
        return ""
    path = m.group("path").replace("\\", "/")
    path = path.split("/site-packages/", 1)[-1].lstrip("/")
    return f"{path[:-3].replace('/', '.')}:{m.group('func')}"
