"""Resolve mode: present vLLM with a simulated NVIDIA GPU so its own selection code runs.

Only device *queries* are answered here; every selection stays in vLLM's code. Everything this
module stands in for is listed in :data:`SIMULATED` and written to the evidence, so the ledger can
say exactly what was simulated. Imported only by the resolve agent, after the stub libcuda.
"""
from __future__ import annotations

import ctypes
import functools
import os

from probes.core import fence
from probes.core.fence import SimulationLimit, foreign

#: what resolve mode answers instead of a GPU (module:qualname -> what it reports)
SIMULATED: dict[str, str] = {}

#: entries of SIMULATED that are no fenced piece of Python (probes.core.fence), and why nothing of the harness
#: can raise there unseen; every other entry is a fenced piece (tests/test_fence_vllm.py checks both ways)
UNFENCED: dict[str, str] = {
    "libcuda.so.1": "a C library generated at setup: it returns error codes, it raises nothing",
    "torch.cuda.is_available": "no code of the harness: vLLM's own NVML-based check, with the variable vLLM sets",
    "torch: device='cuda' allocations": "the default-device mode runs for every tensor operation, so it is not "
                                        "wrapped; its body only rewrites a device argument, and what the operation "
                                        "raises is torch's",
    "post-load": "the harness's driver of vLLM's post-load steps: what its own code raises is caught where each step's "
                 "outcome is classified and recorded as a fault there",
    "post-load: checkpoint weight names": "tensors the post-load driver feeds vLLM's load_weights (no code runs "
                                          "inside vLLM's call)",
    "vllm workspace manager": "no code of the harness: vLLM's own init_workspace_manager, called once by the cell's "
                              "setup (a raise there stops the distributed stage and is checked for its origin)",
}


def real_driver_present() -> bool:
    if os.path.exists("/dev/nvidiactl"):
        return True
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=getattr(os, "RTLD_NOLOAD", 4))
    except OSError:
        return False
    # a libcuda is already loaded: ours carries a marker symbol, a real driver does not
    return not hasattr(lib, "audit_cudastub_marker")


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
        #: CUDA driver attributes of this SKU (CU_DEVICE_ATTRIBUTE_* names without the prefix) where they were
        #: measured on the real GPU; a library asking for one that is not here gets no answer
        self.attributes = dict(system.get("attributes") or {})
        self.attributes_source = system.get("attributes_source", "")

    def __repr__(self) -> str:
        return (f"_DeviceProperties(name={self.name!r}, major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory}, multi_processor_count={self.multi_processor_count})")


class SkuNotSet(SimulationLimit):
    """A device query answered before any SKU was set: the agent's shared parent imports modules for every SM
    with no SKU, so a module that reads the device there must be imported by each SM process instead."""


class _State:
    """The SKU and world size currently simulated (set per SM process and cell; read by every stand-in through
    :meth:`sku` and :meth:`world`, never through the attributes).

    Every read while no SKU is set is recorded (``reads_before_sku``) and raises :class:`SkuNotSet`: the shared
    parent checks the record after its imports, so a read a library swallowed is still seen. While
    ``learning`` is on (an SM process importing), each read also names the modules being imported at that
    moment (``readers``): those may depend on the SKU and are never imported before one is set."""

    props: _DeviceProperties | None = None
    world_size: int | None = None
    learning: bool = False
    readers: set = set()
    reads_before_sku: list = []

    @classmethod
    def set(cls, system: dict, world_size: int) -> None:
        if cls.props is not None and (cls.props.major, cls.props.minor) != tuple(system["capability"]):
            # import-time constants and cached selectors follow the first capability: never switch
            raise RuntimeError("the simulated capability cannot change inside one process")
        cls.props = _DeviceProperties(system)
        cls.world_size = int(world_size)

    @classmethod
    def sku(cls) -> _DeviceProperties:
        if cls.props is None or cls.learning:
            cls._read("device")
        return cls.props

    @classmethod
    def world(cls) -> int:
        if cls.world_size is None or cls.learning:
            cls._read("device count")
        return cls.world_size

    @classmethod
    def _read(cls, what: str) -> None:
        importing = importing_modules()
        if cls.learning:
            cls.readers.update(importing)
        if cls.props is None:
            cls.reads_before_sku.append({"what": what, "importing": importing})
            raise SkuNotSet(f"the simulated {what} was read before a SKU was set (while importing "
                            f"{', '.join(importing) or 'nothing'})")


