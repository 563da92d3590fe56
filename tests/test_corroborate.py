"""torch.profiler corroboration on the host: trace kernel counts (as probes.observe.traces records them) against
the probes' counts, per lane, and the ledger's section. Evidence files are written by the probes' own
recorder; the trace summaries are this project's record format (what the observe agent emits), so they
are built here directly. Reading real traces written by vLLM's worker profiler is tested in
test_observe_vllm.py; the map's patterns against the pinned build in test_kernel_names_vllm.py."""
import gzip
import json

from probes.core.recorder import Recorder
from audit.models.kimi_k3 import KIMI_K3

MAP = [  # entries as the observe agent records them (kernel-map): the real map's patterns for these paths
    {"path": "Marlin", "lane": "moe", "pattern": r"marlin_moe_wna16", "origin": "library:vllm/_moe_C*.so",
     "status": "in build"},
    {"path": "Marlin (batched)", "lane": "moe", "pattern": r"marlin_moe_wna16", "origin": "library:vllm/_moe_C*.so",
     "status": "in build"},
    {"path": "Triton", "lane": "moe", "pattern": r"^fused_moe_kernel", "origin": "triton:vllm.x",
     "status": "in build"},
    {"path": "fused_kda_decode (native)", "lane": "kda.decode", "pattern": r"kda_decode_fusion",
     "origin": "library:vllm/_C*.so", "status": "in build"},
    {"path": "FlashMLA", "lane": "mla.decode", "pattern": r"flash_fwd_splitkv_mla", "origin": "library:x.so",
     "status": "not in build"},
]
MARLIN = "void marlin_moe_wna16::Marlin<(vllm::ScalarTypeId)5, 4, 8, 8, true>(int4 const*, int4 const*)"
KDA = "void (anonymous namespace)::kda_decode_fusion_many_heads_kernel<false, true, 96, 96>(__nv_bfloat16 const*)"
ELEMENTWISE = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)"


def _trace(prefix, rank, kernels):
    return {"file": f"{prefix}_dp0_pp0_tp{rank}_dcp0_ep{rank}_rank{rank}.1.pt.trace.json.gz", "prefix": prefix,
            "rank": rank, "tp": rank, "dp": 0, "ep": rank, "bytes": 1, "events": 10,
            "kernels": {k: {"direct": d, "in_graph": g} for k, (d, g) in kernels.items()}}


def _cell(tmp_path, *, traces, probe_rows, kernel_map=MAP, profiled=True):
    """Evidence of one observed cell: an agent file (map + traces) and a rank-0 worker file (counts)."""
    from audit.evidence import files as evidence
    from audit.report import routing
    from audit.models.kimi_k3 import KIMI_K3

    out = tmp_path / "evidence" / "b200_sxm--tp8"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"mode": "observe", "cell": {"system": "b200_sxm", "layout": "tp8"}, "model": "kimi-k3"}
    agent = Recorder(str(out), role="vllm-process:agent.py", meta=meta)
    if profiled:
        agent.emit("kernel-map", entries=kernel_map)
        agent.emit("profiler-traces", dir="traces", traces=traces)
    agent.flush()
    worker = Recorder(str(out), role="vllm-process:python", meta={**meta, "rank": 0})
    for lane, path, level, calls in probe_rows:
        if level == "observed":
            worker.emit("exec", lane=lane, backend="", path=path, layer=1, phase="decode", calls=calls)
        else:
            worker.emit("graph", key="full num_tokens=8", replays=calls, gid=1,
                        paths=[{"path": path, "lane": lane, "backend": "", "layer": 1, "phase": "decode"}])
    worker.flush()
    built = routing.build_routing(evidence.read_dir(tmp_path / "evidence"), KIMI_K3,
                                  pin={"name": "t", "vllm_version": "0.33.0", "wheel": "", "wheel_sha256": "",
                                       "image": "", "platform_digests": {}}, expected=[("b200_sxm", "tp8")])
    return built, built["cells"][0]["observed"].get("profiler")


def _render(built):
    from audit.report.render import render_ledger

    return render_ledger(built, profile=KIMI_K3, reproduce="make audit")


