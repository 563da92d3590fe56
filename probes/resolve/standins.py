"""Resolve mode's stand-ins for what vLLM's post-load reaches below itself: device queries, kernels and compiled
helpers.

vLLM's post-load converts each weight into the layout the chosen kernel reads, and builds the kernel
objects. Below vLLM, libraries ask the device (FlashInfer, Humming) or launch a kernel that only moves
values into a new layout (FlashInfer's scale swizzle, Humming's weight repack, DeepGEMM's scale
transform); vLLM compiles some of its own helpers with ``torch.compile``. On the meta device the values do
not exist, so only two things are needed to go on: the question answered for the simulated SKU, and the
output tensor with the shape and dtype the library (or vLLM's helper) gives it. Each stand-in here does one
of those and nothing else:

* a **device query** is answered from the simulated SKU (its capability, or a driver attribute measured on
  the real GPU; an attribute nobody measured raises, so nothing is guessed);
* a **kernel** writes nothing: the library's own Python allocates its output (FlashInfer), or the library
  runs its own op on fake CUDA tensors, where it skips the kernel by design (Humming), or a meta kernel
  gives the output shape the op's upstream code gives (DeepGEMM, cited at the kernel);
* a **compiled helper** (vLLM's own Python under ``torch.compile``) runs eagerly, uncompiled: the same torch
  ops on meta tensors, with no device for Inductor to compile for;
* anything a kernel *returns* besides its output buffer is :class:`Poison`: using it raises, so a stand-in
  never answers a size, a flag or a support question in the library's place.

Each is declared (:func:`declare`): a post-import hook on the module that defines its target, fenced, and
listed in ``SIMULATED`` (the ledger's "What was simulated") whether or not a cell reaches it, and counted when it
runs (``KERNEL_CALLS``). A refusal vLLM raises after any of them still raises: they decide nothing.
Imported only by the resolve agent, inside the pinned environment.
"""
from __future__ import annotations

import functools

from probes.core import fence
from probes.core.fence import NoDeviceCode, SimulationLimit, deliberate, foreign
from probes.resolve import simulate
from probes.resolve.simulate import SIMULATED

#: stand-in kernel entry points that ran, with how often (recorded in the evidence's simulated list)
KERNEL_CALLS: dict[str, int] = {}


def _count(label: str) -> None:
    KERNEL_CALLS[label] = KERNEL_CALLS.get(label, 0) + 1


class Poison:
    """What an inert kernel returns: any use of the value raises."""

    def __init__(self, what: str):
        object.__setattr__(self, "_what", what)

    def _refuse(self, *a, **k):
        raise SimulationLimit(f"{object.__getattribute__(self, '_what')} is a resolve-mode stand-in: its result is "
                              "not simulated")

    __bool__ = __int__ = __float__ = __index__ = __len__ = __iter__ = __getitem__ = __call__ = _refuse
    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __add__ = __mul__ = __hash__ = _refuse

    def __getattr__(self, item):
        self._refuse()


def declare(hooks, module: str, piece: str, patch, simulated: str) -> None:
    """One stand-in: listed in ``SIMULATED`` with why it is shape-only, fenced as *piece*, and installed by *patch*
    when *module* is imported."""
    SIMULATED[piece] = simulated
    fence.register(piece, "stand-in")
    hooks.register(module, patch, piece=f"install {piece}")


# -- device queries about a tensor's device ---------------------------------------------------------------------

#: Calls that receive the device a tensor lives on where, on a GPU, weights sit on cuda:<local rank>;
#: under meta construction they get "meta". The argument is passed as rank 0's device (cuda:0) so the
#: code behind it runs as on a GPU: its own checks, and the device queries the simulated SKU answers.
#: (module, qualname, argument, why); the qualname may list alternatives separated by ``|``, tried in order:
#: the first that fits (:func:`fit`) is the one translated. (A model's probes package lists its own calls the
#: same way: ``META_DEVICE_ARGS``.)
META_DEVICE_ARGS: tuple[tuple[str, str, str, str], ...] = (
    ("flashinfer.utils", "get_compute_capability", "device",
     "FlashInfer's capability query for the device a weight lives on (it picks the arch of its kernels, "
     "e.g. block_scale_interleave at MXFP4 weight conversion): the simulated SKU answers"),
    # humming-kernels 0.1.17 (vLLM 0.32) takes the device in __init__ and defines no __new__; later releases
    # take it in __new__
    ("humming.device", "DeviceInfo.__new__|DeviceInfo.__init__", "index",
     "Humming's device-info object for the device a weight lives on: the simulated SKU answers"),
)