class ImportOrder:
    """A meta-path finder that finds nothing: while ``_State.learning`` is on, it notes the order in which this
    process starts importing modules. A module that starts before the first module whose import reads the
    device finished before that one started, so it never depends on the SKU: the host shares that prefix.

    Only a real import counts: the import system's own loader asks the finders from ``_find_and_load_unlocked``.
    ``importlib.util.find_spec`` (torch._dynamo probes optional backends such as tvm that way) asks them too, for
    a package imported much later or never; noting it there would place it far too early. (``sys.modules``'
    order will not do either: the import system moves each module to the end when its import finishes.) On a
    Python whose loader is named otherwise nothing is noted, so nothing is shared: slower, never wrong."""

    order: list = []
    _seen: set = set()
    _LOADER = "_find_and_load_unlocked"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if _State.learning and name not in cls._seen:
            import sys

            if cls._real_import(sys._getframe(1)):
                cls._seen.add(name)
                cls.order.append(name)
        return None

    @classmethod
    def _real_import(cls, frame) -> bool:
        """Whether the finders are being asked for a real import: above this call, past the frames that only
        pass the question on (importlib's ``_find_spec`` and any finder's ``find_spec``, such as the post-import
        hooks' finder that asks the others itself), the asker is the import system's loader."""
        for _ in range(8):
            if frame is None:
                return False
            if frame.f_code.co_name not in ("find_spec", "_find_spec"):
                return frame.f_code.co_name == cls._LOADER
            if frame.f_code.co_name == "find_spec" and frame.f_code.co_filename.endswith(("importlib/util.py",
                                                                                         "importlib\\util.py")):
                return False  # importlib.util.find_spec: a probe
            frame = frame.f_back
        return False

    @classmethod
    def start(cls) -> None:
        import sys

        _State.learning = True
        if cls not in sys.meta_path:
            sys.meta_path.insert(0, cls)


def importing_modules() -> list[str]:
    """The modules whose import is running at this moment, outermost first: each ``<module>`` frame on the
    stack, and each module a post-import hook is patching (the hook runs after the module's own code)."""
    import sys

    names: list[str] = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code.co_name
        if code == "<module>":
            name = frame.f_globals.get("__name__", "?")
            if name not in ("__main__", "__mp_main__"):  # the agent's own entry point, not an import
                names.append(name)
        elif code == "exec_module":
            module = frame.f_locals.get("module")
            name = getattr(module, "__name__", None)
            if isinstance(name, str):
                names.append(name)
        frame = frame.f_back
    return list(dict.fromkeys(reversed(names)))


def set_simulated(system: dict, world_size: int) -> None:
    _State.set(system, world_size)


