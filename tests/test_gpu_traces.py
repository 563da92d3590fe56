"""The trace reader and the kernel-name map on real torch.profiler traces recorded on an NVIDIA H200
(tests/data/gpu-traces/, written by tests/gpu_mechanics with SERVING_TRUTH_GPU_TRACES; what was launched
in each and the machine it ran on are in its traces.json). CPU only: this keeps CI, which has no GPU,
reading real GPU output rather than hand-written events."""
import gzip
import json
from pathlib import Path

import pytest

from probes import models as models_probes
from probes.observe.kernel_names import all_names, matches

KERNEL_NAMES = all_names(models_probes.load("kimi_k3", schemes=("mxfp4",)))
from probes.observe.traces import read_trace, summarize

DATA = Path(__file__).resolve().parent / "data" / "gpu-traces"
BOOK = json.loads((DATA / "traces.json").read_text())
TRACES = BOOK["traces"]
MECHANICS = [t for t in TRACES if "expect" in t]
ENTRIES = [t for t in TRACES if "entry" in t]


def test_the_recording_is_labelled_and_complete():
    env = BOOK["environment"]
    assert all(env.get(k) for k in ("gpu", "driver", "torch", "cuda", "triton", "recorded")), env
    on_disk = sorted(p.name for p in DATA.glob("*.pt.trace.json.gz"))
    assert on_disk == sorted(t["file"] for t in TRACES)
    assert MECHANICS and ENTRIES
    assert {t["scenario"] for t in MECHANICS} >= {"eager", "fullgraph", "piecewise"}


@pytest.mark.parametrize("t", MECHANICS, ids=[t["scenario"] for t in MECHANICS])
def test_direct_and_in_graph_launches_are_what_was_launched(t):
    got = read_trace(str(DATA / t["file"]))
    kernels = {k: list(v) for k, v in got["kernels"].items() if k in t["expect"]}
    assert kernels == t["expect"]
    assert got["graph_launches"] == t["graph_launches"]


def test_replays_are_told_apart_by_correlation_where_no_graph_id_is_written():
    """What these traces show: no kernel event carries a graph id, so graph replays are attributed through
    the correlation with their cudaGraphLaunch; a reader keyed on graph id alone saw no in-graph launch."""
    replayed = [t for t in TRACES if t.get("graph_launches") or t.get("replays")]
    assert replayed
    for t in replayed:
        got = read_trace(str(DATA / t["file"]))
        in_graph = sum(v[1] for v in got["kernels"].values())
        assert in_graph > 0 and got["by_correlation"] == in_graph and got["by_graph_id"] == 0, t["file"]
        assert t.get("graph_ids_seen", []) == []


def test_summarize_parses_every_recorded_trace_as_vllm_names_them():
    by_file = {e["file"]: e for e in summarize(str(DATA))}
    assert set(by_file) == {t["file"] for t in TRACES}
    for t in TRACES:
        e = by_file[t["file"]]
        assert "error" not in e and (e["prefix"], e["rank"], e["tp"], e["dp"], e["ep"]) == (t["scenario"], 0, 0, 0, 0)


@pytest.mark.parametrize("t", ENTRIES, ids=[t["scenario"] for t in ENTRIES])
def test_k3_kda_kernel_names_map_to_exactly_their_path(t):
    """vLLM 0.33.0's K3 KDA Triton kernels as the profiler named them: each launched kernel maps to the
    entry's path or to none; each of the KDA module's own @triton.jit kernels maps to the entry's path;
    and the mapped kernels were launched once per entry call (direct) or per replay (in graph)."""
    got = read_trace(str(DATA / t["file"]))
    path, jit = t["entry"], set(t["k3_kda_jit_functions"])
    mapped = {name: sorted({e.path for e in matches(KERNEL_NAMES, name)}) for name in got["kernels"]}
    assert mapped == t["mapped"]  # the map as committed reads these names as it did on the GPU
    assert all(p in ([], [path]) for p in mapped.values()), mapped
    assert all(mapped[n] == [path] for n in got["kernels"] if n in jit)
    ours = {n: got["kernels"][n] for n, p in mapped.items() if p == [path]}
    assert ours
    for direct, in_graph in ours.values():
        assert in_graph == t["replays"]
        assert direct >= t["entry_calls"] and direct % t["entry_calls"] == 0


def test_recorded_traces_are_small():
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 1_000_000
    for p in DATA.glob("*.gz"):
        with gzip.open(p, "rt") as fh:
            assert "traceEvents" in json.load(fh)