#: how each stand-in's target fitted this release: the fence's record (probes.core.fence.fits), one per process
FIT = fence.FIT


def fit(mod, qualname: str, arg: str) -> tuple[object, str]:
    """Whether ``mod.<qualname>`` has the shape a meta-device translation expects: a callable defined by the
    class (or module) the qualname names itself, not inherited (``object.__new__`` is no Humming code), whose
    signature takes *arg*. Returns ((owner, name, raw, signature) or None, "fits" or what does not fit)."""
    import inspect

    parts = qualname.split(".")
    owner = mod
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None, f"{mod.__name__} has no {'.'.join(parts[:-1])}"
    name = parts[-1]
    raw = vars(owner).get(name) if isinstance(owner, type) or owner is mod else None
    if raw is None:
        where = f"{mod.__name__}:{'.'.join(parts[:-1]) or mod.__name__}"
        return None, f"{where} defines no {name} of its own"
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if not callable(fn):
        return None, f"{qualname} is not callable"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, f"{qualname} has no readable signature"
    if arg not in sig.parameters:
        return None, f"{qualname}{sig} takes no argument {arg!r}"
    return (owner, name, raw, sig), "fits"


def install_meta_device_args(hooks, model: tuple = ()) -> None:
    for module, qualnames, arg, why in tuple(model) + META_DEVICE_ARGS:
        piece = f"{module}:{qualnames}({arg}=...)"

        def patch(mod, qualnames=qualnames, arg=arg, piece=piece):
            from probes.core.patching import rebind

            misfits = []
            for qualname in qualnames.split("|"):
                found, why_not = fit(mod, qualname, arg)
                if found is not None:
                    break
                misfits.append(why_not)
            else:
                FIT[piece] = (f"does not fit {fence.installed_version(mod)}: " + "; ".join(misfits)
                              + " (not applied: a meta device reaches the call unchanged)")
                return
            FIT[piece] = f"fits {fence.installed_version(mod)} as {qualname}" + (
                f" ({'; '.join(misfits)})" if misfits else "")
            owner, name, raw, sig = found
            fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw

            @functools.wraps(fn)
            @fence.guard(piece)
            def translated(*args, **kwargs):
                import torch

                try:
                    bound = sig.bind(*args, **kwargs)
                except TypeError:
                    return foreign(fn, *args, **kwargs)
                dev = bound.arguments.get(arg)
                if isinstance(dev, torch.device) and dev.type == "meta":
                    bound.arguments[arg] = torch.device("cuda", 0)
                return foreign(fn, *bound.args, **bound.kwargs)

            kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
            setattr(owner, name, kind(translated) if kind else translated)
            if owner is mod:  # a module-level function: also the copies ``from x import f`` made
                rebind(raw, translated, (mod.__name__.split(".")[0],), skip=mod)

        declare(hooks, module, piece, patch, f"a meta-device argument is passed as cuda:0: {why}")


def install_cuda_device_context(hooks) -> None:
    """``with torch.cuda.device(i):`` selects the current device (host bookkeeping; on a GPU, the context
    switch). Entering it initialises CUDA, which the simulation has none of: device 0 stays current."""
    import torch

    cls = torch.cuda.device
    piece = "torch.cuda.device (context manager)"

    @fence.guard(piece)
    def __enter__(self):
        self.prev_idx = 0
        return self

    @fence.guard(piece)
    def __exit__(self, *exc):
        return False

    cls.__enter__, cls.__exit__ = __enter__, __exit__
    SIMULATED["torch.cuda.device (context manager)"] = ("current-device bookkeeping only: device 0 stays "
                                                        "current, no CUDA initialisation")