def simulate_torch() -> None:
    """Answer torch.cuda device queries for the simulated GPU."""
    import torch

    def get_device_capability(device=None):
        props = _State.sku()
        return (props.major, props.minor)

    def get_device_properties(device=None):
        return _State.sku()

    def get_device_name(device=None):
        return _State.sku().name

    def current_device():
        return 0

    def device_count():
        return _State.world()

    pair = fence.returns(tuple, check=lambda v: len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                   for x in v), what="torch.cuda.get_device_capability")
    count = fence.returns(int, check=lambda v: v >= 0, what="a device count or index")
    contracts = {"get_device_capability": pair, "get_device_properties": fence.returns(_DeviceProperties),
                 "get_device_name": fence.returns(str, check=bool, what="a device name"),
                 "current_device": count, "device_count": count}
    for name, fn in (("get_device_capability", get_device_capability),
                     ("get_device_properties", get_device_properties),
                     ("get_device_name", get_device_name),
                     ("current_device", current_device),
                     ("device_count", device_count)):
        setattr(torch.cuda, name, functools.wraps(fn)(fence.guard(f"torch.cuda.{name}", contract=contracts[name])(fn)))
        SIMULATED[f"torch.cuda.{name}"] = "simulated SKU"
    SIMULATED["torch.cuda.is_available"] = ("True on a simulated device count when vLLM sets "
                                            "PYTORCH_NVML_BASED_CUDA_CHECK=1 (as it does); no CUDA runtime")

    # torch.accelerator: the device index context is a host-side bookkeeping call on a GPU
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        import contextlib

        piece = "torch.accelerator.device_index/current_device_index"

        class _DeviceIndex(contextlib.AbstractContextManager):
            @fence.guard(piece)
            def __init__(self, idx=None):
                self.idx = idx

            @fence.guard(piece)
            def __exit__(self, *exc):
                return False

        acc.device_index = _DeviceIndex
        acc.current_device_index = fence.guard(piece)(lambda: 0)
        SIMULATED["torch.accelerator.device_index/current_device_index"] = "device 0, no CUDA init"

    # Triton: report the NVIDIA driver active, as on a GPU host (vllm.triton_utils.HAS_TRITON).
    try:
        from triton.backends.nvidia import driver as nv_driver

        nv_driver.CudaDriver.is_active = staticmethod(fence.guard("triton.backends.nvidia.driver:CudaDriver.is_active")(
            lambda: True))
        SIMULATED["triton.backends.nvidia.driver:CudaDriver.is_active"] = "True"
    except Exception as exc:  # recorded through SIMULATED
        SIMULATED["triton.backends.nvidia.driver:CudaDriver.is_active"] = f"not patched: {exc!r}"


def install_platform():
    """Install a subclass of vLLM's real non-NVML CUDA platform as the current platform."""
    import vllm.platforms as platforms
    from vllm.platforms import cuda as vcuda
    from vllm.platforms.interface import DeviceCapability

    base = vcuda.NonNvmlCudaPlatform
    P = _State

    overrides = {
        "get_device_capability": lambda cls, device_id=0: DeviceCapability(major=P.sku().major, minor=P.sku().minor),
        "get_device_name": lambda cls, device_id=0: P.sku().name,
        "get_device_uuid": lambda cls, device_id=0: P.sku().uuid,
        "get_device_total_memory": lambda cls, device_id=0: P.sku().total_memory,
        "device_count": lambda cls: P.world(),
        "is_fully_connected": lambda cls, *a, **k: True,
        "get_device_numa_node": lambda cls, device_id=0: None,
        "get_all_device_numa_nodes": lambda cls: None,
        "num_compute_units": lambda cls, device_id=0: P.sku().multi_processor_count,
        "is_integrated_gpu": lambda cls, device_id=0: False,
        "is_arch_support_pdl": lambda cls: P.sku().major >= 9,
    }
    positive = fence.returns(int, check=lambda v: v > 0)
    flag = fence.returns(bool)
    # what each replaced method of vLLM's platform returns (vllm/platforms/interface.py), checked on every answer
    contracts = {"get_device_capability": fence.returns(DeviceCapability, check=lambda v: all(
                     isinstance(x, int) and not isinstance(x, bool) for x in (v.major, v.minor)),
                     what="vLLM's get_device_capability"),
                 "get_device_name": fence.returns(str, check=bool), "get_device_uuid": fence.returns(str, check=bool),
                 "get_device_total_memory": positive, "device_count": positive, "num_compute_units": positive,
                 "is_fully_connected": flag, "is_integrated_gpu": flag, "is_arch_support_pdl": flag,
                 "get_device_numa_node": fence.returns(int, type(None)),
                 "get_all_device_numa_nodes": fence.returns(list, type(None))}
    ns: dict = {"__module__": __name__, "__qualname__": "SimulatedCudaPlatform"}
    for name, fn in overrides.items():
        if hasattr(base, name):
            ns[name] = classmethod(fence.guard(f"vllm.platforms.cuda:CudaPlatform.{name}",
                                               contract=contracts.get(name))(fn))
            SIMULATED[f"vllm.platforms.cuda:CudaPlatform.{name}"] = "simulated SKU"
    cls = type("SimulatedCudaPlatform", (base,), ns)
    instance = cls()
    platforms._current_platform = instance
    return instance


