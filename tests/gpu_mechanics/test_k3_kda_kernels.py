"""vLLM 0.33.0's own Kimi-K3 KDA Triton kernels on a real GPU: the names torch.profiler records for them
map, through probes/observe/kernel_names.py, to exactly the kernel path the observe probes count them as.

The sources are the wheel's files, unchanged (tests/gpu_mechanics/k3_kda_src.py; nothing of vLLM is in
this repository). The observe session is installed before they are imported, as in a serving process,
so the entries run through the real counting wrappers; the FULL-graph case captures the packed decode
entry in a ``torch.cuda.CUDAGraph`` and replays it under the profiler, the way a FULL decode graph runs.
Shapes are one TP8 rank of Kimi-K3 (96 KDA heads / 8 = 12, head dim 128, gate lower bound -5)."""
from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.gpu

H, D = 12, 128
LOWER_BOUND = -5.0
KDA_MODULE = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"


@pytest.fixture(scope="module")
def kda(gpu, k3_kda_src):
    """(observe session, the KDA ops module, its @triton.jit function names): the session's kernel
    wrappers and graph hooks are installed first; the module is then imported from the wheel's sources."""
    import sys

    from probes.observe.kernel_names import _Build
    from probes import models as models_probes
    from probes.observe.session import ObserveSession
    from probes.core.recorder import Recorder

    import k3_kda_src as src

    entries = tuple(k for k in models_probes.load("kimi_k3").kernels if k.path in src.ENTRIES)
    assert {k.path: k.spec for k in entries} == src.ENTRIES  # the copied entries are the probes' targets
    cls = gpu.cuda.graphs.CUDAGraph
    saved = {n: vars(cls)[n] for n in ("capture_begin", "capture_end", "replay")}
    session = ObserveSession(Recorder(None), kernels=entries, scopes=()).install()
    assert KDA_MODULE not in sys.modules
    import importlib

    mod = importlib.import_module(KDA_MODULE)
    assert sys.modules["vllm"].__file__.startswith(str(k3_kda_src))  # the shim package, not a vLLM install
    assert {spec: session.status[spec] for spec in src.ENTRIES.values()} == {s: "patched" for s in src.ENTRIES.values()}
    jit = _Build([str(k3_kda_src)]).triton_functions(KDA_MODULE)
    assert jit, "no @triton.jit function found in the copied sources"
    yield session, mod, jit
    session.hooks.uninstall()
    for n, fn in saved.items():
        setattr(cls, n, fn)


def _calls(session, path) -> int:
    return sum(r["calls"] for r in session.counters.snapshot()["eager"] if r["path"] == path)


def _mapped(kernels):
    from probes import models as models_probes
    from probes.observe.kernel_names import all_names, matches

    KERNEL_NAMES = all_names(models_probes.load("kimi_k3", schemes=("mxfp4",)))

    return {name: sorted({e.path for e in matches(KERNEL_NAMES, name)}) for name in kernels}


def _check_names(kernels, path, jit):
    """Every kernel the entry launched maps to exactly *path* or to no path at all; every kernel that is
    one of the K3 KDA module's own @triton.jit functions maps to *path*; at least one maps."""
    mapped = _mapped(kernels)
    wrong = {n: p for n, p in mapped.items() if p not in ([], [path])}
    assert not wrong, f"kernels mapped to other paths: {wrong}"
    unmapped_own = [n for n in kernels if n in jit and mapped[n] != [path]]
    assert not unmapped_own, f"K3 KDA kernels the map does not name: {unmapped_own}"
    assert any(p == [path] for p in mapped.values()), f"no kernel of {path} in {sorted(kernels)}"
    return mapped


def _prefill_inputs(torch, lens=(100, 200)):
    t, n = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    cu = torch.tensor([0, *itertools.accumulate(lens)], device="cuda", dtype=torch.int32)
    return dict(q=r(1, t, H, D), k=r(1, t, H, D), v=r(1, t, H, D), raw_g=r(1, t, H, D), raw_beta=r(1, t, H),
                A_log=torch.randn(H, device="cuda"), g_bias=torch.randn(H * D, device="cuda"),
                lower_bound=LOWER_BOUND, initial_state=torch.zeros(n, H, D, D, device="cuda"),
                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)


def _decode_inputs(torch, batch=8):
    return dict(mixed_qkv=torch.randn(batch, 3 * H * D, device="cuda", dtype=torch.bfloat16),
                raw_g=torch.randn(1, batch, H, D, device="cuda", dtype=torch.bfloat16),
                raw_beta=torch.randn(1, batch, H, device="cuda", dtype=torch.bfloat16),
                A_log=torch.randn(H, device="cuda"), dt_bias=torch.randn(H * D, device="cuda"),
                lower_bound=LOWER_BOUND, initial_state=torch.zeros(2 * batch, H, D, D, device="cuda"),
                state_indices=torch.arange(batch, device="cuda", dtype=torch.int32))