# -- Humming: device attributes, and its ops on meta tensors ---------------------------------------------------

#: Humming's device-info fields -> the CUDA driver attribute it reads for each (humming csrc/device_info.cpp,
#: query_device_data); the name comes from cuDeviceGetName
HUMMING_ATTRIBUTES = {
    "sm_count": "MULTIPROCESSOR_COUNT", "max_threads_per_block": "MAX_THREADS_PER_BLOCK",
    "max_threads_per_sm": "MAX_THREADS_PER_MULTIPROCESSOR",
    "max_registers_per_sm": "MAX_REGISTERS_PER_MULTIPROCESSOR",
    "sm_major": "COMPUTE_CAPABILITY_MAJOR", "sm_minor": "COMPUTE_CAPABILITY_MINOR",
    "l2_cache_size": "L2_CACHE_SIZE", "default_smem_size": "MAX_SHARED_MEMORY_PER_BLOCK",
    "max_smem_size": "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "memory_clock_khz": "MEMORY_CLOCK_RATE",
    "memory_bus_width": "GLOBAL_MEMORY_BUS_WIDTH", "sm_clock_khz": "CLOCK_RATE",
}


#: fields Humming derives in its extension that are not given here (reading one raises: not simulated)
HUMMING_DERIVED = ("l2_cache_size_mb", "l1_cache_size", "l1_cache_size_kb", "max_smem_size_kb", "tensorcore_tops",
                   "memory_bandwidth_gbps")


HUMMING_DEVICE = "humming device info (csrc/device_info.cpp extension)"
HUMMING_OPS = "humming.ops (weight layout ops)"


class SimulatedHummingDevice:
    """Humming's ``_DeviceInfo`` for the simulated SKU: the driver attributes measured on the real GPU, read
    the way Humming's extension reads them. One Humming derives itself from them is given here by its
    definition (DDR memory bandwidth: clock x 2 x bus width); any other field raises."""

    @fence.guard(HUMMING_DEVICE)
    def __init__(self, index: int = 0):
        props = simulate._State.sku()
        self.index = index
        self._name = props.name
        self._attrs = props.attributes
        self._where = props.attributes_source or "no measured attribute set"

    def _attr(self, driver_name: str):
        p = simulate._State.sku()
        if driver_name in ("COMPUTE_CAPABILITY_MAJOR", "COMPUTE_CAPABILITY_MINOR"):  # the simulated SKU's own
            return p.major if driver_name.endswith("MAJOR") else p.minor
        if driver_name == "MULTIPROCESSOR_COUNT":
            return p.multi_processor_count
        if driver_name not in self._attrs:
            raise SimulationLimit(f"device attribute {driver_name} of the simulated {self.name} is not known "
                                  f"({self._where}): not simulated")
        return self._attrs[driver_name]

    @fence.guard(HUMMING_DEVICE)
    def __getattr__(self, item):
        if item.startswith("_"):
            raise deliberate(AttributeError(item))
        value = self._field(item)
        from probes.resolve import memo

        memo.note_fact(item, value)
        return value

    def _field(self, item):
        if item in HUMMING_ATTRIBUTES:
            return self._attr(HUMMING_ATTRIBUTES[item])
        if item == "name":
            return self._name
        if item == "is_ppu":  # what Humming's extension derives from the name
            return self._name.startswith(("PPU", "ZW"))
        if item == "index":
            return self.index
        if item == "sm_version":
            return self.sm_major * 10 + self.sm_minor
        if item == "memory_bandwidth_gbps" and self.sm_version != 121:
            return self.memory_clock_khz * 2 * self.memory_bus_width / 8.0 / 1e6
        if item in HUMMING_DERIVED:
            raise SimulationLimit(f"Humming's device field {item!r} is not simulated")
        raise deliberate(AttributeError(item))