def is_cuda_device(dev) -> bool:
    """Whether a ``device`` argument names a CUDA device (a torch.device, ``"cuda"``/``"cuda:N"``, an index)."""
    import torch

    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int)


def fake_world(world: int) -> None:
    """This process as rank 0 of *world* on torch's fake process group, every further group fake too (a fenced
    stand-in for ``torch.distributed.new_group``), stated in :data:`SIMULATED`."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    real_new_group = dist.new_group

    @fence.guard("torch.distributed")
    def new_group(ranks=None, *args, **kwargs):
        kwargs["backend"] = "fake"
        return fence.foreign(real_new_group, ranks, *args, **kwargs)

    dist.new_group = new_group
    SIMULATED["torch.distributed"] = f"fake process group, this process is rank 0 of {world}"


def meta_device_mode():
    """The meta device as the default device (``with torch.device("meta")``), plus explicit
    ``device='cuda'`` allocations sent to the meta device too.

    One mode does both: it *is* torch's own default-device mode (a ``DeviceContext`` subclass, entered the
    same way, so ``torch.get_default_device()`` and nested ``with torch.device(...)`` behave as they do under
    ``torch.device("meta")``), and it also rewrites a CUDA ``device`` argument. Stacking a second mode on top of
    ``torch.device("meta")`` did the same with one more Python dispatch per tensor operation, which vLLM's
    per-expert post-load loops (~80k calls a cell for Marlin on SM 8.9) paid in full."""
    import torch
    from torch.utils._device import DeviceContext, _device_constructors

    meta = torch.device("meta")
    _is_cuda = is_cuda_device

    ctors = _device_constructors()  # torch's own set of factory functions (cached, the same object every call)

    class _MetaDevice(DeviceContext):
        # called for every tensor operation while a model is built or converted: the common case (no keyword
        # arguments, not a factory) returns after one set lookup
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            if not kwargs:
                return func(*args, device=meta) if func in ctors else func(*args)
            device = kwargs.get("device")
            if device is None:
                if func in ctors:
                    kwargs["device"] = meta
            elif _is_cuda(device):
                kwargs["device"] = meta
            return func(*args, **kwargs)

    SIMULATED["torch: device='cuda' allocations"] = "redirected to the meta device"
    return _MetaDevice(meta)


def stand_in_cuda_streams() -> None:
    """torch.cuda.Stream/Event need a device; construction only stores them, never launches."""
    import torch

    guard = fence.guard("torch.cuda.Stream/Event")

    class _Stream:
        @guard
        def __init__(self, *a, **k):
            pass

        @guard
        def wait_stream(self, *a, **k):
            pass

    class _Event:
        @guard
        def __init__(self, *a, **k):
            pass

        @guard
        def record(self, *a, **k):
            pass

        @guard
        def wait(self, *a, **k):
            pass

    torch.cuda.Stream = _Stream  # type: ignore[assignment]
    torch.cuda.Event = _Event  # type: ignore[assignment]
    SIMULATED["torch.cuda.Stream/Event"] = "inert stand-ins (construction stores them; nothing runs)"





#: Objects that, on a GPU, allocate device memory or compile kernels when constructed. Each is
#: replaced by a stand-in that records its constructor arguments; vLLM's checks before and around
#: them still run. Applied when the defining module is imported. None of vLLM's shared layers needs one
#: today; a model's probes package lists its own (``STAND_INS``).
STAND_INS: tuple[str, ...] = ()

#: constructor calls the stand-ins received: (qualname, kwargs names)
STAND_IN_CALLS: list[dict] = []


def _make_stand_in(qualname: str, original: type) -> type:
    @fence.guard(qualname)
    def __init__(self, *args, **kwargs):
        STAND_IN_CALLS.append({"cls": qualname, "args": len(args), "kwargs": sorted(kwargs)})

    @fence.guard(qualname)
    def __getattr__(self, item):
        raise fence.deliberate(AttributeError(f"{qualname} is a resolve-mode stand-in; {item!r} is not simulated"))

    return type(original.__name__, (), {"__init__": __init__, "__getattr__": __getattr__,
                                         "__module__": original.__module__,
                                         "__qualname__": original.__qualname__,
                                         "__serving_truth_stand_in__": qualname})


def install_stand_ins(hooks, model: tuple[str, ...] = ()) -> None:
    """Register post-import hooks that swap each STAND_INS class (and each of the model's) for a recording
    stand-in."""
    for spec in STAND_INS + tuple(model):
        module, _, name = spec.partition(":")

        def swap(mod, name=name, spec=spec):
            original = getattr(mod, name, None)
            if fence.fits(spec, mod, name) and isinstance(original, type):
                setattr(mod, name, _make_stand_in(spec, original))

        # declared up front, so the record does not depend on which process imported the module
        SIMULATED[spec] = "stand-in that records its constructor arguments, where vLLM builds it (no kernel built)"
        fence.register(spec, "stand-in")
        hooks.register(module, swap, piece=f"install {spec}")


def install_in_process_registry(hooks) -> None:
    """vLLM inspects model classes in a fresh subprocess (so the frontend never initialises CUDA).
    That subprocess would not carry the simulated platform, and K3's package picks its NVIDIA or
    AMD implementation at import time by platform, so resolve mode runs the inspection in-process,
    under the same simulated GPU."""
    import functools

    def patch(mod):
        original = getattr(mod, "_run_in_subprocess", None)
        if not fence.fits("vllm registry model inspection", mod, "_run_in_subprocess"):
            SIMULATED["vllm registry model inspection"] = "NOT redirected: _run_in_subprocess not found"
            return

        @functools.wraps(original)
        @fence.guard("vllm registry model inspection")
        def in_process(fn):
            return foreign(fn)

        mod._run_in_subprocess = in_process

    SIMULATED["vllm registry model inspection"] = ("run in-process under the simulated platform "
                                                   "(vLLM uses a subprocess to avoid CUDA init)")
    fence.register("vllm registry model inspection", "stand-in")
    hooks.register("vllm.model_executor.models.registry", patch, piece="install vllm registry model inspection")


#: GPUs per node of the simulated systems (every system the audit covers is an 8-GPU node)
GPUS_PER_NODE = 8


def install_node_topology(hooks) -> None:
    """``in_the_same_node_as`` is a collective over real peers (shared memory); with a fake process
    group it reads garbage and can try to allocate terabytes. Answer it from the layout instead:
    rank r lives on node r // GPUS_PER_NODE."""
    import functools

    def patch(mod):
        original = getattr(mod, "in_the_same_node_as", None)
        if not fence.fits(NODE_TOPOLOGY, mod, "in_the_same_node_as"):
            return

        @functools.wraps(original)
        @fence.guard(NODE_TOPOLOGY)
        def in_the_same_node_as(pg, source_rank: int = 0):
            import torch.distributed as dist

            if not isinstance(pg, dist.ProcessGroup):
                return foreign(original, pg, source_rank)
            ranks = dist.get_process_group_ranks(pg)
            node = ranks[source_rank] // GPUS_PER_NODE
            return [r // GPUS_PER_NODE == node for r in ranks]

        mod.in_the_same_node_as = in_the_same_node_as
        from probes.core.patching import rebind

        rebind(original, in_the_same_node_as, ("vllm",), skip=mod)

    SIMULATED[NODE_TOPOLOGY] = (
        f"answered from the layout ({GPUS_PER_NODE} GPUs per node), not a shared-memory collective")
    fence.register(NODE_TOPOLOGY, "stand-in")
    hooks.register("vllm.distributed.parallel_state", patch, piece=f"install {NODE_TOPOLOGY}")


NODE_TOPOLOGY = "vllm.distributed.parallel_state:in_the_same_node_as"
