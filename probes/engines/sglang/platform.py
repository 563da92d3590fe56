"""The device SGLang is shown in resolve mode: the shared torch-level stand-ins (``probes.resolve.simulate``: the
SKU's capability, name, properties and count), plus the device queries SGLang makes that vLLM does not.

Every answer is a fact of the simulated GPU (its memory, its count); no decision SGLang derives from them
(``get_platform().is_sm100``, backend defaults, memory-based sizes) is made here. Each stand-in is a fenced piece
with a contract, and is listed in ``simulate.SIMULATED`` for the ledger.
"""
from __future__ import annotations

import os

from probes.core import fence

#: set before torch is imported: torch's own CUDA availability check then counts devices with
#: ``torch.cuda.device_count`` (the simulated count) instead of initialising a CUDA context
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def prepare_environment() -> None:
    os.environ[NVML_CHECK] = "1"


def install() -> None:
    """The torch stand-ins, and ``torch.cuda.mem_get_info`` (SGLang sizes its memory from it when nvidia-smi is
    absent, as it is under the stub driver)."""
    import torch

    from probes.resolve import simulate

    simulate.simulate_torch()
    simulate.SIMULATED["torch.cuda.is_available"] = (
        "True on the simulated device count: the harness sets PYTORCH_NVML_BASED_CUDA_CHECK=1, so torch's own check "
        "counts devices with torch.cuda.device_count; no CUDA runtime")
    State = simulate._State

    def mem_get_info(device=None):
        total = State.sku().total_memory
        return (total, total)

    pair = fence.returns(tuple, check=lambda v: len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v),
                         what="torch.cuda.mem_get_info")
    if check_fit("torch.cuda.mem_get_info"):
        torch.cuda.mem_get_info = fence.guard("torch.cuda.mem_get_info", contract=pair)(mem_get_info)
        simulate.SIMULATED["torch.cuda.mem_get_info"] = "the simulated SKU's memory, all of it free"

    def set_device(device=None):
        return None

    if check_fit("torch.cuda.set_device"):
        torch.cuda.set_device = fence.guard("torch.cuda.set_device", contract=fence.returns(type(None)))(set_device)
        simulate.SIMULATED["torch.cuda.set_device"] = "accepted, nothing done (one simulated device per process)"
    simulate.SIMULATED["nvidia-smi"] = ("absent (no NVIDIA driver): SGLang's own fallback reads the memory from "
                                        "torch.cuda.mem_get_info")


def cuda_allocations_to_meta():
    """A torch function mode that sends explicit CUDA allocations (``device='cuda'``, ``'cuda:0'``, an index) to the
    meta device and leaves every other tensor where it is: SGLang's process groups allocate small CUDA tensors
    (rank masks) while host-side values (memory figures reduced over the CPU group) stay real."""
    import torch
    from torch.overrides import TorchFunctionMode

    from probes.resolve import simulate

    meta = torch.device("meta")

    def _is_cuda(dev) -> bool:
        return not isinstance(dev, bool) and simulate.is_cuda_device(dev)

    class _CudaToMeta(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = meta
            return func(*args, **kwargs)

    simulate.SIMULATED["torch: device='cuda' allocations (process groups)"] = (
        "redirected to the meta device while SGLang builds its process groups; host tensors stay on the CPU")
    return _CudaToMeta()


#: what the SGLang probes replace or call in SGLang and torch, by fenced piece: (module, attributes it must have).
#: ``probes.engines.sglang.fitcheck`` checks each against the installed release before any cell; the cell checks
#: again before it uses one. A name with alternatives (``a|b``) fits when the module has one of them (the releases
#: renamed the entry).
FIT_TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "torch.cuda.mem_get_info": ("torch.cuda", ("mem_get_info",)),
    "torch.cuda.set_device": ("torch.cuda", ("set_device",)),
    "sglang GroupCoordinator": ("sglang.srt.distributed.parallel_state", ("GroupCoordinator.__init__",)),
    "sglang parallel runtime": ("sglang.srt.distributed.bootstrap", ("init_parallel_runtime|init_torch_distributed",)),
    "sglang resolution": ("sglang.srt.arg_groups.overrides", ("resolution_result",)),
    "sglang server arguments": ("sglang.srt.server_args", ("prepare_server_args", "ServerArgs.resolve_once")),
    "sglang runtime context": ("sglang.srt.runtime_context", ("publish", "attention_backends", "get_parallel")),
    "sglang model loader": ("sglang.srt.model_loader.loader", ("_initialize_model", "_get_quantization_config")),
    "sglang MoE runner globals": ("sglang.srt.layers.moe.utils", ("get_moe_runner_backend", "get_moe_a2a_backend")),
    "sglang ModelRunner (KDA prefill default)": ("sglang.srt.layers.attention.linear.utils",
                                                 ("resolve_linear_attn_backends",)),
    "sglang draft model build": ("sglang.srt.layers.moe.utils", ("draft_model_build_scope",)),
    "sglang draft worker attention": ("sglang.srt.speculative.draft_worker_common",
                                      ("resolve_draft_worker_attention_backend|_resolve_draft_attention_backend_fallback",)),
    "sglang draft ModelRunner (attention backend)": (
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup",
        ("resolve_attention_backend_strs",)),
    "sglang draft runner's own backend": ("sglang.srt.model_executor.model_runner",
                                          ("resolve_draft_attention_backend",)),
}


def check_fit(piece: str) -> bool:
    """Whether *piece*'s target fits the installed release (recorded in ``fence.FIT`` either way)."""
    import importlib

    module, attrs = FIT_TARGETS[piece]
    mod = importlib.import_module(module)
    missing = [a for a in attrs if not any(_has(mod, alt) for alt in a.split("|"))]
    if missing:
        fence.FIT[piece] = f"does not fit {fence.installed_version(mod)}: {module} has no {', '.join(missing)} " \
                           "(not applied)"
        return False
    fence.FIT.setdefault(piece, f"fits {fence.installed_version(mod)}")
    return True


def _has(obj, dotted: str) -> bool:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True