def install_humming(hooks) -> None:
    def device_info(mod):
        from probes.core.patching import rebind

        if not fence.fits(HUMMING_DEVICE, mod, "_get_device_info_extension"):
            return
        original = mod._get_device_info_extension
        ext = type("SimulatedDeviceInfoExtension", (), {"_DeviceInfo": SimulatedHummingDevice})

        @functools.wraps(original)
        @fence.guard(HUMMING_DEVICE)
        def extension():
            return ext

        mod._get_device_info_extension = extension
        rebind(original, extension, ("humming",), skip=mod)

    SIMULATED[HUMMING_DEVICE] = (
        "answered from the simulated SKU's CUDA driver attributes, measured on the real GPU (an attribute not "
        "measured for the SKU raises)")
    hooks.register("humming.utils.device", device_info, piece=f"install {HUMMING_DEVICE}")

    def ops(mod):
        names = ("repack_weight", "pack_weight", "unpack_weight", "process_mxfp4_w4a8_weight", "quant_weight",
                 "dequant_weight")
        present = [n for n in names if callable(getattr(mod, n, None))]
        fence.fits(HUMMING_OPS, mod, *(present or names[:1]))  # at least one layout op; each present one wrapped
        for name in present:
            setattr(mod, name, on_fake_cuda(getattr(mod, name), f"humming.ops.{name}", piece=HUMMING_OPS))

    declare(hooks, "humming.ops", HUMMING_OPS, ops,
            "given meta tensors, Humming's own op runs on fake CUDA tensors of the same shapes (torch's "
            "FakeTensor): it computes and checks its output shape and skips its kernel, as it does under "
            "torch.compile tracing")


def humming_facts(fields: list[str]) -> dict:
    """The simulated SKU's values for Humming device fields (what the memo compares)."""
    dev = SimulatedHummingDevice()
    return {f: dev._field(f) for f in fields}


def on_fake_cuda(fn, label: str, *, piece: str = ""):
    """``fn`` as it runs for torch.compile's tracing: meta tensors passed as fake CUDA tensors (rank 0's
    device) of the same metadata, fake results handed back as meta tensors. The library's own shape code and
    checks run; a library that launches a kernel for a fake tensor is not one to use this for."""

    @functools.wraps(fn)
    @fence.guard(piece or label)
    def call(*args, **kwargs):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        def metas(x):
            return isinstance(x, torch.Tensor) and x.is_meta

        if not any(metas(a) for a in (*args, *kwargs.values())):
            return foreign(fn, *args, **kwargs)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cuda = torch.device("cuda", 0)
        to_fake = lambda x: FakeTensor(mode, x, cuda) if metas(x) else x
        with mode:
            out = foreign(fn, *[to_fake(a) for a in args], **{k: to_fake(v) for k, v in kwargs.items()})
        _count(label)

        def to_meta(x):
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
            if isinstance(x, (tuple, list)):
                return type(x)(to_meta(v) for v in x)
            return x

        return to_meta(out)

    return call


# -- FlashInfer: JIT kernel libraries that load nothing ------------------------------------------------------------

class InertKernels:
    """A compiled kernel library that loads nothing: every entry point writes nothing and returns
    :class:`Poison`. The Python around it (FlashInfer's own wrappers) allocates each output with the shape
    and dtype it computes, so a caller sees the shapes the real kernels would fill."""

    def __init__(self, name: str, piece: str = ""):
        self._name = name
        self._piece = piece

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        label = f"{self._name}.{item}"

        @fence.guard(self._piece)
        def kernel(*args, **kwargs):
            _count(label)
            return Poison(label)

        kernel.__name__ = item
        return kernel


class _InertJitSpec:
    def __init__(self, name: str, piece: str):
        self.name = name
        self.piece = piece

    def build_and_load(self):
        return fence.guard(self.piece)(InertKernels)(self.name, self.piece)


