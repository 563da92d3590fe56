"""The PR summary (audit/report/summary.py) on the committed reports: it tells the whole story of a pin bump, most
important first, with nothing consequential cut (the issue's "done when" for 0.32 -> 0.33, 0.31 -> 0.32 and
0.30 -> 0.33, checked against the routing files themselves)."""
import re

import pytest

from audit.models.kimi_k3 import KIMI_K3
from audit.report import changes
from audit.report.diff import diff_routings, load_routing
from audit.report.summary import View, batches, label_changes
from tests.conftest import ROOT

REPORTS = ROOT / "reports"
BUMPS = [("v0.32.0", "v0.33.0"), ("v0.31.0", "v0.32.0"), ("v0.30.0", "v0.33.0")]


@pytest.fixture(scope="module")
def diffs():
    out = {}
    for a, b in BUMPS:
        old, new = load_routing(REPORTS, a, KIMI_K3), load_routing(REPORTS, b, KIMI_K3)
        out[(a, b)] = (diff_routings(old, new, KIMI_K3), old, new)
    return out


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("bump", BUMPS, ids=[f"{a}..{b}" for a, b in BUMPS])
def test_every_consequential_row_is_named_and_nothing_is_cut(diffs, bump):
    d, old, new = diffs[bump]
    text = _flat(d["summary"])
    assert "… and" not in text and "more:" not in text and "(`unknown`)" not in text
    v = View(d, old, new, KIMI_K3)
    for r in d["changes"]:
        if r.get("serving") and r["class"] in ("standin", "experts", "path", "refusal", "kernel", "stop"):
            if r["facet"] == "candidates":
                continue  # its lane's own row says what vLLM chose
            assert r["where"] in text, (r["class"], r["title"], r["where"])
            name = v.title(r["lane"]) if r["lane"] else r["field"]
            if r["facet"] != "dispatch":
                assert name in text, (r["class"], name)
    # the counts are the diff's, in one unit
    assert d["headline"] in text
    assert changes.headline(changes.tally([r for r in d["changes"] if r["facet"] != "verdict"])) == d["headline"]


@pytest.mark.parametrize("bump", BUMPS, ids=[f"{a}..{b}" for a, b in BUMPS])
def test_every_audited_system_is_named_and_the_unchanged_ones_as_unchanged(diffs, bump):
    d, old, new = diffs[bump]
    text = _flat(d["summary"])
    touched = {c[0] for r in d["changes"] if r.get("serving") for c in r["cells"]}
    for system in {c["system"] for c in new["cells"]}:
        assert system in text, system
    unchanged = {c["system"] for c in new["cells"]} - touched
    if unchanged:
        tail = text.split("nchanged on ", 1)[1].split(" (no serving change", 1)[0]
        assert {s for s in unchanged if s in tail} == unchanged


@pytest.mark.parametrize("bump", BUMPS, ids=[f"{a}..{b}" for a, b in BUMPS])
def test_perf_db_rows_give_each_layout_its_own_batches(diffs, bump):
    """No product of layouts and batch sizes: each layout's batches, as the labels say, and the row count is the
    sum over layouts of systems x batches."""
    d, old, new = diffs[bump]
    text = _flat(d["summary"])
    moved = label_changes(old, new, KIMI_K3)
    for m in moved:
        for lay, e in m["layouts"].items():
            assert f"{lay}" in text and batches(e["batches"]) in text, (m["harness_lane"], lay)
    block = text.split("(re-measure them)", 1)[1].split("**Refusals**", 1)[0] if moved else ""
    assert sum(int(n) for n in re.findall(r"\((\d+) rows\)", block)) == sum(m["rows"] for m in moved)


def test_0_32_to_0_33_tells_the_whole_story(diffs):
    d, old, new = diffs[("v0.32.0", "v0.33.0")]
    text = _flat(d["summary"])
    # the experts class change of dep8 on SM 10.x (the only MoE change of the bump)
    assert re.search(r"experts class\*: Routed experts, dep8: SM 10\.0, SM 10\.3: KimiK3MegaMoEExperts → "
                     r"DeepGemmMegaMoEExperts", text)
    # tp8-specdec hands KDA, MLA and the experts to the specialized decode at decode 1, 8, 64
    assert ("K3's specialized decode now takes the steps at decode 1, 8, 64 in tp8-specdec: SM 10.0, SM 10.3" in text
            and "Routed experts, MLA attention, KDA decode" in text)
    # each spec layout with its own verify widths
    assert "tp8-mtp, tp8-eagle3 at verify 4, 32, 256, 1024; tp8-dspark at verify 5, 40, 320, 1280" in text
    # the systems that did not change, named
    assert "unchanged on SM 8.9 (l40s); SM 9.0 (h100_sxm, h200_sxm); SM 12.0 (rtx_pro_6000_server)" in text
    # tp8-fp8kv's prefill raise is a standing refusal
    assert re.search(r"in both builds: tp8-fp8kv: every audited system, at dispatch \(prefill 512, 2048, 8192\): "
                     r"AssertionError: Kimi-K3 fp8 KV cache requires an fp8 prefill", text)
    # the dep8 refusal moving from load to construction on SM 8.9, 9.0 and 12.0, named once
    assert "moved stage: dep8: l40s, SM 9.0, rtx_pro_6000_server, at construction, was at load" in text
    # a claim whose failing backend changed
    assert "`kda-generation-fused` still failing, now against flashinfer (was fla_triton)" in text
    # post-load stops as N of M steps, and what would confirm them
    assert "1 of 1279 post-load step(s)" in text and "only an observe run" in text
