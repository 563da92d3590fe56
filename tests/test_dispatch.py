"""Dispatch tiers on the host: a cell's dispatch records -> routing.json's table -> the ledger's section."""
import json
from pathlib import Path

from audit.models.kimi_k3 import KIMI_K3
from audit.report import dispatch
from audit.report import render
from audit.evidence.files import EvidenceFile
from tests.test_render import load

WORKLOADS = [{"phase": "decode", "tokens": t, "requests": t} for t in (1, 8, 64, 256)] + \
    [{"phase": "prefill", "tokens": t, "requests": 1} for t in (512, 2048, 8192)]


def _file(choices: list[str], *, layers=(1, 2, 3), errors=None) -> EvidenceFile:
    tiers = [{**w, "choice": c} for w, c in zip(WORKLOADS, choices)]
    return EvidenceFile(path=Path("x.jsonl"), header={"cell": {"system": "b200_sxm", "layout": "tp8"}}, records=[
        {"kind": "dispatch", "lane": "latent_tail", "role": "target", "group": "block_sparse_moe.experts",
         "layers": list(layers), "level": "dispatch", "source": "m:LatentMoERunner._select_tail_tier", "tiers": tiers},
        {"kind": "dispatch-stage", "seconds": 0.1, "errors": errors or {}, "workloads": WORKLOADS}])


def test_cell_table_and_spans():
    d = dispatch.cell_tiers(_file(["T0", "T0", "T0", "T1", "T2", "T2", "T2"]), KIMI_K3)
    row = d["lanes"]["latent_tail"][0]
    assert d["workloads"] == ["decode 1", "decode 8", "decode 64", "decode 256", "prefill 512", "prefill 2048",
                              "prefill 8192"]
    assert row["ranges"] == "1-3" and row["tiers"]["decode 256"] == "T1"
    assert dispatch.spans(row["tiers"]) == [{"span": "decode 1–64", "choice": "T0"},
                                            {"span": "decode 256", "choice": "T1"},
                                            {"span": "prefill 512–8192", "choice": "T2"}]
    # a verify width is its own phase, after prefill, labelled with its requests and width
    assert dispatch.workload_key({"phase": "verify", "tokens": 32, "requests": 8}) == "verify 32 (8x4)"
    assert dispatch.spans({"verify 32 (8x4)": "a", "decode 1": "a", "prefill 512": "a"}) == [
        {"span": "decode 1", "choice": "a"}, {"span": "prefill 512", "choice": "a"}, {"span": "verify 32 (8x4)", "choice": "a"}]


def test_no_stage_no_entry():
    f = EvidenceFile(path=Path("x.jsonl"), header={}, records=[])
    assert dispatch.cell_tiers(f, KIMI_K3) is None


def test_ledger_section_merges_cells_and_states_errors():
    r = load()
    same = dispatch.cell_tiers(_file(["T0", "T0", "T0", "T1", "T2", "T2", "T2"]), KIMI_K3)
    other = dispatch.cell_tiers(_file(["T1"] * 4 + ["T2"] * 3, errors={"mla": "ValueError: no builder"}), KIMI_K3)
    r["cells"][0]["dispatch"], r["cells"][1]["dispatch"], r["cells"][2]["dispatch"] = same, json.loads(json.dumps(same)), other
    text = render.render_ledger(r, profile=KIMI_K3, reproduce="x")
    section = text.split("## Dispatch tiers", 1)[1].split("\n## ", 1)[0]
    names = [f"{c['system']}/{c['layout']}" for c in r["cells"][:3]]
    assert f"| {names[0]}, {names[1]} | `block_sparse_moe.experts` | 1-3 | **decode 1–64**: T0; **decode 256**: T1; " \
           "**prefill 512–8192**: T2 |" in section
    assert f"| {names[2]} | `block_sparse_moe.experts` | 1-3 | **decode 1–256**: T1; **prefill 512–8192**: T2 |" in section
    assert f"| {names[2]} | `mla` | ValueError: no builder |" in section
    assert "level: dispatch" in section


def test_ledger_without_dispatch_has_no_section():
    r = load()
    assert any(c.get("dispatch") for c in r["cells"])
    assert "## Dispatch tiers" in render.render_ledger(r, profile=KIMI_K3, reproduce="x")
    for c in r["cells"]:  # an audit from before the dispatch stage existed
        c.pop("dispatch", None)
    assert "## Dispatch tiers" not in render.render_ledger(r, profile=KIMI_K3, reproduce="x")


def test_diff_names_moved_tiers():
    from audit.report import diff

    before, after = load(), load()
    before["cells"][0]["dispatch"] = dispatch.cell_tiers(_file(["T0", "T0", "T0", "T1", "T2", "T2", "T2"]), KIMI_K3)
    after["cells"][0]["dispatch"] = dispatch.cell_tiers(_file(["T0", "T0", "T1", "T1", "T2", "T2", "T1"]), KIMI_K3)
    d = diff.diff_routings(before, after, KIMI_K3)
    rows = [c for c in d["changes"] if c["facet"] == "dispatch"]
    assert sorted((r["title"], r["before"], r["after"], r["layers"]) for r in rows) == [
        ("Latent MoE tail tier · `block_sparse_moe.experts` at decode 64", "T0", "T1", "1-3"),
        ("Latent MoE tail tier · `block_sparse_moe.experts` at prefill 8192", "T2", "T1", "1-3")]
    assert all(r["class"] == "tier" and r["lane"] == "latent_tail" for r in rows)
    text = diff.render_diff(d, KIMI_K3)
    assert "## Per-call tiers (dispatch) (2)" in text
    assert ("| Latent MoE tail tier · `block_sparse_moe.experts` at decode 64 | T0 | T1 | tp8: l40s | 1-3 | a per-call "
            "choice moved |") in text
    assert diff.diff_routings(before, before, KIMI_K3)["empty"]
    assert dispatch.fold(["decode 1", "decode 8", "decode 256"], ["decode 1", "decode 8", "decode 64", "decode 256"]) \
        == "decode 1–8, decode 256"


def test_a_cell_built_only_in_the_newer_audit_shows_its_tiers_in_the_diff():
    """A cell whose construction stopped in the older audit (no tiers there) and finished in the newer one: its
    per-call tiers appear in the diff against "not built", not silently left out."""
    from audit.report import diff

    before, after = load(), load()
    cell = next(i for i, c in enumerate(after["cells"]) if c.get("dispatch"))
    before["cells"][cell].update(status="PARTIAL", dispatch=None,
                                 failure={"stage": "construct", "type": "builtins:NotImplementedError", "message": "x"})
    d = diff.diff_routings(before, after, KIMI_K3)
    rows = [c for c in d["changes"] if c["facet"] == "dispatch"]
    assert rows and all(c["before"] == diff.NOT_BUILT for c in rows)
    assert all(c["cells"] == [[after["cells"][cell]["system"], after["cells"][cell]["layout"]]] for c in rows)
    # what a deployment vLLM built on one side only runs: a consequence of how far construction got (here a stop
    # with no refusal named: the simulation's)
    assert all(c["serving"] and c["class"] == "stop" for c in rows)
    # an audit that resolved no tiers anywhere (older than the dispatch stage) still says nothing
    for c in before["cells"]:
        c["dispatch"] = None
    assert not [c for c in diff.diff_routings(before, after, KIMI_K3)["changes"] if c["facet"] == "dispatch"]