def _verify_inputs(torch, seqs=4, spec=3):
    t = seqs * (spec + 1)
    r = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return dict(q=r(1, t, H, D), k=r(1, t, H, D), v=r(1, t, H, D), raw_g=r(1, t, H, D), raw_beta=r(1, t, H),
                A_log=torch.randn(H, device="cuda"), dt_bias=torch.randn(H * D, device="cuda"),
                lower_bound=LOWER_BOUND, initial_state=torch.zeros(t, H, D, D, device="cuda"),
                cu_seqlens=torch.arange(0, t + 1, spec + 1, device="cuda", dtype=torch.int32),
                ssm_state_indices=torch.arange(t, device="cuda", dtype=torch.int32).view(seqs, spec + 1),
                num_accepted_tokens=torch.tensor([1, 2, 3, 4][:seqs], device="cuda", dtype=torch.int32))


CASES = {  # path -> (entry function, inputs)
    "triton chunk_kda": ("chunk_kda_with_fused_gate", _prefill_inputs),
    "triton packed decode": ("fused_recurrent_kda_packed_decode", _decode_inputs),
    "triton fused_recurrent_kda": ("fused_recurrent_kda", _verify_inputs),
}


@pytest.mark.parametrize("path", list(CASES))
def test_eager_entry_kernels_map_to_exactly_their_path(gpu, kda, tracebook, path):
    from probes.observe.traces import read_trace

    session, mod, jit = kda
    fn_name, make = CASES[path]
    fn = getattr(mod, fn_name)
    assert getattr(fn, "__wrapped__", None) is not None  # the counting wrapper the probes installed
    inputs = make(gpu)
    fn(**inputs)  # compile and autotune outside the profiler
    gpu.cuda.synchronize()
    before, calls = _calls(session, path), 2
    scenario = "k3kda-" + path.replace(" ", "-").replace("_", "-")
    trace = tracebook.profile(scenario, lambda: [fn(**inputs) for _ in range(calls)])
    assert _calls(session, path) - before == calls
    got = read_trace(str(trace))
    kernels = {k: tuple(v) for k, v in got["kernels"].items()}
    mapped = _check_names(kernels, path, jit)
    ours = {n: kernels[n] for n, p in mapped.items() if p == [path]}
    assert all(d >= calls and d % calls == 0 and g == 0 for d, g in ours.values()), kernels
    tracebook.note(trace, scenario, activities=["cuda"], entry=path, entry_calls=calls, replays=0,
                   k3_kda_jit_functions=sorted(jit), mapped={n: p for n, p in mapped.items()})


def test_packed_decode_replayed_from_a_full_graph(gpu, kda, tracebook):
    """The FULL decode graph case: the entry is captured once (membership, no execution), replayed under
    the profiler; the trace's replayed kernels map to the path the probes recorded as in that graph."""
    from probes.observe.traces import read_trace

    torch = gpu
    session, mod, jit = kda
    path = "triton packed decode"
    inputs = _decode_inputs(torch)
    mod.fused_recurrent_kda_packed_decode(**inputs)
    torch.cuda.synchronize()
    before = _calls(session, path)
    session.counters.set_phase("decode")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mod.fused_recurrent_kda_packed_decode(**inputs)
    assert _calls(session, path) == before  # capture is not an execution
    replays, eager = 3, 1

    def body():
        for _ in range(replays):
            g.replay()
        for _ in range(eager):
            mod.fused_recurrent_kda_packed_decode(**inputs)

    trace = tracebook.profile("k3kda-packed-decode-fullgraph", body)
    snap = session.counters.snapshot()
    (graph,) = [x for x in snap["graphs"] if any(p["path"] == path for p in x["paths"])]
    assert graph["replays"] == replays and [p["path"] for p in graph["paths"]] == [path]
    assert _calls(session, path) - before == eager
    got = read_trace(str(trace))
    kernels = {k: tuple(v) for k, v in got["kernels"].items()}
    mapped = _check_names(kernels, path, jit)
    ours = {n: kernels[n] for n, p in mapped.items() if p == [path]}
    assert ours and all(v == (eager, replays) for v in ours.values()), kernels
    assert got["graph_launches"] == replays
    tracebook.note(trace, "k3kda-packed-decode-fullgraph", activities=["cuda"], entry=path, entry_calls=eager,
                   replays=replays, k3_kda_jit_functions=sorted(jit), mapped=mapped,
                   probes={"graph_replays": graph["replays"], "graph_paths": [p["path"] for p in graph["paths"]]})
