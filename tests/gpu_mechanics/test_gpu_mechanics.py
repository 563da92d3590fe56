"""Observe mode's mechanics below vLLM, on a real NVIDIA GPU (torch + Triton, no vLLM).

1. The trace reader (probes.observe.traces) on real torch.profiler traces: eager launches are direct, the
   kernels of full-graph replays are in-graph, and piecewise graphs with an eager segment between them
   split exactly; with GPU activity only (how observe mode configures vLLM's workers) and with CPU too.
2. The observe probes' CUDA-graph hooks (probes.observe.session, probes.observe.counting) on real
   ``torch.cuda.CUDAGraph`` capture and replay: a call during capture is graph membership (and the GPU
   agrees: the captured kernel did not run), replays are counted per graph, a replay that raises is
   not counted. A float tensor bumped by the counted kernel is the GPU's own count of executions.

Each expected number follows from the scenario's own loop counts."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

N = 1 << 16


@pytest.fixture(scope="module")
def mk(gpu):
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import mech_kernels

    return mech_kernels


def _warm(mk, torch):
    """Compile every kernel outside any profiler session or capture."""
    x = torch.zeros(N, device="cuda")
    y = torch.zeros(N, device="cuda")
    mk.bump(x), mk.scale(x, 1.0), mk.eager_segment(x, y)
    torch.cuda.synchronize()


def _read(path):
    from probes.observe.traces import read_trace

    got = read_trace(str(path))
    return got, {k: tuple(v) for k, v in got["kernels"].items()}


def _raw_graph_ids(path):
    import gzip

    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    return sorted({e.get("args", {}).get("graph id") for e in events if e.get("cat") == "kernel"} - {None, 0})


def _expect(mk, **counts):
    return {mk.NAMES[k]: v for k, v in counts.items() if v != (0, 0)}


@pytest.mark.parametrize("activities", [("cuda",), ("cpu", "cuda")], ids=["gpu-only", "cpu+gpu"])
def test_eager_launches_are_direct(gpu, mk, tracebook, activities):
    torch = gpu
    _warm(mk, torch)
    x = torch.zeros(N, device="cuda")
    y = torch.zeros(N, device="cuda")
    steps = 3

    def body():
        for _ in range(steps):
            mk.bump(x)
            mk.scale(x, 1.0)
            mk.eager_segment(x, y)

    scenario = "eager" + ("-cpu" if "cpu" in activities else "")
    path = tracebook.profile(scenario, body, activities=activities)
    got, kernels = _read(path)
    want = _expect(mk, bump=(steps, 0), scale=(steps, 0), eager=(steps, 0))
    assert {k: v for k, v in kernels.items() if k in want.keys()} == want
    assert got["graph_launches"] == 0
    assert float(x[0]) == steps  # the GPU ran every bump
    tracebook.note(path, scenario, activities=list(activities), expect=want, graph_launches=0,
                   graph_ids_seen=_raw_graph_ids(path))


@pytest.mark.parametrize("activities", [("cuda",), ("cpu", "cuda")], ids=["gpu-only", "cpu+gpu"])
def test_full_graph_replays_are_in_graph(gpu, mk, tracebook, activities):
    """Two eager steps, then replays of a captured graph of the same step (bump twice, scale once)."""
    torch = gpu
    _warm(mk, torch)
    x = torch.zeros(N, device="cuda")
    eager_steps, replays = 2, 3

    def step():
        mk.bump(x)
        mk.bump(x)
        mk.scale(x, 1.0)

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    assert float(x[0]) == 0  # capturing ran nothing

    def body():
        for _ in range(eager_steps):
            step()
        for _ in range(replays):
            g.replay()

    scenario = "fullgraph" + ("-cpu" if "cpu" in activities else "")
    path = tracebook.profile(scenario, body, activities=activities)
    got, kernels = _read(path)
    want = _expect(mk, bump=(2 * eager_steps, 2 * replays), scale=(eager_steps, replays))
    assert {k: v for k, v in kernels.items() if k in want.keys()} == want
    assert got["graph_launches"] == replays
    assert got["by_graph_id"] + got["by_correlation"] == 3 * replays
    assert float(x[0]) == 2 * (eager_steps + replays)
    tracebook.note(path, scenario, activities=list(activities), expect=want, graph_launches=replays,
                   graph_ids_seen=_raw_graph_ids(path))


def test_piecewise_graphs_with_an_eager_segment_between_them(gpu, mk, tracebook):
    """A breakable graph's replay: graph A (bump), an eager segment, graph B (scale), per step."""
    torch = gpu
    _warm(mk, torch)
    x = torch.zeros(N, device="cuda")
    y = torch.zeros(N, device="cuda")
    steps = 4
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga):
        mk.bump(x)
    with torch.cuda.graph(gb, pool=ga.pool()):
        mk.scale(x, 1.0)

    def body():
        for _ in range(steps):
            ga.replay()
            mk.eager_segment(x, y)
            gb.replay()

    path = tracebook.profile("piecewise", body)
    got, kernels = _read(path)
    want = _expect(mk, bump=(0, steps), eager=(steps, 0), scale=(0, steps))
    assert {k: v for k, v in kernels.items() if k in want.keys()} == want
    assert got["graph_launches"] == 2 * steps
    assert float(x[0]) == steps and float(y[0]) == sum(range(1, steps + 1))
    tracebook.note(path, "piecewise", activities=["cuda"], expect=want, graph_launches=2 * steps,
                   graph_ids_seen=_raw_graph_ids(path))