#: JIT kernel libraries vLLM's post-load reaches for weight-layout kernels: (module, generator functions, why
#: no kernel is needed for the output's shape). Each generator returns a spec that "loads" InertKernels.
INERT_JIT: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("flashinfer.quantization.fp4_quantization",
     tuple(f"gen_fp4_quantization_sm{a}_module" for a in ("90", "100", "103", "107", "110", "120", "120f", "121")),
     "FlashInfer's FP4 quantization kernels (block_scale_interleave swizzles MXFP4 weight scales at load): "
     "FlashInfer's wrapper allocates the swizzled buffer with the size it computes; the kernel only "
     "permutes and pads values into it"),
)


def install_inert_jit(hooks) -> None:
    for module, generators, why in INERT_JIT:
        piece = f"{module}: JIT kernel libraries"

        def patch(mod, generators=generators, piece=piece):
            present = [g for g in generators if callable(getattr(mod, g, None))]
            fence.fits(piece, mod, *(present or generators[:1]))  # at least one generator of this release
            for gen in present:
                setattr(mod, gen, fence.guard(piece)(lambda gen=gen: _InertJitSpec(f"{mod.__name__}:{gen}", piece)))

        declare(hooks, module, piece, patch, f"inert (load nothing, write nothing): {why}")


# -- DeepGEMM: the scale-factor layout transform --------------------------------------------------------------

