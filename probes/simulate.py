"""Resolve mode: present vLLM with a simulated NVIDIA GPU so its own selection code runs.

Only device *queries* are answered here; every selection stays in vLLM's code. Everything this
module stands in for is listed in :data:`SIMULATED` and written to the evidence, so the ledger can
say exactly what was simulated. Imported only by the resolve agent, after the stub libcuda.
"""
from __future__ import annotations

import ctypes
import os
import types

#: what resolve mode answers instead of a GPU (module:qualname -> what it reports)
SIMULATED: dict[str, str] = {}


def real_driver_present() -> bool:
    if os.path.exists("/dev/nvidiactl"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1", mode=getattr(os, "RTLD_NOLOAD", 4))
        return True
    except OSError:
        return False


def load_stub_libcuda(path: str) -> None:
    """Load the stub driver globally so vLLM's compiled extensions link. Refuses on a GPU host."""
    if real_driver_present():
        raise RuntimeError("a real NVIDIA driver is present: resolve mode refuses to load the stub libcuda")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    # Triton compiles a small helper against libcuda; point it at the stub's folder.
    os.environ["TRITON_LIBCUDA_PATH"] = os.path.dirname(path)
    SIMULATED["libcuda.so.1"] = "generated stub: cuInit reports no device, launches nothing"


class _DeviceProperties:
    """Stand-in for torch.cuda.get_device_properties() of the simulated SKU."""

    def __init__(self, system: dict):
        self.name = system["device_name"]
        self.major, self.minor = system["capability"]
        self.total_memory = system["total_memory_gib"] << 30
        self.multi_processor_count = system["sm_count"]
        self.is_integrated = False
        self.warp_size = 32
        self.uuid = "GPU-00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return (f"_DeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory}, multi_processor_count={self.multi_processor_count})")


def simulate_torch(system: dict, world_size: int) -> None:
    """Answer torch.cuda device queries for the simulated GPU (is_available stays False)."""
    import torch

    props = _DeviceProperties(system)
    cap = (props.major, props.minor)

    def get_device_capability(device=None):
        return cap

    def get_device_properties(device=None):
        return props

    def get_device_name(device=None):
        return props.name

    def current_device():
        return 0

    def device_count():
        return world_size

    for name, fn in (("get_device_capability", get_device_capability),
                     ("get_device_properties", get_device_properties),
                     ("get_device_name", get_device_name),
                     ("current_device", current_device),
                     ("device_count", device_count)):
        setattr(torch.cuda, name, fn)
        SIMULATED[f"torch.cuda.{name}"] = "simulated SKU"

    # Triton: report the NVIDIA driver active, as on a GPU host (vllm.triton_utils.HAS_TRITON).
    try:
        from triton.backends.nvidia import driver as nv_driver

        nv_driver.CudaDriver.is_active = staticmethod(lambda: True)
        SIMULATED["triton.backends.nvidia.driver:CudaDriver.is_active"] = "True"
    except Exception as exc:  # recorded by the caller through SIMULATED
        SIMULATED["triton.backends.nvidia.driver:CudaDriver.is_active"] = f"not patched: {exc!r}"


def install_platform(system: dict, world_size: int):
    """Install a subclass of vLLM's real non-NVML CUDA platform as the current platform."""
    import vllm.platforms as platforms
    from vllm.platforms import cuda as vcuda
    from vllm.platforms.interface import DeviceCapability

    props = _DeviceProperties(system)
    capability = DeviceCapability(major=props.major, minor=props.minor)
    base = vcuda.NonNvmlCudaPlatform

    overrides = {
        "get_device_capability": lambda cls, device_id=0: capability,
        "get_device_name": lambda cls, device_id=0: props.name,
        "get_device_uuid": lambda cls, device_id=0: props.uuid,
        "get_device_total_memory": lambda cls, device_id=0: props.total_memory,
        "device_count": lambda cls: world_size,
        "is_fully_connected": lambda cls, *a, **k: True,
        "get_device_numa_node": lambda cls, device_id=0: None,
        "get_all_device_numa_nodes": lambda cls: None,
        "num_compute_units": lambda cls, device_id=0: props.multi_processor_count,
        "is_integrated_gpu": lambda cls, device_id=0: False,
        "is_arch_support_pdl": lambda cls: props.major >= 9,
    }
    ns: dict = {"__module__": __name__, "__qualname__": "SimulatedCudaPlatform"}
    for name, fn in overrides.items():
        if hasattr(base, name):
            ns[name] = classmethod(fn)
            SIMULATED[f"vllm.platforms.cuda:CudaPlatform.{name}"] = "simulated SKU"
    cls = type("SimulatedCudaPlatform", (base,), ns)
    instance = cls()
    platforms._current_platform = instance
    return instance


def meta_device_mode():
    """A TorchFunctionMode that sends explicit ``device='cuda'`` allocations to the meta device."""
    import torch
    from torch.overrides import TorchFunctionMode

    def _is_cuda(dev) -> bool:
        if isinstance(dev, torch.device):
            return dev.type == "cuda"
        if isinstance(dev, str):
            return dev.startswith("cuda")
        return isinstance(dev, int)

    class _CudaToMeta(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs["device"] = torch.device("meta")
            return func(*args, **kwargs)

    SIMULATED["torch: device='cuda' allocations"] = "redirected to the meta device"
    return _CudaToMeta()


def stand_in_cuda_streams() -> None:
    """torch.cuda.Stream/Event need a device; construction only stores them, never launches."""
    import torch

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

    class _Event:
        def __init__(self, *a, **k):
            pass

        def record(self, *a, **k):
            pass

        def wait(self, *a, **k):
            pass

    torch.cuda.Stream = _Stream  # type: ignore[assignment]
    torch.cuda.Event = _Event  # type: ignore[assignment]
    SIMULATED["torch.cuda.Stream/Event"] = "inert stand-ins (construction stores them; nothing runs)"


__all__ = ["SIMULATED", "load_stub_libcuda", "simulate_torch", "install_platform", "meta_device_mode",
           "stand_in_cuda_streams", "types"]