def test_summarize_reads_the_directory_as_the_observe_agent_does(gpu, mk, tracebook):
    from probes.observe.traces import summarize

    _warm(mk, gpu)
    x = gpu.zeros(N, device="cuda")
    path = tracebook.profile("summary", lambda: mk.bump(x))
    (entry,) = [e for e in summarize(str(tracebook.dir)) if e["file"] == path.name]
    assert (entry["prefix"], entry["rank"], entry["tp"]) == ("summary", 0, 0)
    assert entry["kernels"][mk.NAMES["bump"]] == {"direct": 1, "in_graph": 0}
    tracebook.note(path, "summary", activities=["cuda"], expect=_expect(mk, bump=(1, 0)), graph_launches=0,
                   graph_ids_seen=_raw_graph_ids(path))


# -- the observe probes' CUDA-graph hooks on real torch.cuda.CUDAGraph ----------------------------------
@pytest.fixture
def session(gpu):
    """An ObserveSession whose graph hooks are installed on torch's real CUDAGraph class the way a serving
    process installs them (post-import hooks; torch.cuda.graphs is already imported), undone after."""
    from probes.observe.session import GRAPH_HOOKS, ObserveSession
    from probes.core.patching import SENTINEL
    from probes.core.recorder import Recorder

    cls = gpu.cuda.graphs.CUDAGraph
    saved = {n: vars(cls)[n] for n in ("capture_begin", "capture_end", "replay")}
    s = ObserveSession(Recorder(None), kernels=(), scopes=())
    s.install()
    torch_hooks = [h for h in GRAPH_HOOKS if h.startswith("torch.")]
    assert {h: s.status[h] for h in torch_hooks} == {h: "patched" for h in torch_hooks}
    assert all(hasattr(vars(cls)[n], SENTINEL) for n in saved)
    yield s
    s.hooks.uninstall()
    for n, fn in saved.items():
        setattr(cls, n, fn)


