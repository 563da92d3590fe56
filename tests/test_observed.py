"""Per-rank observed evidence, merged on the host: real evidence files written by the probes' recorder
and observe session in separate processes (one per rank), counting calls of a throwaway kernel
function; the merge, RANK_DISAGREE, graph replay attribution and the ledger section built from them."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

RANK_SCRIPT = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from probes.core.recorder import Recorder
from probes.observe.session import Kernel, ObserveSession
from audit.models.kimi_k3 import KIMI_K3

rank = int(os.environ["RANK"])
rec = Recorder(os.environ["SERVING_TRUTH_OUT"], role="vllm-process:python",
               meta={"mode": "observe", "cell": {"system": "b200_sxm", "layout": "tp8"}, "model": "kimi-k3"})
session = ObserveSession(rec, kernels=(Kernel("moe", "Marlin", "x:MarlinExperts.apply"),
                                       Kernel("moe", "Triton", "x:TritonExperts.apply"),
                                       Kernel("kda.decode", "fused_kda_decode (native)", "x:fused_kda_decode")),
                         scopes=())
c = session.counters

def kernel(x):
    return x

marlin = c.counting_wrapper(kernel, "Marlin")
triton = c.counting_wrapper(kernel, "Triton")
kda = c.counting_wrapper(kernel, "fused_kda_decode (native)")
c.set_phase("prefill")
for layer in (1, 2, 3):
    c.set_layer(layer)
    (triton if (rank == 1 and layer == 2) else marlin)(layer)   # rank 1 disagrees at layer 2
c.set_phase("decode")
gid = c.begin_capture("full num_tokens=8")
for layer in (0, 1, 2):
    c.set_layer(layer)
    kda(layer)
c.end_capture()
for _ in range(5):
    c.replayed(gid)
session.flush()
"""


def _write_ranks(tmp_path):
    out = tmp_path / "evidence" / "b200_sxm--tp8"
    out.mkdir(parents=True)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "SERVING_TRUTH_OUT": str(out)}
        subprocess.run([sys.executable, str(script), str(ROOT)], env=env, check=True)
    return tmp_path / "evidence"


def test_ranks_merge_with_disagreement_and_graph_replays(tmp_path):
    from audit.evidence import files as evidence
    from audit.report import routing
    from audit.report.expectations import load
    from audit.models.kimi_k3 import KIMI_K3
    from audit.report.render import render_ledger
    from audit.report.verdicts import attach

    files = evidence.read_dir(_write_ranks(tmp_path))
    assert sorted(f.header["rank"] for f in files) == [0, 1]
    built = routing.build_routing(files, KIMI_K3, pin={"name": "t", "vllm_version": "0.33.0", "wheel": "",
                                                       "wheel_sha256": "", "image": "", "platform_digests": {}},
                                  expected=[("b200_sxm", "tp8")])
    (cell,) = built["cells"]
    assert cell["evidence"] == "observed" and cell["status"] == "COMPLETE"
    rows = {(r["lane"], r["phase"], r["path"], r["evidence"]): r for r in cell["observed"]["rows"]}
    marlin = rows[("moe", "prefill", "Marlin", "observed")]
    assert marlin["layers"] == [1, 2, 3] and marlin["calls"] == 5 and marlin["ranks"] == ["0", "1"]
    assert rows[("moe", "prefill", "Triton", "observed")]["ranks"] == ["1"]
    in_graph = rows[("kda.decode", "decode", "fused_kda_decode (native)", "observed-in-graph")]
    # 3 captured layer calls x 5 replays x 2 ranks; the capture itself is not counted
    assert in_graph["calls"] == 30 and in_graph["layers"] == [0, 1, 2]
    assert ("kda.decode", "decode", "fused_kda_decode (native)", "observed") not in rows
    assert cell["observed"]["rank_disagree"] == [
        {"lane": "moe", "layer": 2, "phase": "prefill", "by_rank": {"0": ["Marlin"], "1": ["Triton"]}}]

    attach(built, load(ROOT / "expectations" / "kimi-k3.toml"), KIMI_K3, display_path="expectations/kimi-k3.toml")
    rd = [r for r in built["verdicts"]["rows"] if r["verdict"] == "RANK_DISAGREE"]
    assert rd and all(r["lane"] == "moe" and r["layers"] == "2" and r["evidence"] == "observed" for r in rd)
    assert "rank 0 ran Marlin; rank 1 ran Triton" in rd[0]["why"]
    text = render_ledger(built, profile=KIMI_K3, reproduce="make audit")
    assert "## Observed execution" in text and "**RANK_DISAGREE**" in text
    assert "graph `full num_tokens=8` (rank 0): captured once, replayed 5 time(s)" in text
    assert "| observed-in-graph |" in text
    json.dumps(built)  # the routing model stays JSON


def test_ranks_that_agree_raise_no_disagreement(tmp_path):
    from audit.report.observed import merge
    from audit.evidence import files as evidence

    d = _write_ranks(tmp_path)
    files = [f for f in evidence.read_dir(d) if f.header["rank"] == 0]
    merged = merge(files + files)  # the same rank twice: same paths
    assert merged["rank_disagree"] == []