def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _align(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def transform_sf_meta(sf, mn, k, recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False, psum_layout=None,
                      *, archs: frozenset = frozenset()):
    """The output of DeepGEMM's ``transform_sf_into_required_layout`` for a meta ``sf``, as its upstream code
    gives it (deepseek-ai/DeepGEMM csrc/apis/layout.hpp ``transform_sf_into_required_layout``, csrc/utils/
    layout.hpp ``check_sf_layout``, csrc/jit_kernels/impls/smxx_layout.hpp ``get_mn_major_tma_aligned_tensor``
    and ``get_mn_major_tma_aligned_packed_ue8m0_tensor``; the branches below are the same in every release of
    that file, 2025-08 to 2026-06), checks included:

    * FP32 scales, granularity (1, 128), on SM 9 or with the UE8M0 cast disabled: the MN-major TMA-aligned FP32
      layout, strides (sf_k * align(mn, 4), 1, align(mn, 4));
    * FP32 scales, granularity (128, 128), on SM 9 or with the cast disabled: ``sf`` itself, once it passes the
      SM 9.0 weight-scale check (contiguous, or contiguous with its last two dimensions transposed);
    * FP32 scales, K granularity 32 or 128, on SM 10 / 12: the packed UE8M0 layout, int32 of shape
      (groups, mn, ceil(sf_k / 4)) with strides (ceil(sf_k / 4) * align(mn, 4), 1, align(mn, 4)); with the cast
      disabled DeepGEMM refuses (its own assertion);
    * already-packed int32 scales, granularity (1, 32 or 128), on SM 10 / 12: ``sf`` itself, once its strides
      pass the TMA check.

    ``archs``: the SM majors the compiled DeepGEMM carries this code for (:func:`_compiled_archs`); any other
    SM, and any case outside the branches above, raises :class:`SimulationLimit`: it is not simulated."""
    import torch

    if len(recipe) == 3:
        if is_sfa is None:
            raise deliberate(RuntimeError("DeepGEMM: a 3-part recipe needs is_sfa"))
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    else:
        if is_sfa is not None:
            raise deliberate(RuntimeError("DeepGEMM: a 2-part recipe takes no is_sfa"))
        gran_mn, gran_k = recipe

    def refuse(check: str):
        raise deliberate(RuntimeError(f"DeepGEMM check_sf_layout: {check} fails for scales {tuple(sf.shape)} with "
                                      f"strides {tuple(sf.stride())} (mn={mn}, k={k}, granularity ({gran_mn}, "
                                      f"{gran_k}), num_groups={num_groups})"))

    if sf.dtype not in (torch.float32, torch.int32):
        raise deliberate(RuntimeError(f"DeepGEMM check_sf_layout: scale dtype {sf.dtype}"))
    checks = [sf.dim() == (2 + (num_groups is not None)),
              num_groups is None or sf.size(-3) == num_groups,
              sf.size(-2) == _ceil_div(mn, gran_mn),
              sf.size(-1) == _ceil_div(k, gran_k * (1 if sf.dtype == torch.float32 else 4))]
    if not all(checks):
        raise deliberate(RuntimeError(f"DeepGEMM check_sf_layout: scale shape {tuple(sf.shape)} does not fit mn={mn}, "
                                      f"k={k}, granularity ({gran_mn}, {gran_k}), num_groups={num_groups}"))
    arch = simulate._State.sku().major
    _count("deep_gemm transform_sf_into_required_layout (meta)")
    if arch not in archs:  # what DeepGEMM ships decides: on the device this is where loading the weights fails
        raise NoDeviceCode(f"DeepGEMM (vendored in vLLM) has no code for SM {arch}.x: it compiles its kernels at run "
                           f"time, and its compiled host code admits SM {', '.join(str(a) for a in sorted(archs))} only "
                           f"(its scale layout transform, called at load, rejects SM {arch}.x)")
    fp32 = sf.dtype == torch.float32
    aligned = _align(mn, 4)  # TMA alignment: 16 bytes of 4-byte scales
    if fp32 and gran_k == 128 and gran_mn in (1, 128) and (arch == 9 or disable_ue8m0_cast):
        if gran_mn == 128:  # the SM 9.0 weight-scale check, then the scales as they are
            if num_groups is not None and sf.stride(-3) != sf.size(-2) * sf.size(-1):
                refuse("stride(-3) == size(-2) * size(-1)")
            if not ((sf.stride(-1) == 1 and sf.stride(-2) == sf.size(-1))
                    or (sf.stride(-1) == sf.size(-2) and sf.stride(-2) == 1)):
                refuse("contiguous, or contiguous with the last two dimensions transposed")
            return sf
        batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
        groups, sf_k = batched.size(0), batched.size(2)
        if ((batched.stride(0) == aligned * sf_k or sf.dim() == 2) and batched.stride(1) == 1
                and batched.stride(2) == aligned):
            return sf  # already MN-major and TMA-aligned: returned as it is
        out = torch.empty_strided((groups, mn, sf_k), (aligned * sf_k, 1, aligned), dtype=torch.float32,
                                  device="meta")
        return out if sf.dim() == 3 else out.squeeze(0)
    if fp32 and gran_k in (32, 128) and arch in (10, 12):
        if disable_ue8m0_cast:
            raise deliberate(RuntimeError("DeepGEMM: the packed UE8M0 layout needs the UE8M0 cast"))
        if psum_layout is not None:
            raise SimulationLimit("DeepGEMM's PSUM scale layout is not simulated")
        groups = sf.size(0) if sf.dim() == 3 else 1
        packed = _ceil_div(sf.size(-1), 4)
        out = torch.empty_strided((groups, mn, packed), (packed * aligned, 1, aligned), dtype=torch.int32,
                                  device="meta")
        return out if sf.dim() == 3 else out.squeeze(0)
    if sf.dtype == torch.int32 and gran_mn == 1 and gran_k in (32, 128) and arch in (10, 12):
        if num_groups is not None and sf.stride(-3) != sf.stride(-1) * sf.size(-1):
            refuse("stride(-3) == stride(-1) * size(-1)")
        if not (sf.stride(-2) == 1 or mn == 1):
            refuse("MN-major (stride(-2) == 1)")
        if sf.stride(-1) != aligned:
            refuse(f"TMA-aligned (stride(-1) == {aligned})")
        return sf
    raise SimulationLimit(f"DeepGEMM's {sf.dtype} scale transform with granularity ({gran_mn}, {gran_k}) on "
                          f"SM {arch}.x{' with the UE8M0 cast disabled' if disable_ue8m0_cast else ''} is not "
                          "simulated")


def _compiled_archs(package_dir: str) -> frozenset:
    """The SM majors a DeepGEMM build has code for (:func:`probes.core.elfscan.deep_gemm_sm_majors`)."""
    from probes.core.elfscan import deep_gemm_sm_majors

    return frozenset(deep_gemm_sm_majors(package_dir))


_LIBS: list = []  # torch.library registrations stay alive with the process
DEEP_GEMM = "deep_gemm:transform_sf_into_required_layout"


def install_deep_gemm(hooks) -> None:
    def package(mod):
        import os

        import torch

        if not fence.fits(DEEP_GEMM, mod, "__file__"):
            return
        archs = _compiled_archs(os.path.dirname(mod.__file__))
        fake = fence.guard(DEEP_GEMM)(functools.partial(transform_sf_meta, archs=archs))
        op = getattr(getattr(torch.ops, "deep_gemm", None), "transform_sf_into_required_layout", None)
        if op is not None and not _LIBS:  # a TORCH_LIBRARY build (vLLM 0.32+): a Meta kernel for the op
            lib = torch.library.Library("deep_gemm", "IMPL")
            lib.impl("transform_sf_into_required_layout", fake, "Meta")
            _LIBS.append(lib)
        original = getattr(mod, "transform_sf_into_required_layout", None)
        if op is None and not fence.fits(DEEP_GEMM, mod, "transform_sf_into_required_layout"):
            return  # neither a registered op nor the Python attribute: named as a misfit
        if callable(original) and op is None:  # a pybind build: the Python attribute callers reach it through
            mod.transform_sf_into_required_layout = _meta_or(original, fake)

    def vllm_helper(mod):  # vLLM keeps its own reference, taken when it first imports DeepGEMM
        if not fence.fits(f"{DEEP_GEMM} (vllm.utils.deep_gemm)", mod, "_lazy_init"):
            return
        original = mod._lazy_init

        @functools.wraps(original)
        @fence.guard(DEEP_GEMM)
        def _lazy_init(*args, **kwargs):
            out = foreign(original, *args, **kwargs)
            impl = getattr(mod, "_transform_sf_into_required_layout_impl", None)
            dg = foreign(mod._import_deep_gemm) if hasattr(mod, "_import_deep_gemm") else None
            if impl is not None and dg is not None and impl is not getattr(dg, "transform_sf_into_required_layout", impl):
                mod._transform_sf_into_required_layout_impl = dg.transform_sf_into_required_layout
            return out

        mod._lazy_init = _lazy_init

    for name in ("deep_gemm", "vllm.third_party.deep_gemm"):
        hooks.register(name, package, piece=f"install {DEEP_GEMM} ({name})")
    hooks.register("vllm.utils.deep_gemm", vllm_helper, piece=f"install {DEEP_GEMM} (vllm.utils.deep_gemm)")
    fence.register(DEEP_GEMM, "stand-in")
    SIMULATED[DEEP_GEMM] = (
        "meta kernel: the output shape, strides and dtype DeepGEMM's upstream code gives (checks included), for "
        "the SM majors its compiled extension carries code for; it only lays scale factors out for the kernel")


def _meta_or(original, fake):
    @functools.wraps(original)
    @fence.guard(DEEP_GEMM)
    def call(sf, *args, **kwargs):
        return fake(sf, *args, **kwargs) if getattr(sf, "is_meta", False) else foreign(original, sf, *args, **kwargs)

    return call


# -- torch.compile'd helpers vLLM's post-load calls --------------------------------------------------------------

#: vLLM helpers compiled with ``torch.compile`` that its post-load calls on weights: (module, function, why). On a
#: GPU, Inductor compiles each into a kernel on first call; here there is no device to compile for (dynamo raises
#: from torch.cuda's initialisation). Each runs as the Python vLLM wrote, eagerly on the meta tensors: the same
#: torch ops, so the same output shapes and dtypes, and whatever it checks or raises it still does.
EAGER_COMPILED: tuple[tuple[str, str, str], ...] = (
    ("vllm.utils.deep_gemm", "per_block_cast_to_fp8",
     "re-quantizes a block-FP8 weight with power-of-two (UE8M0) scales when vLLM uses DeepGEMM's UE8M0 format "
     "(requant_weight_ue8m0_inplace at FP8 weight processing)"),
)


def install_eager_compiled(hooks) -> None:
    for module, name, why in EAGER_COMPILED:
        piece = f"{module}:{name} (torch.compile)"

        def patch(mod, name=name, piece=piece):
            from probes.core.patching import rebind

            if not fence.fits(piece, mod, name):
                return
            compiled = getattr(mod, name)
            original = getattr(compiled, "_torchdynamo_orig_callable", None)
            if not callable(original):
                FIT[piece] = (f"does not fit {fence.installed_version(mod)}: {mod.__name__}.{name} is not a "
                              "torch.compile'd function (not applied: it runs as it is)")
                return

            @functools.wraps(original)
            @fence.guard(piece)
            def eager(*args, **kwargs):
                _count(f"{mod.__name__}.{name} (eager)")
                return foreign(original, *args, **kwargs)

            setattr(mod, name, eager)
            rebind(compiled, eager, ("vllm",), skip=mod)

        declare(hooks, module, piece, patch, "runs eagerly as the Python vLLM wrote it, not compiled by Inductor (no "
                f"GPU to compile for): the same torch ops on meta tensors give the same shapes; {why}")


def install_expert_map_on_cpu(hooks) -> None:
    """vLLM's expert map (which of the experts this rank holds: values fixed by the configuration) is built on
    the default device; on the meta device its values do not exist and the line vLLM logs from them
    (``torch.where(map != -1)`` and ``.item()``, 0.27-0.32) cannot run. vLLM 0.33 builds the map on the CPU
    itself when the default device is meta; this does the same for earlier releases (a no-op where vLLM already
    does it). The map's values are vLLM's own."""
    piece = "vllm.model_executor.layers.fused_moe.expert_map_manager:ExpertMapManager._calculate_expert_maps"

    def patch(mod):
        if not fence.fits(piece, mod, "ExpertMapManager._calculate_expert_maps"):
            return
        cls = mod.ExpertMapManager
        original = cls._calculate_expert_maps

        @functools.wraps(original)
        @fence.guard(piece)
        def _calculate_expert_maps(self, *args, **kwargs):
            import torch

            if torch.get_default_device().type == "meta":
                with torch.device("cpu"):
                    return foreign(original, self, *args, **kwargs)
            return foreign(original, self, *args, **kwargs)

        cls._calculate_expert_maps = _calculate_expert_maps

    declare(hooks, "vllm.model_executor.layers.fused_moe.expert_map_manager", piece, patch,
            "the expert map is built on the CPU when the default device is meta, as vLLM 0.33 does itself (its values "
            "come from the configuration)")


def no_nccl() -> None:
    """The expert-parallel group's device communicator opens a NCCL communicator with its peers; the fake
    process group has none. vLLM's own "NCCL is not usable" state is what it gets (the state vLLM sets when the
    NCCL library cannot be loaded): rank and size kept, ``available`` False, ``disabled`` True. NCCL carries
    collectives; no post-load choice reads it."""
    from vllm.distributed.device_communicators import pynccl

    cls = pynccl.PyNcclCommunicator
    original = cls.__init__

    @functools.wraps(original)
    @fence.guard("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator")
    def __init__(self, group, device, *args, **kwargs):
        import torch.distributed as dist

        self.group = group
        if isinstance(group, dist.ProcessGroup):
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world_size = group.rank, group.world_size
        self.available = False
        self.disabled = True
        _count("vllm PyNcclCommunicator (not opened)")

    cls.__init__ = __init__
    SIMULATED["vllm.distributed.device_communicators.pynccl:PyNcclCommunicator"] = (
        "not opened (no peers behind the fake process group): vLLM's own NCCL-unavailable state")


def install(hooks, model=None) -> None:
    """Every stand-in above, and those of *model*'s probes package (a ``probes.models.ModelProbes``), as
    post-import hooks (resolve mode's SM process, before vLLM is imported)."""
    install_meta_device_args(hooks, model.meta_device_args if model is not None else ())
    install_cuda_device_context(hooks)
    install_humming(hooks)
    install_inert_jit(hooks)
    install_deep_gemm(hooks)
    install_eager_compiled(hooks)
    install_expert_map_on_cpu(hooks)