def test_kernels_that_match_what_the_probes_counted_agree(tmp_path):
    traces = [_trace("decode-bs8", 0, {MARLIN: (10, 0), KDA: (0, 30), ELEMENTWISE: (100, 7)}),
              _trace("decode-bs8", 1, {MARLIN: (10, 0), KDA: (0, 30)})]
    built, pf = _cell(tmp_path, traces=traces, probe_rows=[("moe", "Marlin", "observed", 20),
                                                           ("kda.decode", "fused_kda_decode (native)", "graph", 5)])
    lanes = {l["lane"]: l for l in pf["lanes"]}
    assert lanes["moe"]["status"] == "agrees" and lanes["kda.decode"]["status"] == "agrees"
    # a kernel two paths share (Marlin and batched Marlin) is credited to the one the probes saw
    assert [p["path"] for p in lanes["moe"]["profiler"]] == ["Marlin"]
    (kda,) = lanes["kda.decode"]["profiler"]
    assert (kda["direct"], kda["in_graph"], kda["ranks"]) == (0, 60, ["0", "1"])
    assert pf["disagree"] == [] and pf["ranks"] == ["0", "1"] and pf["sessions"] == ["decode-bs8"]
    assert pf["kernel_launches"] == 187 and pf["in_graph_launches"] == 67
    assert pf["unmapped"] == [{"name": ELEMENTWISE, "launches": 107}]
    assert pf["map_not_in_build"] == [{"path": "FlashMLA", "lane": "mla.decode", "origin": "library:x.so"}]
    text = _render(built)
    assert "#### torch.profiler corroboration" in text and "torch.profiler disagrees" not in text
    assert "| Routed experts | Marlin | Marlin: 1 kernel(s), 20 / 0 | agrees |" in text
    assert "fused_kda_decode (native): 1 kernel(s), 0 / 60 | agrees |" in text
    assert "Map entries whose kernel this build does not contain" in text and "FlashMLA (`library:x.so`)" in text


def test_a_kernel_of_a_path_the_probes_missed_and_a_path_without_kernels_disagree(tmp_path):
    traces = [_trace("prefill-short", 0, {MARLIN: (4, 0), "fused_moe_kernel": (4, 0)})]
    built, pf = _cell(tmp_path, traces=traces, probe_rows=[("moe", "Marlin", "observed", 8),
                                                           ("kda.decode", "fused_kda_decode (native)", "observed", 3),
                                                           ("mla.decode", "Triton MLA", "observed", 2)])
    lanes = {l["lane"]: l for l in pf["lanes"]}
    assert lanes["moe"]["status"] == "disagrees" and lanes["moe"]["only_profiler"] == ["Triton"]
    assert lanes["kda.decode"]["status"] == "disagrees"
    assert lanes["kda.decode"]["only_probes"] == ["fused_kda_decode (native)"]
    assert lanes["mla.decode"]["status"] == "no kernel map" and lanes["mla.decode"]["no_map"] == ["Triton MLA"]
    assert pf["disagree"] == ["kda.decode", "moe"]
    text = _render(built)
    assert "> **torch.profiler disagrees with the probes** in b200_sxm/tp8 (kda.decode, moe)" in text
    assert "disagrees; profiler only: Triton |" in text
    assert "disagrees; no kernel in the traces: fused_kda_decode (native) |" in text


def test_no_traces_and_unreadable_traces_are_said_plainly(tmp_path):
    from probes.observe.traces import summarize

    d = tmp_path / "traces"
    d.mkdir()
    good = d / "decode-bs1_dp0_pp0_tp0_dcp0_ep0_rank0.17.pt.trace.json.gz"
    with gzip.open(good, "wt") as fh:
        json.dump({"traceEvents": [{"ph": "X", "cat": "kernel", "name": MARLIN, "args": {"graph id": 0}},
                                   {"ph": "X", "cat": "kernel", "name": MARLIN, "args": {"graph id": 3}},
                                   {"ph": "X", "cat": "cpu_op", "name": "aten::mm"}]}, fh)
    cut = d / "decode-bs1_dp0_pp0_tp1_dcp0_ep1_rank1.18.pt.trace.json.gz"
    cut.write_bytes(good.read_bytes()[:30])  # a trace the worker did not finish writing
    (d / "decode-bs1.profiler_out.txt").write_text("not a trace")
    traces = summarize(str(d))
    assert [t["rank"] for t in traces] == [0, 1] and "error" in traces[1]
    assert traces[0]["kernels"] == {MARLIN: {"direct": 1, "in_graph": 1}}
    built, pf = _cell(tmp_path / "a", traces=traces, probe_rows=[("moe", "Marlin", "observed", 1)])
    assert pf["traces"] == 2 and pf["unreadable"][0]["file"] == cut.name
    assert _render(built).count(f"- trace `{cut.name}` could not be read:") == 1

    built, pf = _cell(tmp_path / "b", traces=[], probe_rows=[("moe", "Marlin", "observed", 1)])
    assert pf["traces"] == 0 and {l["status"] for l in pf["lanes"]} == {"no traces"}
    assert "configured but wrote no trace" in _render(built)

    built, pf = _cell(tmp_path / "c", traces=[], probe_rows=[("moe", "Marlin", "observed", 1)], profiled=False)
    assert pf is None and "torch.profiler corroboration" not in _render(built)


def test_trace_names_parse_as_vllm_writes_them():
    from probes.observe.traces import parse_trace_name

    got = parse_trace_name("decode-bs48_dp1_pp0_tp0_dcp0_ep1_rank1.1764620000000000000.pt.trace.json.gz")
    assert got == {"worker": "decode-bs48_dp1_pp0_tp0_dcp0_ep1_rank1", "prefix": "decode-bs48", "rank": 1,
                   "dp": 1, "tp": 0, "ep": 1}
    assert parse_trace_name("rank3.12.pt.trace.json")["rank"] == 3  # vLLM's fallback without parallel groups
    assert parse_trace_name("decode-bs1.profiler_out.txt") is None