def test_capture_is_membership_replays_count_per_graph(gpu, mk, session):
    torch = gpu
    _warm(mk, torch)
    c = session.counters
    bump = c.counting_wrapper(mk.bump, "entry A")
    scale = c.counting_wrapper(mk.scale, "entry B")
    x = torch.zeros(N, device="cuda")
    y = torch.ones(N, device="cuda")
    c.set_phase("decode")
    c.set_layer(1)
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1):
        bump(x)
    c.set_layer(2)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        scale(y, 2.0)
    torch.cuda.synchronize()
    assert float(x[0]) == 0 and float(y[0]) == 1  # the GPU ran nothing during capture
    r1, r2, eager = 3, 5, 2
    for _ in range(r1):
        g1.replay()
    for _ in range(r2):
        g2.replay()
    c.set_layer(3)
    for _ in range(eager):
        bump(x)
    torch.cuda.synchronize()
    snap = c.snapshot()
    graphs = {g["id"]: (g["replays"], [(p["path"], p["layer"], p["phase"]) for p in g["paths"]])
              for g in snap["graphs"]}
    assert graphs == {1: (r1, [("entry A", 1, "decode")]), 2: (r2, [("entry B", 2, "decode")])}
    assert snap["eager"] == [{"path": "entry A", "layer": 3, "phase": "decode", "calls": eager}]
    # what the probes say ran is what the GPU ran: bump executions = replays of g1 + eager calls
    assert float(x[0]) == r1 * 1 + eager and float(y[0]) == 2.0 ** r2


def test_a_replay_that_raises_is_not_counted(gpu, mk, session):
    torch = gpu
    _warm(mk, torch)
    c = session.counters
    bump = c.counting_wrapper(mk.bump, "entry A")
    x = torch.zeros(N, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        bump(x)
    g.replay()
    g.replay()
    g.reset()  # the captured graph is released: a real replay now raises
    with pytest.raises(RuntimeError) as err:
        g.replay()
    torch.cuda.synchronize()
    (graph,) = c.snapshot()["graphs"]
    assert graph["replays"] == 2 and float(x[0]) == 2
    assert "replay" in str(err.value).lower() or "capture" in str(err.value).lower()
    with pytest.raises(RuntimeError):
        torch.cuda.CUDAGraph().replay()  # never captured: no graph id, nothing counted
    assert [g["replays"] for g in c.snapshot()["graphs"]] == [2]


def test_piecewise_replays_and_the_eager_segment_between_them(gpu, mk, session, tracebook):
    """Breakable-graph pattern: the probes count graph A and B per replay and the eager segment's entry
    per call, and the trace of the same steps says the same per kernel."""
    torch = gpu
    _warm(mk, torch)
    c = session.counters
    bump = c.counting_wrapper(mk.bump, "entry A")
    seg = c.counting_wrapper(mk.eager_segment, "entry E")
    scale = c.counting_wrapper(mk.scale, "entry B")
    x = torch.zeros(N, device="cuda")
    y = torch.zeros(N, device="cuda")
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    c.set_phase("decode")
    with torch.cuda.graph(ga):
        bump(x)
    with torch.cuda.graph(gb, pool=ga.pool()):
        scale(x, 1.0)
    steps = 5

    def body():
        for _ in range(steps):
            ga.replay()
            seg(x, y)
            gb.replay()

    path = tracebook.profile("piecewise-probed", body)
    snap = c.snapshot()
    probes = {g["paths"][0]["path"]: g["replays"] for g in snap["graphs"]}
    assert probes == {"entry A": steps, "entry B": steps}
    assert [(r["path"], r["calls"]) for r in snap["eager"]] == [("entry E", steps)]
    _, kernels = _read(path)
    want = _expect(mk, bump=(0, steps), eager=(steps, 0), scale=(0, steps))
    assert {k: v for k, v in kernels.items() if k in want.keys()} == want
    tracebook.note(path, "piecewise-probed", activities=["cuda"], expect=want, graph_launches=2 * steps,
                   graph_ids_seen=_raw_graph_ids(path),
                   probes={"graphs": probes, "eager": {r["path"]: r["calls"] for r in snap["eager"]}})
