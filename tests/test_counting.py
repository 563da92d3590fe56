"""Counting wrappers (observe mode's hot path): the mechanics, on a throwaway function.

What they wrap in vLLM is tested in test_observe_vllm.py; here: the call is untouched, calls land in
the right (path, layer, phase) slot, and a call during CUDA-graph capture is membership of the graph,
never an execution, while replays are counted per graph."""
import inspect

import pytest

from probes.observe.counting import Counters


def kernel(x, *, scale=2):
    """a stand-in kernel entry"""
    if x is None:
        raise ValueError("boom")
    return [x] * scale


def test_wrapper_is_transparent():
    c = Counters()
    w = c.counting_wrapper(kernel, "k")
    assert w.__wrapped__ is kernel and w.__name__ == "kernel" and w.__doc__ == kernel.__doc__
    assert inspect.signature(w) == inspect.signature(kernel)
    obj = object()
    out = w(obj, scale=1)
    assert out[0] is obj
    with pytest.raises(ValueError, match="boom") as e:
        w(None)
    assert e.type is ValueError


def test_calls_land_per_layer_and_phase_and_capture_is_not_execution():
    c = Counters(max_layers=8)
    a = c.counting_wrapper(kernel, "moe:marlin")
    b = c.counting_wrapper(kernel, "kda:fused_decode", layer_of=lambda args: args[0])
    c.set_phase("prefill")
    c.set_layer(3)
    a(1)
    a(1)
    b(5)  # its own layer from the argument
    c.set_phase("decode")
    gid = c.begin_capture("decode bs<=8")
    a(1)
    b(6)
    c.end_capture()
    for _ in range(7):
        c.replayed(gid)
    c.set_layer(None)
    a(1)
    snap = c.snapshot()
    eager = {(r["path"], r["layer"], r["phase"]): r["calls"] for r in snap["eager"]}
    assert eager == {("moe:marlin", 3, "prefill"): 2, ("kda:fused_decode", 5, "prefill"): 1,
                     ("moe:marlin", None, "decode"): 1}  # set_layer(None): outside any layer
    (g,) = snap["graphs"]
    assert g["key"] == "decode bs<=8" and g["replays"] == 7
    assert {(p["path"], p["layer"], p["phase"]) for p in g["paths"]} == {
        ("moe:marlin", 5, "decode"), ("kda:fused_decode", 6, "decode")}
    # the captured calls were not counted as executions
    assert sum(r["calls"] for r in snap["eager"] if r["phase"] == "decode") == 1


def test_registration_after_wrapping_keeps_earlier_slots():
    c = Counters(max_layers=4)
    a = c.counting_wrapper(kernel, "a")
    c.set_layer(1)
    a(1)
    b = c.counting_wrapper(kernel, "b")  # grows the array
    b(1)
    a(1)
    rows = {(r["path"], r["layer"]): r["calls"] for r in c.snapshot()["eager"]}
    assert rows == {("a", 1): 2, ("b", 1): 1}


def test_graph_hooks_count_replays_that_ran_and_keep_exceptions(tmp_path):
    """The observe session's CUDA-graph hooks, installed on a throwaway graph class: calls between
    capture_begin and capture_end are membership; a replay that raises propagates and is not counted."""
    import types

    from probes.observe.session import ObserveSession
    from probes.core.recorder import Recorder

    class Graph:
        broken = False

        def capture_begin(self, pool=None):
            return "begun"

        def capture_end(self):
            return "ended"

        def replay(self):
            if self.broken:
                raise RuntimeError("replay failed")
            return "replayed"

    mod = types.ModuleType("fake_graphs")
    mod.CUDAGraph = Graph
    session = ObserveSession(Recorder(None), kernels=(), scopes=())
    for name in ("capture_begin", "capture_end", "replay"):
        session._wrap_graph(mod, f"fake_graphs:CUDAGraph.{name}")
    k = session.counters.counting_wrapper(kernel, "k")
    g = Graph()
    assert g.capture_begin(pool=1) == "begun"
    k(1)
    assert g.capture_end() == "ended"
    assert g.replay() == "replayed" and g.replay() == "replayed"
    g.broken = True
    with pytest.raises(RuntimeError, match="replay failed"):
        g.replay()
    (graph,) = session.counters.snapshot()["graphs"]
    assert graph["replays"] == 2 and [p["path"] for p in graph["paths"]] == ["k"]
    assert session.counters.snapshot()["eager"] == []
