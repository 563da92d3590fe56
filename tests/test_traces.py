"""probes.observe.traces: direct versus in-graph attribution of kernel events, on hand-written Kineto events.

Real traces recorded on an H200 are read in test_gpu_traces.py; these cases pin down the rules one by
one: a kernel launched by a graph replay carries the correlation id of the ``cudaGraphLaunch`` (runtime
API) or ``cuGraphLaunch`` (driver API) event of that replay; a non-zero ``graph id`` (newer Kineto)
counts on its own; everything else is a direct launch."""
import gzip
import json

import pytest

from probes.observe.traces import GRAPH_LAUNCH, attribute, read_trace, summarize


def api(name, corr, cat="cuda_runtime"):
    return {"ph": "X", "cat": cat, "name": name, "ts": corr, "dur": 1, "args": {"correlation": corr}}


def kernel(name, corr, **args):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": corr + 1, "dur": 1,
            "args": {"correlation": corr, **args}}


def counts(events):
    return {k: tuple(v) for k, v in attribute(events)["kernels"].items()}


def test_eager_launches_are_direct():
    ev = [api("cudaLaunchKernel", 1), kernel("a", 1), api("cudaLaunchKernel", 2), kernel("b", 2),
          api("cuLaunchKernelEx", 3, cat="cuda_driver"), kernel("a", 3)]
    got = attribute(ev)
    assert counts(ev) == {"a": (2, 0), "b": (1, 0)}
    assert (got["graph_launches"], got["by_correlation"], got["by_graph_id"]) == (0, 0, 0)


def test_kernels_of_a_graph_replay_share_the_correlation_of_its_cudaGraphLaunch():
    # two eager steps, then three replays of a graph of two kernels (a, b): what an H200 trace holds
    ev = [api("cudaLaunchKernel", 10), kernel("a", 10), api("cudaLaunchKernel", 11), kernel("b", 11)] * 1
    ev += [api("cudaLaunchKernel", 12), kernel("a", 12), api("cudaLaunchKernel", 13), kernel("b", 13)]
    for corr in (20, 21, 22):
        ev += [api("cudaGraphLaunch", corr), kernel("a", corr), kernel("b", corr)]
    got = attribute(ev)
    assert counts(ev) == {"a": (2, 3), "b": (2, 3)}
    assert (got["graph_launches"], got["by_correlation"], got["by_graph_id"]) == (3, 6, 0)


def test_driver_api_graph_launch_and_versioned_names_count():
    ev = [api("cuGraphLaunch", 5, cat="cuda_driver"), kernel("k", 5),
          api("cudaGraphLaunch_v10000", 6), kernel("k", 6),
          api("cuGraphLaunch_ptsz", 7, cat="cuda_driver"), kernel("k", 7)]
    assert counts(ev) == {"k": (0, 3)}
    for name in ("cudaGraphLaunch", "cuGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch_ptsz"):
        assert GRAPH_LAUNCH.match(name)
    for name in ("cudaGraphInstantiate", "cudaGraphLaunchX", "cudaLaunchKernel", "cuGraphExecUpdate"):
        assert not GRAPH_LAUNCH.match(name)


def test_graph_launch_events_of_other_categories_do_not_mark_kernels():
    # a CPU op that happens to be named like the API call (a user range, say) is not a launch
    ev = [{"ph": "X", "cat": "user_annotation", "name": "cudaGraphLaunch", "args": {"correlation": 9}},
          kernel("k", 9)]
    assert counts(ev) == {"k": (1, 0)} and attribute(ev)["graph_launches"] == 0


def test_graph_id_counts_where_kineto_writes_it_and_zero_means_none():
    ev = [kernel("k", 1, **{"graph id": 4}), kernel("k", 2, **{"graph id": 0}), kernel("k", 3, graph_id="7"),
          api("cudaLaunchKernel", 2)]
    got = attribute(ev)
    assert counts(ev) == {"k": (1, 2)} and got["by_graph_id"] == 2 and got["by_correlation"] == 0


def test_graph_id_and_correlation_together_count_once():
    ev = [api("cudaGraphLaunch", 3), kernel("k", 3, **{"graph id": 2})]
    got = attribute(ev)
    assert counts(ev) == {"k": (0, 1)} and (got["by_graph_id"], got["by_correlation"]) == (1, 0)


@pytest.mark.parametrize("args", [None, {}, {"correlation": "12"}, {"correlation": True}, {"graph id": "x"}])
def test_kernels_without_usable_ids_are_direct(args):
    ev = [api("cudaGraphLaunch", 12), api("cudaGraphLaunch", 1),
          {"ph": "X", "cat": "kernel", "name": "k", **({} if args is None else {"args": args})}]
    assert counts(ev) == {"k": (1, 0)}


def test_non_kernel_events_are_not_counted():
    ev = [api("cudaGraphLaunch", 1), kernel("k", 1),
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "args": {"correlation": 1}},
          {"ph": "i", "cat": "kernel", "name": "instant", "args": {"correlation": 1}},
          {"ph": "X", "cat": "kernel", "name": 5, "args": {"correlation": 1}}, "garbage"]
    got = attribute(ev)
    assert counts(ev) == {"k": (0, 1)} and got["events"] == 6


def test_read_trace_and_summarize_carry_graph_launches(tmp_path):
    d = tmp_path / "traces"
    d.mkdir()
    ev = [api("cudaLaunchKernel", 1), kernel("k", 1), api("cudaGraphLaunch", 2), kernel("k", 2), kernel("j", 2)]
    path = d / "decode-bs8_dp0_pp0_tp0_dcp0_ep0_rank0.5.pt.trace.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": ev, "deviceProperties": []}, fh)
    (d / "plain_rank1.6.pt.trace.json").write_text(json.dumps(ev))  # a bare list, not gzipped
    assert read_trace(str(path))["kernels"] == {"k": [1, 1], "j": [0, 1]}
    s = summarize(str(d))
    assert [(t["prefix"], t["rank"], t["graph_launches"]) for t in s] == [("decode-bs8", 0, 1), ("plain", 1, 1)]
    assert s[0]["kernels"] == {"j": {"direct": 0, "in_graph": 1}, "k": {"direct": 1, "in_graph": 1}}
    (d / "bad_rank2.7.pt.trace.json").write_text(json.dumps({"traceEvents": {}}))
    assert "no traceEvents list" in summarize(str(d))[0]["error"]
